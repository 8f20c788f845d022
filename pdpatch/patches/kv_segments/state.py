"""What the ``kv_segments`` wrappers of one NIXL worker share: its true geometry and the peer
conversions its ``add_remote_agent`` calls have in flight."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdpatch.kv import KVGeometry
    from pdpatch.patches.kv_segments.planning import Conversion

_ATTR = "_pdpatch_kv_segments"
_create_lock = threading.Lock()


@dataclass
class WorkerState:
    """Held on the worker itself, so every wrapper of that worker (each receives it as
    ``instance``) finds the same object and nothing outlives the worker."""

    # From the registered tensors' strides (what the worker advertises); None where pdpatch
    # does not model the memory.  Set at ``register_kv_caches``.
    geometry: KVGeometry | None = None
    # The conversion whose shadow metadata vLLM is building descriptors from, by ``id`` of
    # that shadow: ``_build_fa_remote`` receives the shadow, not the peer.
    _converting: dict[int, Conversion] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, conversion: Conversion) -> None:
        with self._lock:
            self._converting[id(conversion.shadow)] = conversion

    def end(self, conversion: Conversion) -> None:
        with self._lock:
            self._converting.pop(id(conversion.shadow), None)

    def converting(self, shadow: Any) -> Conversion | None:
        """The conversion in flight whose shadow ``shadow`` is, if any."""
        with self._lock:
            conversion = self._converting.get(id(shadow))
        return conversion if conversion is not None and conversion.shadow is shadow else None


def state_of(worker: Any) -> WorkerState:
    """The worker's state, created on first use (normally at ``register_kv_caches``)."""
    state = worker.__dict__.get(_ATTR)
    if state is None:
        with _create_lock:
            state = worker.__dict__.setdefault(_ATTR, WorkerState())
    return state


def existing_state(worker: Any) -> WorkerState | None:
    """The worker's state if a wrapper already created it (reads never create one)."""
    return getattr(worker, "__dict__", {}).get(_ATTR)
