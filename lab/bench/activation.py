"""Cost of pdpatch on `python -c "import vllm"`: not installed vs installed-but-disabled vs enabled.

All three run the same interpreter binary in throwaway venvs that see this venv's packages
through a path-only .pth (so no other .pth of this venv runs); "installed" adds the pdpatch
package and its `pdpatch_autoload.pth` to site-packages, where the wheel puts them.  Runs are
interleaved, median of N.  Also checks that enabling pdpatch imports no vLLM submodule eagerly.

A whole ``import vllm`` takes seconds and varies by tens of ms between runs (CPU time too),
more than pdpatch's share, so the goal (enabled adds <= 20 ms) is judged on finer measures
taken in the same run, each inside the child: the start-up cost of the ``.pth`` (``python -c
pass``), the first ``vllm`` lookup (the ``.pth``'s trigger imports wrapt and registers the hook;
timed with the modules stock ``import vllm`` loads anyway already imported, so only what
pdpatch adds is counted) and pdpatch's post-import hook.  The ``-X importtime`` self times of
the modules only present with pdpatch are printed too (they include importtime's own overhead).
Left out: wrapt's finder is asked about every later import (a dict lookup, ~1 us each).

    .venv/bin/python -m scripts.bench_activation [--runs 10] [--record | --json PATH]

With ``--record`` (or ``--json PATH``) every sample and the run's figures go into a raw record
(:mod:`lab.bench.record`); ``python -m lab.report`` pools the records into ``docs/proof.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from lab.bench import record

ROOT = Path(__file__).resolve().parents[2]
PTH = ROOT / "pdpatch" / "bootstrap" / "pdpatch_autoload.pth"
LIST_MODULES = ("import vllm, sys, json; "
                "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vllm'))))")


def make_venv(path: Path, with_pdpatch: bool) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next(path.glob("lib/python*/site-packages"))
    (site / "000-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if with_pdpatch:
        # The package where a wheel puts it (not the checkout root on sys.path: that also
        # exposes tests/, scripts/ and sitecustomize/ to every top-level import lookup).
        (site / "pdpatch").symlink_to(ROOT / "pdpatch", target_is_directory=True)
        (site / PTH.name).write_text(PTH.read_text())
    return path / "bin" / "python"


def env_for(enabled: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PDPATCH_") and k not in ("ENABLE_PDPATCH", "PYTHONPATH")}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if enabled:
        env["ENABLE_PDPATCH"] = "1"
    return env


IMPORT_TIMER = ("import time; t0 = time.perf_counter(); import vllm; "
                "print(time.perf_counter() - t0)")


def timed(python: Path, env: dict[str, str], code: str = IMPORT_TIMER
          ) -> tuple[float, float, float]:
    """Wall seconds and CPU seconds (user+sys) of the child, and what it printed as a number
    (for ``import vllm``: the import itself, timed inside the child).  CPU time stays
    meaningful when other work shares the machine; wall time is what an operator waits; the
    in-child time leaves out interpreter finalization, which after ``import vllm`` takes 1-2 s
    of torch/vLLM teardown and varies by far more than pdpatch's share."""
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([str(python), "-c", code], env=env, check=True,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    wall = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    printed = out.stdout.strip().splitlines()
    inside = float(printed[-1]) if printed else wall
    return wall, (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime), inside


def import_self_times(python: Path, env: dict[str, str]) -> dict[str, float]:
    """Module -> self import time in seconds, from ``-X importtime`` of ``import vllm``."""
    out = subprocess.run([str(python), "-X", "importtime", "-c", "import vllm"], env=env,
                         check=True, capture_output=True, text=True)
    times = {}
    for line in out.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            self_us, _cum, name = line[len("import time:"):].split("|")
            if self_us.strip().isdigit():
                times[name.strip()] = int(self_us) / 1e6
    return times


HOOK_TIMER = """
import time, pdpatch.bootstrap.autoload as autoload
hook, spent = autoload.on_vllm_import, []
def timed_hook(module):
    t0 = time.perf_counter()
    hook(module)
    spent.append(time.perf_counter() - t0)
autoload.on_vllm_import = timed_hook      # looked up when the first `vllm` lookup registers it
import vllm
print(spent[0])
"""


def hook_seconds(python: Path, env: dict[str, str]) -> float:
    """Time spent in pdpatch's post-import hook on ``vllm`` (read the switch; when enabled,
    import pdpatch's modules, decide every patch, arm the wrappers, log the summary line),
    measured inside the child, so the seconds-long rest of ``import vllm`` adds no noise."""
    out = subprocess.run([str(python), "-c", HOOK_TIMER], env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


LOOKUP_TIMER = """
import importlib, sys, time
for name in {preload!r}:
    importlib.import_module(name)
import pdpatch.bootstrap.autoload as autoload
trigger = next(f for f in sys.meta_path if isinstance(f, autoload.VllmImportTrigger))
t0 = time.perf_counter()
trigger.find_spec("vllm")
print(time.perf_counter() - t0)
"""


def modules_after(python: Path, env: dict[str, str], code: str) -> set[str]:
    out = subprocess.run(
        [str(python), "-c", "import sys, json; before = set(sys.modules); " + code
         + "; print(json.dumps(sorted(set(sys.modules) - before)))"],
        env=env, check=True, capture_output=True, text=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def lookup_seconds(python: Path, env: dict[str, str], preload: list[str]) -> float:
    """The first ``vllm`` lookup, timed inside the child: the ``.pth``'s trigger imports wrapt
    and registers pdpatch's hook.  ``preload``: the modules wrapt needs that stock ``import
    vllm`` imports anyway, imported before the clock starts."""
    out = subprocess.run([str(python), "-c", LOOKUP_TIMER.format(preload=preload)], env=env,
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def vllm_modules(python: Path, env: dict[str, str]) -> list[str]:
    out = subprocess.run([str(python), "-c", LIST_MODULES], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    record.add_arguments(parser)
    args = parser.parse_args(argv)
    rec = record.Recorder("activation", args, argv)
    samples, derived = rec.samples, rec.derived
    with tempfile.TemporaryDirectory() as tmp:
        bare = make_venv(Path(tmp) / "bare", with_pdpatch=False)
        installed = make_venv(Path(tmp) / "installed", with_pdpatch=True)
        variants = {"not installed": (bare, env_for(False)),
                    "installed, disabled": (installed, env_for(False)),
                    "installed, enabled": (installed, env_for(True))}
        for python, env in variants.values():       # warm the page cache once
            timed(python, env)
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
        for _ in range(args.runs):
            for name, (python, env) in variants.items():
                times[name].append(timed(python, env))
        samples["import vllm (wall s, cpu s, in-child import s)"] = times
        print(f"python -c 'import vllm', median of {args.runs} interleaved runs")
        for kind, index in (("wall", 0), ("cpu", 1), ("in-child import", 2)):
            base = statistics.median(t[index] for t in times["not installed"])
            for name, samples_ in times.items():
                med = statistics.median(t[index] for t in samples_)
                derived[f"import vllm {kind} ms: {name}"] = med * 1000
                derived[f"import vllm {kind}: {name} / not installed"] = med / base
                print(f"  {kind:15s} {name:22s} {med * 1000:8.1f} ms   ratio {med / base:6.3f}"
                      f"   ({(med - base) * 1000:+7.1f} ms)")
        print(f"python -c pass (the .pth in a process without vLLM), median of "
              f"{3 * args.runs} interleaved runs")
        starts: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(3 * args.runs):
            for name, (python, env) in variants.items():
                starts[name].append(timed(python, env, "pass")[0])
        samples["python -c pass (wall s)"] = starts
        base = statistics.median(starts["not installed"])
        for name, samples_ in starts.items():
            med = statistics.median(samples_)
            derived[f"python -c pass ms: {name}"] = med * 1000
            print(f"  wall {name:22s} {med * 1000:8.1f} ms   ({(med - base) * 1000:+7.1f} ms)")
        print("import vllm -X importtime: modules only present with pdpatch, summed self time "
              "(median of 5)")
        runs = {name: [import_self_times(*v) for _ in range(5)] for name, v in variants.items()}
        stock = set().union(*runs["not installed"])
        for name in ("installed, disabled", "installed, enabled"):
            added = set().union(*runs[name]) - stock
            sums = [sum(t.get(m, 0.0) for m in added) for t in runs[name]]
            added_s = statistics.median(sums)
            samples[f"-X importtime, modules only present with pdpatch: {name}"] = sorted(added)
            samples[f"-X importtime, their summed self time (s): {name}"] = sums
            derived[f"-X importtime added modules: {name}"] = len(added)
            derived[f"-X importtime added ms: {name}"] = added_s * 1000
            print(f"  {name:22s} {len(added):4d} modules  {added_s * 1000:7.1f} ms")
        print(f"pdpatch's hook on vllm, timed inside the child (median of {args.runs})")
        hooks = {name: [hook_seconds(*variants[name]) for _ in range(args.runs)]
                 for name in ("installed, disabled", "installed, enabled")}
        samples["hook on vllm (s)"] = hooks
        hook = {name: statistics.median(xs) for name, xs in hooks.items()}
        for name, med in hook.items():
            derived[f"hook ms: {name}"] = med * 1000
            print(f"  {name:22s} {med * 1000:7.2f} ms")
        # `stock`: every module stock `import vllm` loads (from the importtime runs above)
        wrapt_needs = modules_after(*variants["not installed"], "import wrapt.importer")
        preload = sorted(wrapt_needs & stock)
        lookups = [lookup_seconds(*variants["installed, enabled"], preload)
                   for _ in range(args.runs)]
        samples["first vllm lookup: preloaded modules"] = preload
        samples["first vllm lookup (s)"] = lookups
        lookup = statistics.median(lookups)
        derived["first vllm lookup ms"] = lookup * 1000
        print(f"first vllm lookup (wrapt import + hook registration; {len(preload)} modules "
              f"stock vLLM imports anyway preloaded), timed inside the child (median of "
              f"{args.runs}): {lookup * 1000:.2f} ms")
        # What enabling adds to `import vllm`: the .pth at start-up, the first `vllm` lookup
        # and the hook (whose own imports are part of its time).
        startup = statistics.median(starts["installed, enabled"]) - base
        total = startup + lookup + hook["installed, enabled"]
        derived["start-up ms: installed, enabled"] = startup * 1000
        derived["enabled pdpatch adds ms"] = total * 1000
        print(f"enabled pdpatch adds to import vllm: {total * 1000:.1f} ms = start-up "
              f"{startup * 1000:.1f} + first vllm lookup {lookup * 1000:.1f} + hook "
              f"{hook['installed, enabled'] * 1000:.1f} (goal: <= 20 ms)")
        extra = sorted(set(vllm_modules(*variants["installed, enabled"]))
                       - set(vllm_modules(*variants["installed, disabled"])))
        samples["vLLM submodules imported only because pdpatch is enabled"] = extra
        derived["vLLM submodules imported only because pdpatch is enabled"] = len(extra)
        print(f"vLLM submodules imported only because pdpatch is enabled: {extra or 'none'}")
    rec.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
