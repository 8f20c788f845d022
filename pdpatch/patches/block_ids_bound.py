"""Patch ``block_ids_bound``: a ``remote_block_ids`` list whose length does not match what the
decode engine allocated fails that request instead of reading another request's blocks.

With equal block sizes the pull read path pairs D's blocks with P's by the **end** of P's list:
every release 0.19-0.34 trims P's group to its last ``len(local)`` ids (``_read_blocks``'
prefix-cache trim: 0.19 ``nixl_connector.py`` L2649-2653; ``_apply_prefix_caching`` from 0.22,
0.34.0 ``base_worker.py`` L3878-3913, called from ``pull_worker.py::_read_blocks``), where
``local`` holds only the blocks D did not find in its own prefix cache.  Position ``i`` of D's
allocation (``h`` hit blocks, then the ``k`` blocks it reads into) is block ``i`` of the
prompt; position ``i`` of a correct P list is block ``i`` of P's prompt.  So the end trim pairs
the right blocks exactly when P lists ``h + k`` blocks, and otherwise reads the wrong ones:

* more ids (a proxy that sends 22 ids for a 2-block prompt, a P that also listed generated or
  lookahead blocks): D reads the *last* ids -- another request's blocks or the wrong part of
  this one -- and the server answers HTTP 200 with wrong tokens;
* fewer ids with a local hit (vllm-project/vllm#50558: a proxy appends P's first sampled token
  to D's prompt; when P's prompt ends on a block boundary D allocates one block more than P
  listed): every block read is shifted by one, again silently.  Without a local hit the
  release's own ``num_local <= len(remote)`` assert fires (``read_guard`` contains it).

Where P's blocks are smaller (``block_size_ratio`` r > 1) or hold another number of physical
blocks per logical block, 0.19-0.33 pair D's sub-blocks with P's list by position
(``_map_block_ids_for_block_size_ratio`` from 0.27, 0.33.0 ``pull_worker.py`` L435) and then
end-trim; D's token count is not known to the worker there, so only a list longer than
``(h + k) * r`` -- more than D's allocation can hold -- is refused (and only with equal
physical-per-logical ratios).  (That pairing also reads a *correct* list wrongly where D has a
local hit and P's list ends short of D's last sub-block -- 20 tokens, P blocks of 8, D blocks of
16, one hit: D's read block gets P's blocks 1 and 2, one block early, instead of block 2 in its
first half -- which this patch, judging lists, leaves to those releases; 0.34 reads it right.)

0.34 pairs both lists from P's last token instead (``_pair_blocks_by_last_token``, 0.34.0
``base_worker.py`` L3683-3727, from ``pull_worker.py`` L311-333) with ``remote_num_tokens`` T
(it declines such a read without it, L188-205).  P lists exactly the blocks of its T computed
tokens (``Scheduler._connector_finished``, 0.34.0 ``scheduler.py`` L3511-3514;
``remote_num_tokens = num_computed_tokens``, ``pull_scheduler.py`` L279), so 0.34 pairs right
exactly when P lists cdiv(T, P's logical block) blocks and D holds (``h + k``) cdiv(T, D's
logical block): anything else shifts every pair, which this patch refuses there.  vllm#50558
without a local hit is such a case that 0.33 read right and 0.34 reads one of D's blocks late
(P's prompt ending on D's block boundary, D's one token longer).

The check needs ``h``.  0.29+ carry it to the worker (``ReqMeta.local_num_computed_blocks``,
counted in ``update_state_after_alloc``, 0.34.0 ``pull_scheduler.py`` L160-169); for 0.19-0.28
this patch counts it there with the same expression and attaches it to that request's
``ReqMeta`` in ``build_connector_meta`` (:class:`LocalHits`, pdpatch's record on it,
:mod:`pdpatch.attached`, which no vLLM code reads; it travels with the metadata to the worker
processes, which receive it pickled).

Judged only where the release's own pairing is one of the above for one full-attention group:
one KV-cache group, no decode-context parallelism on either side, no region-mapped (0.33+ MLA)
read, no bidirectional (turn-2) transfers, a handshaken peer that the release neither marked
invalid nor is about to handshake with again (0.34.0 ``pull_worker.py`` L140-155).  A refused
load is failed with the release's own bookkeeping (:func:`pdpatch.vllm_sites.record_recv_failure`):
the scheduler recomputes or fails the request, no READ is posted, the engine serves on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from pdpatch import attached, metrics, vllm_sites
from pdpatch.installer import object_state
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.registry import Patch, Target, Wrapper

NAME = "block_ids_bound"


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


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.READ_BLOCKS_FOR_REQ, version)
    if site is None or vllm_sites.recv_failure_style(version) is None:
        return []
    targets = [Target(site.module, site.qualname, make_check(version))]
    if vllm_sites.release_of(version) < vllm_sites.LOCAL_HITS_IN_METADATA_FROM:
        record = vllm_sites.lookup(vllm_sites.PULL_UPDATE_STATE_AFTER_ALLOC, version)
        build = vllm_sites.lookup(vllm_sites.BUILD_CONNECTOR_META, version)
        if record is None or build is None:
            return []
        targets += [Target(record.module, record.qualname, record_local_hits),
                    Target(build.module, build.qualname, attach_local_hits)]
    return targets


PATCH = Patch(
    name=NAME,
    summary="remote_block_ids not matching the decode engine's allocation fail that request "
            "instead of reading the wrong blocks",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.READ_BLOCKS, vllm_sites.APPLY_PREFIX_CACHING,
               vllm_sites.BLOCK_SIZE_PAIRING, vllm_sites.CONNECTOR_FINISHED,
               vllm_sites.HANDLE_FAILED_TRANSFER),
    object_state=LocalHits,
)
