"""The code of patch ``block_ids_bound``, loaded when vLLM imports the decode worker's read path
or, on 0.19-0.28, the connector's scheduler half (the patch and why it exists:
:mod:`pdpatch.patches.block_ids_bound`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from pdpatch import attached, metrics, vllm_sites
from pdpatch.installer import object_state
from pdpatch.log import logger
from pdpatch.patches.block_ids_bound import NAME
from pdpatch.patches.common import allowed, arg
from pdpatch.registry import Wrapper


@dataclass
class LocalHits:
    """0.19-0.28, on vLLM objects (:mod:`pdpatch.attached`): D's prefix-cache hit blocks per
    KV-cache group, counted as 0.29+ count them."""

    # On the scheduler half: the receives queued this step, until build_connector_meta.
    pending: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # On a request's `ReqMeta`, which carries it to the workers (pickled with it).
    carried: tuple[int, ...] | None = None


def _local_hits(meta: Any, version: Version) -> tuple[int, ...] | None:
    """D's prefix-cache hit blocks per KV-cache group, as the release (0.29+) or this patch's
    scheduler wrapper (0.19-0.28) counted them; None where nobody did (a metadata built by
    other code, e.g. vLLM's own unit tests)."""
    if vllm_sites.release_of(version) >= vllm_sites.LOCAL_HITS_IN_METADATA_FROM:
        hits = getattr(meta, "local_num_computed_blocks", None)
    else:
        mine = attached.peek(meta, NAME)
        hits = mine.carried if mine is not None else None
    return tuple(hits) if hits else None


def _single_full_attention_group(worker: Any) -> bool:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = getattr(getattr(worker, "kv_cache_config", None), "kv_cache_groups", None) or ()
    return (len(groups) == 1 and isinstance(groups[0].kv_cache_spec, FullAttentionSpec)
            and not getattr(worker, "_is_hma_required", False)
            and not getattr(worker, "_has_mamba", False))


def _region_mapped(worker: Any, engine_id: str, version: Version) -> bool:
    """An MLA read between peers with different cache-group regions, which the release pairs
    region by region (``_apply_prefix_caching_by_region``, 0.33+): 0.34 decides it by
    ``_dst_pairs[engine_id].groups_match`` (0.34.0 pull_worker.py L217, L233), 0.33 by comparing
    the two sides' region groups."""
    if vllm_sites.release_of(version) >= vllm_sites.REGION_READ_BY_GROUPS_MATCH_FROM:
        pairs = (getattr(worker, "_dst_pairs", None) or {}).get(engine_id)
        return pairs is not None and not getattr(pairs, "groups_match", True)
    remote = (getattr(worker, "dst_region_group_ids", None) or {}).get(engine_id)
    return remote is not None and (getattr(worker, "region_group_ids", None) or remote) != remote


def _stale_or_invalid_peer(worker: Any, remote: Any, engine_id: str) -> bool:
    """The release itself fails a request for a peer it marked invalid (0.32+), or handshakes
    again with a peer that registered its KV again (``registration_generation``, 0.33+) and
    reads after that, through this wrapper again: judged then, against the new peer (0.34.0
    pull_worker.py L140-155)."""
    if engine_id in (getattr(worker, "_invalid_remote_engines", None) or ()):
        return True
    known = getattr(worker, "_remote_registration_generations", None)
    generation = getattr(remote, "registration_generation", 0)
    return isinstance(known, dict) and isinstance(generation, int) \
        and known.get(engine_id, 0) < generation


def _by_last_token(worker: Any, remote: Any, peer: vllm_sites.PeerBlocks, n_listed: int,
                   n_hits: int, n_read: int) -> str | None:
    """0.34+, blocks of different sizes: vLLM pairs both lists from P's last token
    (``remote_num_tokens``, T), so it pairs the right blocks exactly when P lists the blocks of
    T tokens at its block size and this engine holds (hits + reads) the blocks of T tokens at
    its own; otherwise every pair is shifted.  P lists exactly cdiv(T, P's logical block) blocks
    (those of its computed tokens, ``Scheduler._connector_finished``, 0.34.0 scheduler.py
    L3511-3514, with ``remote_num_tokens = num_computed_tokens``, pull_scheduler.py L279)."""
    t = getattr(remote, "num_tokens", None)
    if t is None or not isinstance(t, int):
        return None     # 0.34 declines the read itself; a non-integer: its own TypeError
    groups = worker.kv_cache_config.kv_cache_groups
    d_logical = int(groups[0].kv_cache_spec.block_size)
    p_logical = int(worker.block_size) // peer.block_size_ratio * peer.physical_per_logical
    if d_logical <= 0 or p_logical <= 0:
        return None
    want_p, want_d = -(-t // p_logical), -(-t // d_logical)
    allocated = n_hits + n_read
    if n_listed == want_p and allocated == want_d:
        return None
    return (f"it says P computed {t} tokens (remote_num_tokens): {want_p} blocks of "
            f"{p_logical} tokens on P and {want_d} of {d_logical} here; it lists {n_listed} "
            f"remote blocks, and this decode engine holds {n_hits} of the prompt's blocks from "
            f"its prefix cache and reads {n_read}; vLLM pairs both lists from P's last token "
            "and would read the wrong blocks")


def refusal(worker: Any, meta: Any, version: Version) -> str | None:
    """Why the release's pairing would read the wrong blocks for this receive (None: run the
    release's own read)."""
    remote = getattr(meta, "remote", None)
    local = getattr(meta, "local_block_ids", None)
    if remote is None or not local or len(local) != 1 or not local[0]:
        return None                         # nothing to read (a full local hit: notify only)
    listed = remote.block_ids
    hits = _local_hits(meta, version)
    if not isinstance(listed, (list, tuple)) or len(listed) != 1 or hits is None \
            or len(hits) != 1:
        return None
    engine_id = remote.engine_id
    if engine_id not in (getattr(worker, "_remote_agents", None) or {}) \
            or _stale_or_invalid_peer(worker, remote, engine_id) \
            or getattr(worker, "_bidirectional_kv_xfer_enabled", False) \
            or getattr(worker, "dcp_size", 1) > 1 or _region_mapped(worker, engine_id, version) \
            or not _single_full_attention_group(worker):
        return None
    peer = vllm_sites.peer_blocks(worker, engine_id, version)
    if peer is None or peer.dcp_size > 1:
        return None
    n_listed, n_hits, n_read = len(listed[0]), hits[0], len(local[0])
    allocated = n_hits + n_read
    same_ratio = peer.physical_per_logical == \
        getattr(worker, "_physical_blocks_per_logical_kv_block", 1)
    if peer.block_size_ratio == 1 and same_ratio:
        if n_listed != allocated:
            return (f"it lists {n_listed} remote blocks; this decode engine holds {n_hits} of "
                    f"the prompt's blocks from its prefix cache and reads {n_read}, so a "
                    f"prefill engine with the same prompt lists exactly {allocated}; vLLM pairs "
                    f"the last {n_read} listed ids with its blocks and would read the wrong ones")
        return None
    if vllm_sites.release_of(version) >= vllm_sites.PAIRS_BY_LAST_TOKEN_FROM:
        return _by_last_token(worker, remote, peer, n_listed, n_hits, n_read)
    if same_ratio and peer.block_size_ratio > 1:
        return _by_position(peer.block_size_ratio, n_listed, n_hits, n_read)
    return None


def _by_position(ratio: int, n_listed: int, n_hits: int, n_read: int) -> str | None:
    """0.19-0.33, P's blocks 1/``ratio`` of this engine's: the release splits each block it
    reads into ``ratio`` sub-blocks and pairs them, from the first, with the last
    ``min(n_read * ratio, n_listed)`` listed ids (0.19.1 nixl_connector.py L2708 via
    ``get_mapped_blocks``; 0.33.0 ``_map_block_ids_for_block_size_ratio`` after the prefix
    trim).  That is right only where the ids before them are exactly the ``n_hits * ratio`` P
    blocks its prefix cache already holds: a correct list with a local hit whose last P block
    ends inside the last block read is paired one P block early too, reported done, with the
    wrong KV (the ``ratio_hit_partial`` scenario; 0.34 pairs from P's last token instead)."""
    paired = min(n_read * ratio, n_listed)
    if n_listed - paired == n_hits * ratio:
        return None
    return (f"it lists {n_listed} remote blocks of 1/{ratio} this engine's block size; this "
            f"decode engine holds {n_hits} of the prompt's blocks ({n_hits * ratio} of P's) from "
            f"its prefix cache and reads {n_read}; vLLM pairs the sub-blocks it reads, from "
            f"the first, with the last {paired} listed ids, which is right only where the "
            f"{n_listed - paired} ids before them are the {n_hits * ratio} its prefix cache "
            "holds; it would read the wrong blocks (equal P and D block sizes, or vLLM 0.34, "
            "which pairs from P's last token, avoid it)")


def make_check(version: Version) -> Wrapper:
    def check_block_count(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        meta = arg(args, kwargs, 1, "meta", None)
        why = refusal(instance, meta, version) if allowed(NAME, instance) else None
        if why is None:
            return wrapped(*args, **kwargs)
        req_id = arg(args, kwargs, 0, "req_id")
        # Never HMA here (judged on one full-attention group), so every release can record it.
        vllm_sites.record_recv_failure(instance, req_id, version)
        n = metrics.count(instance, metrics.REFUSALS, NAME)
        logger.error("pdpatch: KV load of request %s refused: %s; the request fails (the "
                     "scheduler recomputes or fails it, per kv_load_failure_policy); check the "
                     "proxy forwards P's kv_transfer_params unchanged and sends D the prompt P "
                     "prefilled [block_ids_bound, %d so far]", req_id, why, n)
        return None

    return check_block_count


def record_local_hits(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.19-0.28 scheduler half: count D's prefix-cache hits of a receive it queued, as 0.29's
    ``update_state_after_alloc`` does, for ``build_connector_meta`` to attach."""
    result = wrapped(*args, **kwargs)
    request = arg(args, kwargs, 0, "request", None)
    blocks = arg(args, kwargs, 1, "blocks", None)
    req_id = getattr(request, "request_id", None)
    queued = getattr(instance, "_reqs_need_recv", None)
    if req_id is None or not isinstance(queued, dict) or req_id not in queued \
            or not allowed(NAME, instance):
        return result
    groups = getattr(blocks, "blocks", None) or ()
    object_state(NAME, instance).pending[req_id] = tuple(
        sum(b.block_hash is not None and not b.is_null for b in group) for group in groups)
    return result


def attach_local_hits(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.19-0.28: hand each receive's hit counts to the workers on its ``ReqMeta``."""
    meta = wrapped(*args, **kwargs)
    mine = attached.pop(instance, NAME)
    if mine is not None and mine.pending:
        for req_id, req_meta in (getattr(meta, "reqs_to_recv", None) or {}).items():
            if req_id in mine.pending:
                attached.put(req_meta, NAME, LocalHits(carried=mine.pending[req_id]))
    return meta
