"""Test rig only (engines started by ``rig.engine_env``): threads that wait for work sleep
instead of spinning a core, so that the engines under test get the 2-core machine's CPUs.

Two spinners, both vLLM's or NIXL's defaults, tuned for machines with cores to spare:

* **NIXL's UCX progress thread.**  NIXL 1.5.1's Python agent sets ``pthrDelay = 0``
  unconditionally, and its UCX backend's progress thread (``nixlUcxSharedThread::run``) passes
  that delay to ``poll()`` as the timeout, so an idle engine's NIXL agent keeps one core busy for
  its whole life (gdb: ``poll(nfds=2, timeout=0)`` at 100 % of a core).  Here the agent is
  created with a ``PDLAB_RIG_NIXL_POLL_US`` delay (default 1000 us): UCX events still wake the
  thread at once; it only stops polling an idle worker thousands of times a second.
* **vLLM's shared-memory message queue readers** (``shm_broadcast.SpinCondition``: a worker
  waiting for the engine core's next step, the engine core waiting for the worker's answer).
  After each message a reader spins on ``sched_yield`` for ``busy_loop_s`` = 1 s, and an engine
  that holds a request -- a prefill engine keeping a finished prompt's blocks for its decode
  peer, a decode engine waiting for them -- steps every millisecond, so its worker never stops
  spinning: P's worker used 1.0-1.2 s of CPU per second through a whole P/D request, and with
  one of the two cores gone, first P/D requests took 36-120 s (4 of 8 past the rig's 120 s).
  Here a reader parks on the queue's own ZMQ notification after every message
  (``busy_loop_s=0``), and a parked reader re-reads the shared-memory written-flag every 20 ms
  (``SHM_READER_RECHECK_INTERVAL_MS``, 5000 in vLLM 0.34: vllm#45224's remedy for a
  notification the queue's PUB socket drops, ``SNDHWM=1``).  Parked with vLLM's 5 s recheck,
  the same requests took 5.3-15.2 s, multiples of it, at almost no CPU: the engines' readers
  do miss notifications, which a spinning reader never waits for.  With both: 0.1-0.2 s, 8 of
  8 (``python -m scripts.rig_first_requests``: D restarted before each request).  Message order
  and content are the queue's own.
  ``PDLAB_RIG_MQ_SPIN=1`` keeps vLLM's spinning (the comparison the test makes); releases
  without ``SpinCondition`` are left alone.

Nothing else of NIXL or vLLM changes.  The rig puts this directory last on the engines'
``PYTHONPATH``, so pdpatch's own ``sitecustomize`` (when a test activates pdpatch that way) runs
first and chains here; this one chains on to any ``sitecustomize`` a test puts after it.
"""

import os
import runpy

MQ_RECHECK_MS = 20


def _quiet_nixl_progress_thread(wrapt) -> None:
    delay_us = int(os.environ.get("PDLAB_RIG_NIXL_POLL_US", "1000"))

    def patch(api) -> None:
        bindings = api.nixlBind

        class _Bindings:
            """nixlBind as the agent sees it, but its config's poll delay raised."""

            def __getattr__(self, name):
                return getattr(bindings, name)

            @staticmethod
            def nixlAgent(name, config):
                config.pthrDelay = max(config.pthrDelay, delay_us)
                return bindings.nixlAgent(name, config)

        api.nixlBind = _Bindings()

    for module in ("nixl_cu13._api", "nixl_cu12._api"):
        wrapt.register_post_import_hook(patch, module)


def _quiet_message_queue_readers(wrapt) -> None:
    if os.environ.get("PDLAB_RIG_MQ_SPIN") == "1":
        return

    def patch(shm_broadcast) -> None:
        spin = getattr(shm_broadcast, "SpinCondition", None)
        if spin is None or not hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):
            return                                  # a release lacking either: left alone
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = MQ_RECHECK_MS

        def park_at_once(wrapped, instance, args, kwargs):
            kwargs["busy_loop_s"] = 0
            return wrapped(*args[:3], **kwargs)     # is_reader, context, notify_address

        wrapt.wrap_function_wrapper(spin, "__init__", park_at_once)

    wrapt.register_post_import_hook(
        patch, "vllm.distributed.device_communicators.shm_broadcast")


def _quiet() -> None:
    try:
        import wrapt
    except ImportError:
        return
    _quiet_nixl_progress_thread(wrapt)
    _quiet_message_queue_readers(wrapt)


_quiet()
# the next sitecustomize on the path, imported by lab/rig/site_chain.py (found by file path:
# no import reaches lab/ in an engine)
_here = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(os.path.dirname(_here), "site_chain.py"))[
    "chain_next_sitecustomize"](_here)
del _quiet, _here
