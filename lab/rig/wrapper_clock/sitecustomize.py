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
once per call, for a wrapper call running longer than that."""

import os
import runpy


def _clock(out_dir: str) -> None:
    import atexit
    import functools
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

            @functools.wraps(wrapped)
            def call(*a, **k):
                nonlocal inner
                s = time.perf_counter()
                try:
                    return wrapped(*a, **k)
                finally:
                    inner += time.perf_counter() - s

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
            ts.target = ts.target._replace(wrapper=timed(ts.target.wrapper, ts.target.label))
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


def _chain() -> None:
    """Import the next ``sitecustomize`` on the path (``lab/rig/site_chain.py``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    chain = runpy.run_path(os.path.join(os.path.dirname(here), "site_chain.py"))
    chain["chain_next_sitecustomize"](here)


if os.environ.get("PDLAB_WRAPPER_CLOCK"):
    _clock(os.environ["PDLAB_WRAPPER_CLOCK"])
_chain()
del _clock, _chain
