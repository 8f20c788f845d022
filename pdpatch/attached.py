"""What pdpatch keeps on a vLLM object: one attribute, :data:`ATTR`, holding one
:class:`Attached` record, and this module is the only one that sets it.

Some state belongs to one vLLM object and must die with it: a NIXL worker's true KV geometry
and the peer conversions it has in flight (``kv_segments``), a scheduler half's prefix-cache
hits queued for the next metadata (``block_ids_bound``) or its engine's block-key fingerprint
(``block_keys``), the hit counts a 0.19-0.28 ``ReqMeta`` carries to the workers (pickled with
it).  Every wrapper of that object receives it as ``instance`` (or as an argument), so the
object is where the others find it.  Each patch keeps one entry, under its name, of the type
its module declares.

vLLM's own attributes that a patch changes on purpose (``worker.num_blocks``,
``enable_permute_local_kv``, ``worker.nixl_wrapper``'s proxies) are behaviour, not pdpatch's
data, and stay where vLLM reads them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

ATTR = "_pdpatch"
"""The one attribute pdpatch sets on vLLM objects."""

T = TypeVar("T")

_lock = threading.Lock()


@dataclass
class Attached:
    """pdpatch's record on one vLLM object: each patch's entry, by patch name.  Plain data, so
    it travels where the object does (a ``ReqMeta`` pickled to the workers)."""

    entries: dict[str, Any] = field(default_factory=dict)


def _record(obj: Any, create: bool) -> Attached | None:
    record = getattr(obj, "__dict__", {}).get(ATTR)
    if record is None and create:
        with _lock:
            record = obj.__dict__.setdefault(ATTR, Attached())
    return record


def entry(obj: Any, patch: str, factory: Callable[[], T]) -> T:
    """``patch``'s entry on ``obj``, made by ``factory`` on first use."""
    record = _record(obj, create=True)
    found = record.entries.get(patch)
    if found is None:
        with _lock:
            found = record.entries.setdefault(patch, factory())
    return found


def peek(obj: Any, patch: str) -> Any:
    """``patch``'s entry on ``obj`` if there is one (never creates one; None otherwise)."""
    record = _record(obj, create=False)
    return None if record is None else record.entries.get(patch)


def put(obj: Any, patch: str, value: Any) -> None:
    """Set ``patch``'s entry on ``obj``."""
    record = _record(obj, create=True)
    with _lock:
        record.entries[patch] = value


def pop(obj: Any, patch: str) -> Any:
    """Take ``patch``'s entry off ``obj`` (None if there was none)."""
    record = _record(obj, create=False)
    if record is None:
        return None
    with _lock:
        return record.entries.pop(patch, None)
