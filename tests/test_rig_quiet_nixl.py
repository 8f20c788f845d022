"""The rig's engines run NIXL's UCX progress thread with a poll delay (``rig/quiet_nixl``): an
idle NIXL agent as NIXL 1.5.1 makes it spins a core; one made under the rig's environment
sleeps.  Measured on a process that makes one agent and then idles: how long its threads were
runnable (on a CPU or waiting in the run queue, ``/proc/<pid>/task/*/schedstat``), which for a
spinning thread is the whole idle time however loaded the machine is (its CPU time alone
depends on what else runs: CI once gave it 0.5 s of 2 s), and the CPU time they used, which for
a thread that sleeps between short wake-ups stays small under load too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lab.rig import engine_env

IDLE_S = 2.0
PROBE = f"""
import json, os, time
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))

def runnable_ns():
    out = {{}}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{{tid}}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except OSError:  # a thread that ended meanwhile
            continue
        out[tid] = int(run) + int(wait)
    return out

t, tc = runnable_ns(), os.times()
time.sleep({IDLE_S})
u, uc = runnable_ns(), os.times()
print(json.dumps({{"runnable": sum(u[k] - t[k] for k in t.keys() & u.keys()) / 1e9,
                  "cpu": (uc.user - tc.user) + (uc.system - tc.system)}}))
"""


def idle(pythonpath: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rig_engines_idle_nixl_agent_sleeps_where_stock_spins() -> None:
    stock = idle("")
    quiet = idle(str(engine_env.QUIET_NIXL))
    # stock keeps one thread runnable for the whole idle time; the quiet agent wakes once a
    # millisecond for a few microseconds of work
    assert stock["runnable"] > 0.8 * IDLE_S, stock
    assert quiet["cpu"] < 0.1 * IDLE_S, quiet
