"""Where ``kv_segments`` hands a peer's READs to :mod:`pdpatch.kv.staging`: a converted peer
costs one NIXL descriptor per block segment (nothing merges across layouts), and so does a
same-layout peer on stock code (one per block and layer); staged, its READs land in the peer's
address order, so runs of blocks merge.  Converted peers are staged by default, same-layout
peers only with ``PDPATCH_KV_COALESCE`` (opt-in: stock code serves them correctly already)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from pdpatch import agent_layers, kvcached, metrics
from pdpatch.installer import state_of
from pdpatch.patches.kv_segments.settings import (
    GAP_ENV,
    NAME,
    STAGING_ENV,
    coalesce,
    gap_kib,
    staging_mib,
)


def _kv_memory(worker: Any, kv_caches: Any) -> list:
    """The tensors the worker's local descriptor lists point into."""
    if getattr(worker, "use_host_buffer", False):
        return list((getattr(worker, "host_xfer_buffers", None) or {}).values())
    return list(kv_caches.values()) if isinstance(kv_caches, Mapping) else []


def _reads_kv(worker: Any) -> bool:
    """Whether the worker pulls KV (a decode engine, or ``kv_both``): a prefill-only worker
    never READs, so building its own list's table at start-up would be wasted."""
    return bool(getattr(getattr(worker, "kv_transfer_config", None), "is_kv_consumer", True))


def install_staging(worker: Any, kv_caches: Any) -> None:
    """Put a :class:`~pdpatch.kv.staging.StagingAgent` in front of the worker's NIXL agent (its
    ``staging`` layer), before vLLM prepares its local lists (the agent must see them being
    prepared).  It acts only on peers :func:`stage_peer` marks converted."""
    from pdpatch.kv.staging import StagingAgent

    mib, gap = staging_mib(), gap_kib()
    if mib == 0 or getattr(worker, "nixl_wrapper", None) is None or \
            agent_layers.find(worker, StagingAgent) is not None or \
            getattr(worker, "use_mla", False):
        return
    agent_layers.push(
        worker, StagingAgent, mem_type=getattr(worker, "nixl_memory_type", "VRAM"),
        capacity=mib << 20, memory=lambda: _kv_memory(worker, kv_caches),
        gap=None if gap is None else gap << 10, capacity_setting=STAGING_ENV,
        gap_setting=GAP_ENV, stats=state_of(NAME).staging_stats(),
        eager=_reads_kv(worker) and (coalesce() or kvcached.read_state().in_deployment),
        buffer_at_start=_reads_kv(worker) and coalesce(),
        on_posted=functools.partial(_count_staged_read, weakref.ref(worker)))


def _count_staged_read(worker: weakref.ref, nbytes: int) -> None:
    """A staged READ of the worker's, for ``pdpatch.status()`` and ``/metrics`` (the worker
    held weakly: it holds the agent)."""
    metrics.count(worker(), metrics.STAGED_READS)
    metrics.count(worker(), metrics.STAGED_READ_BYTES, amount=nbytes)


def stage_peer(worker: Any, engine_id: str, rank: int,
               read_ranges: Sequence[tuple[int, int]] | None) -> bool:
    """Route the peer's READs through the staging agent, when there is one; gap READs stay
    inside ``read_ranges`` (the peer's memory; None: no gap reads)."""
    from pdpatch.kv.staging import StagingAgent

    agent = agent_layers.find(worker, StagingAgent)
    handle = (getattr(worker, "dst_xfer_side_handles", None) or {}).get(engine_id, {}).get(rank)
    if agent is None or handle is None:
        return False
    return agent.mark_converted(handle, f"{engine_id} rank {rank}", read_ranges)
