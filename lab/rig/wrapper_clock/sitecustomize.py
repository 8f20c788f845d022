"""Lab only: how much host time pdpatch's own wrappers take in an engine, per wrapped target.

On when the engine's environment has ``PDLAB_WRAPPER_CLOCK=<dir>`` and this directory is on its
``PYTHONPATH`` after pdpatch's own ``sitecustomize`` (the rigs put it there when the variable is
set: ``lab.rig.engine_env``, ``lab.gpu.engines``).  Each target pdpatch wraps gets its wrapper
timed around the call, less the time spent in what it wraps (vLLM's function, or another
patch's wrapper): what is left is pdpatch's own work there (its checks, key digests, plans)
plus wrapt's call.  Work a wrapper starts on another thread is not in it.

Written to ``<dir>/wrapper-clock-<pid>.json`` once a second by the clock's own thread (never on
the timed calls' threads) and at exit: label ->
``calls``, ``own_ms``, ``inclusive_ms``, ``max_own_ms`` (one call's; ``lab.wrapper_clock``
sums a run's files).  The
TTFT question it answers: what a request costs in pdpatch's code inside real engines, where
benchmarks of single functions cannot see the calls per step.  With
``PDLAB_WRAPPER_CLOCK_STALL_S=<s>`` it also prints every thread's stack to the engine's log,
once per call, for a wrapper call running longer than that.

``PDLAB_STEP_CLOCK=<dir>`` (on in stock engines too: the rigs put this directory on every
engine's path when it is set) times vLLM's own per-step calls, whole
(:data:`STEP_TARGETS`, or ``PDLAB_STEP_CLOCK_TARGETS=module:qualname,...``), into
``<dir>/step-clock-<pid>.json``: label -> ``calls``, ``total_ms`` and a histogram of the
durations (``buckets``: bucket ``i`` holds calls of 10**(i/100) us, 2.3 % wide).  The question
it answers: does a pdpatch engine's step take longer than a stock engine's by more than the
wrapper clock's own time -- cost that no wrapper shows.

``PDLAB_SWITCH_INTERVAL=<s>`` sets the interpreter's switch interval (``sys.setswitchinterval``;
5 ms by default) in every engine.  The question it answers: does pdpatch's chunk driver thread
wait for the GIL at each wake-up while vLLM's engine thread runs Python (docs/gpu_results.md,
runs cj-ck and cu)."""

import os
import runpy


def _clock(out_dir: str) -> None:
    import atexit
    import itertools
    import json
    import threading
    import time

    import wrapt

    totals: dict[str, list] = {}          # label -> [calls, own s, inclusive s, largest own s]
    lock = threading.Lock()
    path = os.path.join(out_dir, f"wrapper-clock-{os.getpid()}.json")

    def dump() -> None:
        with lock:
            data = {k: {"calls": c, "own_ms": own * 1e3, "inclusive_ms": inc * 1e3,
                        "max_own_ms": top * 1e3} for k, (c, own, inc, top) in totals.items()}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def timed(wrapper, label: str):
        def clocked(wrapped, instance, args, kwargs):
            inner = 0.0

            def call(*a, **k):
                nonlocal inner
                s = time.perf_counter()
                try:
                    return wrapped(*a, **k)
                finally:
                    inner += time.perf_counter() - s

            # not functools.wraps: its ~2 us a call would count as pdpatch's own time
            call.__name__ = getattr(wrapped, "__name__", "call")

            s = time.perf_counter()
            key = next(numbers)
            if stall_s > 0:
                running[key] = (label, s)
            try:
                return wrapper(call, instance, args, kwargs)
            finally:
                running.pop(key, None)
                total = time.perf_counter() - s
                with lock:
                    t = totals.setdefault(label, [0, 0.0, 0.0, 0.0])
                    t[0] += 1
                    t[1] += total - inner
                    t[2] += total
                    t[3] = max(t[3], total - inner)
        return clocked

    def on_installer(installer) -> None:
        real = installer._wrap

        def clocked_wrap(ps, ts, module):
            # A patch names its wrapper lazily (pdpatch.registry.Lazy), resolved now that vLLM
            # imports the module, as the installer would: the clock times the wrapper itself.
            wrapper = ts.target.wrapper
            wrapper = wrapper.resolve() if hasattr(wrapper, "resolve") else wrapper
            ts.target = ts.target._replace(wrapper=timed(wrapper, ts.target.label))
            return real(ps, ts, module)

        installer._wrap = clocked_wrap

    stall_s = float(os.environ.get("PDLAB_WRAPPER_CLOCK_STALL_S", "0"))
    running: dict[int, tuple[str, float]] = {}      # running call's number -> label, start
    numbers = itertools.count()

    def watch() -> None:
        """Write the records once a second; with ``stall_s``, also dump every thread's stack
        once for a wrapper call running past it."""
        import faulthandler
        import sys

        tick = min(1.0, stall_s / 4) if stall_s > 0 else 1.0
        seen: set[int] = set()
        written = time.monotonic()
        while True:
            time.sleep(tick)
            if time.monotonic() - written >= 1.0:
                written = time.monotonic()
                dump()
            now = time.perf_counter()
            for key, (label, began) in list(running.items()):
                if key not in seen and now - began > stall_s > 0:
                    seen.add(key)
                    print(f"wrapper clock: {label} running for {now - began:.2f} s; stacks:",
                          file=sys.stderr, flush=True)
                    faulthandler.dump_traceback(sys.stderr, all_threads=True)

    threading.Thread(target=watch, daemon=True, name="pdlab-wrapper-clock").start()
    os.makedirs(out_dir, exist_ok=True)
    atexit.register(dump)
    wrapt.register_post_import_hook(on_installer, "pdpatch.installer")


