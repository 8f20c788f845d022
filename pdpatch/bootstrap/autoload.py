"""Run by ``pdpatch_autoload.pth`` in every interpreter of the environment.

It must cost nothing in a process that never imports ``vllm``: importing wrapt pulls in
asyncio and importlib.metadata (~55 ms on every ``python -c pass``).  So the ``.pth`` only puts
:class:`VllmImportTrigger` -- a stdlib-only finder -- at the front of ``sys.meta_path``.  The
first time anything looks up ``vllm`` it steps aside, registers the wrapt post-import hook on
``vllm`` and lets wrapt's own finder load it, so the hook fires exactly as a hook registered at
start would.  Where wrapt is already imported (kvcached's ``.pth`` ran first), the hook is
registered at once, after kvcached's, so kvcached's runs first and pdpatch wraps on top.

The master switch is read when the hook fires, not at interpreter start, because on Ray the
environment arrives late.  The file name sorts after ``kvcached_autopatch.pth``.
"""

from __future__ import annotations

import os
import sys

_registered = False


def init() -> None:
    """Never raises: a failing ``.pth`` line would print a traceback in every Python process."""
    global _registered
    if _registered:             # .pth lines run once, single-threaded, at interpreter start
        return
    _registered = True
    if "wrapt" in sys.modules or "vllm" in sys.modules:
        _register()
    else:
        sys.meta_path.insert(0, VllmImportTrigger())


def _register() -> bool:
    try:
        from wrapt import register_post_import_hook

        register_post_import_hook(on_vllm_import, "vllm")
        return True
    except Exception as exc:  # pragma: no cover - only when wrapt itself is broken
        if os.environ.get("ENABLE_PDPATCH") or os.environ.get("PDPATCH_ENABLED"):
            print(f"pdpatch: could not register the vllm import hook: {exc!r}", file=sys.stderr)
        return False


class VllmImportTrigger:
    """A meta-path finder that does nothing until ``vllm`` is looked up."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != "vllm":
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:          # another thread got here first
            return None
        if not _register():
            return None
        from wrapt.importer import ImportHookFinder

        # wrapt put its ImportHookFinder on sys.meta_path; the import in progress has
        # already passed that position, so ask it directly (it wraps vllm's loader so
        # that the hook runs once vllm is executed).
        for finder in sys.meta_path:
            if isinstance(finder, ImportHookFinder):
                return finder.find_spec(fullname, path, target)
        return None

    def invalidate_caches(self) -> None:
        """Nothing cached (importlib calls this on every finder)."""


def on_vllm_import(_module: object) -> None:
    """An exception here would fail ``import vllm`` itself, so only strict mode lets one out."""
    from pdpatch.bootstrap.entry import activate

    activate(source="import hook", raise_errors=False)
