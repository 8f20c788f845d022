"""Test rig only (engines started by ``rig.engine_env``): NIXL's UCX progress thread sleeps in
``poll()`` instead of spinning.

NIXL 1.5.1's Python agent sets ``pthrDelay = 0`` unconditionally, and its UCX backend's progress
thread (``nixlUcxSharedThread::run``) passes that delay to ``poll()`` as the timeout, so an idle
engine's NIXL agent keeps one core busy for its whole life (seen with gdb: ``poll(nfds=2,
timeout=0)`` at 100 % of a core in the prefill engine's worker).  On the 2-core CI machine that
takes the cores from the engines under test.  Here the agent is created with a
``PDLAB_RIG_NIXL_POLL_US`` delay (default 1000 us): UCX events still wake the thread at once;
it only stops polling an idle worker thousands of times a second.  Nothing else of NIXL or vLLM
changes.  The rig puts this directory last on the engines' ``PYTHONPATH``, so pdpatch's own
``sitecustomize`` (when a test activates pdpatch that way) runs first and chains here; this one
chains on to any ``sitecustomize`` a test puts after it.
"""

import os
import runpy


def _quiet_nixl_progress_thread() -> None:
    try:
        import wrapt
    except ImportError:
        return
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


_quiet_nixl_progress_thread()
# the next sitecustomize on the path, imported by lab/rig/site_chain.py (found by file path:
# no import reaches lab/ in an engine)
_here = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(os.path.dirname(_here), "site_chain.py"))[
    "chain_next_sitecustomize"](_here)
del _quiet_nixl_progress_thread, _here