STEP_TARGETS = (
    "vllm.v1.engine.core:EngineCore.step",
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
)


def _steps(out_dir: str, targets: list[str]) -> None:
    import atexit
    import math
    import sys
    import threading
    import time

    import wrapt

    totals: dict[str, list] = {}        # label -> [calls, total s, {bucket: calls}]
    lock = threading.Lock()
    path = os.path.join(out_dir, f"step-clock-{os.getpid()}.json")

    def record(label: str, took: float) -> None:
        bucket = max(0, round(100 * math.log10(max(took, 1e-9) * 1e6)))
        with lock:
            t = totals.setdefault(label, [0, 0.0, {}])
            t[0] += 1
            t[1] += took
            t[2][bucket] = t[2].get(bucket, 0) + 1

    def timer(label: str):
        def timed(wrapped, instance, args, kwargs):
            s = time.perf_counter()
            try:
                return wrapped(*args, **kwargs)
            finally:
                record(label, time.perf_counter() - s)
        return timed

    def hook(module_name: str, qualname: str):
        def wrap(module) -> None:
            try:
                wrapt.wrap_function_wrapper(module, qualname, timer(f"{module_name}:{qualname}"))
            except AttributeError:
                print(f"step clock: {module_name} has no {qualname} (not timed)",
                      file=sys.stderr, flush=True)
        return wrap

    def dump() -> None:
        import json

        with lock:
            data = {k: {"calls": c, "total_ms": tot * 1e3, "buckets": dict(b)}
                    for k, (c, tot, b) in totals.items()}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def every_second() -> None:
        while True:
            time.sleep(1.0)
            dump()

    os.makedirs(out_dir, exist_ok=True)
    for target in targets:
        module_name, _, qualname = target.partition(":")
        wrapt.register_post_import_hook(hook(module_name, qualname), module_name)
    threading.Thread(target=every_second, daemon=True, name="pdlab-step-clock").start()
    atexit.register(dump)


if os.environ.get("PDLAB_SWITCH_INTERVAL"):
    import sys

    sys.setswitchinterval(float(os.environ["PDLAB_SWITCH_INTERVAL"]))
if os.environ.get("PDLAB_WRAPPER_CLOCK"):
    _clock(os.environ["PDLAB_WRAPPER_CLOCK"])
if os.environ.get("PDLAB_STEP_CLOCK"):
    _steps(os.environ["PDLAB_STEP_CLOCK"],
           [t for t in os.environ.get("PDLAB_STEP_CLOCK_TARGETS", "").split(",") if t]
           or list(STEP_TARGETS))
# the next sitecustomize on the path, imported by lab/rig/site_chain.py (found by file path:
# no import reaches lab/ in an engine)
_here = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(os.path.dirname(_here), "site_chain.py"))[
    "chain_next_sitecustomize"](_here)
del _clock, _steps, _here
