"""Chaining for the rig's ``sitecustomize`` directories (``quiet_nixl``, ``wrapper_clock``).

Python imports only the first ``sitecustomize`` on ``sys.path``; each of the rig's imports the
next one, as if it were not there, so kvcached's or a test's own still runs.  Loaded by file
path from those directories (no ``sys.path`` entry for ``lab`` in an engine)."""

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
