"""Where ``kv_segments`` keeps its state: :class:`KvSegmentsState` for the process (counters,
the hash alternates; ``installer.state_of(NAME)``), :class:`WorkerState` on each NIXL worker
(``installer.object_state(NAME, worker)``).  What one running handshake learns is its
:class:`~pdpatch.patches.kv_segments.handshake.Handshake`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdpatch import attached
from pdpatch.installer import object_state, state_of
from pdpatch.patches.kv_segments.settings import NAME
from pdpatch.state import Counter, State, counter

if TYPE_CHECKING:
    from pdpatch.kv import KVGeometry
    from pdpatch.kv.staging.reads import StagingStats
    from pdpatch.patches.kv_segments.planning import Conversion


@dataclass
class KvSegmentsState(State):
    """What this process's patch did (for tests, ``pdpatch.status()`` and ``/metrics``)."""

    advertised: int = counter("workers that advertised their K/V geometry in the handshake")
    hash_alternates_accepted: int = counter("peer compatibility hashes accepted because they "
                                            "differ only in an interchangeable backend name")
    coalesced: int = counter("same-layout peer ranks whose READs are staged "
                             "(PDPATCH_KV_COALESCE)")
    mixed_accepted: int = counter("peers with another backend name and the same packed "
                                  "geometry, accepted")
    last_error: str = ""            # the last peer refused, why (its count: metrics' refusals)
    # The compatibility hash's alternates, recorded when vLLM computes it (worker start) and
    # read while a peer's payload is decoded: local hash -> {alternate hash: backend name}.
    alternates: dict[str, dict[str, str]] = field(default_factory=dict)
    # The staged READs of this process's staging agents (one per decode worker); made with the
    # first one (the staging core is imported then, not at install).
    staging: StagingStats | None = None

    def staging_stats(self) -> StagingStats:
        """The process's staging counters, made on first use."""
        from pdpatch.kv.staging.reads import StagingStats

        with self.lock:
            if self.staging is None:
                self.staging = StagingStats()
            return self.staging

    def count(self, name: str) -> None:
        """Add one to a counter (handshakes of several peers run concurrently)."""
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)

    def counters(self, patch: str) -> list[Counter]:
        out = super().counters(patch)
        s = self.staging
        # staged READs and their bytes are counted once, by the metrics they go to /metrics as
        for name, help_text in (
                ("chunked_reads", "staged READs larger than the free staging, read in chunks"),
                ("gather_failures", "staged READs whose copy into the KV cache failed")):
            out.append(Counter(f"{patch}_{name}", int(getattr(s, name, 0)), help_text))
        out += [Counter(f"{patch}_not_staged", int(n), "READs of staged peers posted as vLLM "
                        "built them, by reason", (("reason", str(reason)),))
                for reason, n in sorted(s.not_staged.items() if s is not None else ())]
        return out


@dataclass
class WorkerState:
    """Kept on the worker itself (:mod:`pdpatch.attached`), so every wrapper of that worker
    (each receives it as ``instance``) finds the same object and nothing outlives the worker."""

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


def worker_state(worker: Any) -> WorkerState:
    """The worker's state, created on first use (normally at ``register_kv_caches``)."""
    return object_state(NAME, worker)


def existing_worker_state(worker: Any) -> WorkerState | None:
    """The worker's state if a wrapper already created it (reads never create one)."""
    return attached.peek(worker, NAME)


def count(name: str) -> None:
    """Add one to a :class:`KvSegmentsState` counter of this process."""
    state_of(NAME).count(name)


def note_refusal(error: str) -> None:
    """Why this process last refused a peer (how many it refused: metrics' refusals)."""
    state = state_of(NAME)
    with state.lock:
        state.last_error = error
