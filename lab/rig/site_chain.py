"""Chaining for the rig's ``sitecustomize`` directories (``lab/rig/quiet_spin``,
``lab/rig/amx_permission``, ``lab/rig/cpu_runner``, ``lab/rig/wrapper_clock``,
``lab/rig/peer_census``).

Python imports only the first ``sitecustomize`` on ``sys.path``; each of the rig's imports the
next one, as if it were not there, so the other's, kvcached's or a test's own still runs.
Loaded by file path (no ``sys.path`` entry for ``lab`` in an engine): the two statements at
the end of each shim that find this file next to their directory are all each one repeats.
The CPU rig's 14-30 s handshake stalls came with the NIXL part of ``quiet_spin`` in this form
and in its own copy alike (``docs/gpu_results.md`` runs at-aw): not this code's (they were
vLLM's spinning message-queue readers, see ``quiet_spin``)."""

from __future__ import annotations

import importlib.util
import os
import sys


def chain_next_sitecustomize(here: str) -> None:
    """Import the ``sitecustomize`` after directory ``here`` on the path."""
    me = sys.modules.pop("sitecustomize", None)
    hidden = [(i, p) for i, p in enumerate(sys.path) if os.path.abspath(p or ".") == here]
    for i, _ in reversed(hidden):
        del sys.path[i]
    try:
        if importlib.util.find_spec("sitecustomize") is not None:
            import sitecustomize  # noqa: F401
    finally:
        for i, p in hidden:
            sys.path.insert(i, p)
        if me is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = me
