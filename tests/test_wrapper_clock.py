"""The lab's wrapper clock (``lab/rig/wrapper_clock``), which measures pdpatch's own host time
per wrapped target inside real engines: activated the way the rigs activate it (its directory
on ``PYTHONPATH``, ``PDLAB_WRAPPER_CLOCK`` set), it times a wrapper through pdpatch's real
installer and leaves out the time of what the wrapper wraps, and prints the stacks of a call
that runs too long."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lab import wrapper_clock
from lab.rig import engine_env

PROBE = """
import sys, time, types
from pdpatch import installer
from pdpatch.registry import Target

mod = types.ModuleType("clockprobe")
sys.modules["clockprobe"] = mod

def f(x):
    time.sleep(0.05)
    return x

def wrapper(wrapped, instance, args, kwargs):
    time.sleep(0.02)
    return wrapped(*args, **kwargs) + 1

mod.f = f
ps = installer.PatchState(patch=types.SimpleNamespace(name="probe"), status="active", reason="")
installer._wrap(ps, installer.TargetState(Target("clockprobe", "f", wrapper)), mod)
assert mod.f(1) == 2 and mod.f(2) == 3
"""


def test_clock_times_a_wrapper_without_what_it_wraps(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(engine_env.WRAPPER_CLOCK),
           "PDLAB_WRAPPER_CLOCK": str(tmp_path / "clock"), "PDLAB_WRAPPER_CLOCK_STALL_S": "0.03"}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    # each 70-ms call outlived the 30-ms stall bound: its stacks, with the wrapper's frame
    assert run.stderr.count("wrapper clock: clockprobe:f running for") == 2, run.stderr
    assert "in wrapper" in run.stderr, run.stderr
    [(engine, labels)] = wrapper_clock.load(tmp_path / "clock").items()
    rec = labels["clockprobe:f"]
    assert rec["calls"] == 2
    assert 40 <= rec["own_ms"] < 90, rec              # 2 x 20 ms of the wrapper's own
    assert rec["inclusive_ms"] - rec["own_ms"] >= 100, rec   # 2 x 50 ms inside f
    assert "| clockprobe:f | 2 |" in wrapper_clock.table({engine: labels}, requests=2)


def test_the_rigs_sitecustomize_directories_chain_to_the_next(tmp_path: Path) -> None:
    """Python imports only the first ``sitecustomize`` on the path: each of the rig's (the
    clock's, ``peer_census``', ``cpu_runner``'s, ``amx_permission``'s and ``quiet_spin``'s)
    imports the next, so kvcached's (GPU rig) or a test's still runs."""
    (tmp_path / "sitecustomize.py").write_text("print('next sitecustomize ran')\n")
    path = os.pathsep.join([str(engine_env.WRAPPER_CLOCK), str(engine_env.PEER_CENSUS),
                            str(engine_env.CPU_RUNNER), str(engine_env.AMX_PERMISSION),
                            str(engine_env.QUIET_SPIN), str(tmp_path)])
    run = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("next sitecustomize ran") == 1, run.stdout


STEP_PROBE = """
import time

class Engine:
    def step(self, s):
        time.sleep(s)

class Other:
    pass
"""


def test_step_clock_times_whole_calls_in_any_engine(tmp_path: Path) -> None:
    """The step clock needs no pdpatch (stock engines are timed alike): each call of a target
    lands in its histogram, whose quantiles are the calls' durations; a target the module
    lacks is named on stderr and the rest still timed."""
    (tmp_path / "stepprobe.py").write_text(STEP_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(engine_env.WRAPPER_CLOCK),
                                                        str(tmp_path)]),
           "PDLAB_STEP_CLOCK": str(tmp_path / "steps" / "engine-a"),
           "PDLAB_STEP_CLOCK_TARGETS": "stepprobe:Engine.step,stepprobe:Other.step"}
    env.pop("PDLAB_WRAPPER_CLOCK", None)
    code = "import stepprobe\ne = stepprobe.Engine()\nfor s in [0.01] * 8 + [0.08] * 2: e.step(s)"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "step clock: stepprobe has no Other.step (not timed)" in run.stderr, run.stderr
    records = wrapper_clock.load_steps(tmp_path / "steps")
    rec = records["engine-a"]["stepprobe:Engine.step"]
    assert rec["calls"] == 10 and 230 <= rec["total_ms"] < 400, rec
    # a bucket's value is within 1.2 % of its calls'
    assert 9_800 <= wrapper_clock.quantile_us(rec["buckets"], 0.5) < 20_000, rec
    assert 78_000 <= wrapper_clock.quantile_us(rec["buckets"], 0.95) < 100_000, rec
    assert "| engine-a | Engine.step | 10 |" in wrapper_clock.step_table(records)
