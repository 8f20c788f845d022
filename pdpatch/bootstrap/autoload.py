"""Run by ``pdpatch_autoload.pth`` in every interpreter of the environment.

It only registers a wrapt post-import hook on ``vllm``; the master switch is read when that
hook fires, not at interpreter start, because on Ray the environment arrives late.  The file
name sorts after ``kvcached_autopatch.pth`` so kvcached's own hook is registered (and runs)
first and pdpatch wraps on top of it.
"""

from __future__ import annotations

import os

_registered = False


def init() -> None:
    """Never raises: a failing ``.pth`` line would print a traceback in every Python process."""
    global _registered
    if _registered:
        return
    try:
        from wrapt import register_post_import_hook

        register_post_import_hook(on_vllm_import, "vllm")
        _registered = True
    except Exception as exc:  # pragma: no cover - only when wrapt itself is broken
        if os.environ.get("ENABLE_PDPATCH") or os.environ.get("PDPATCH_ENABLED"):
            import sys

            print(f"pdpatch: could not register the vllm import hook: {exc!r}", file=sys.stderr)


def on_vllm_import(_module: object) -> None:
    """An exception here would fail ``import vllm`` itself, so only strict mode lets one out."""
    from pdpatch.bootstrap.entry import activate

    activate(source="import hook", raise_errors=False)
