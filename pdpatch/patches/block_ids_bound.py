"""Patch ``block_ids_bound``: a ``remote_block_ids`` list whose length does not match what the
decode engine allocated fails that request instead of reading another request's blocks.

The pull read path pairs D's blocks with P's by the **end** of P's list: every release 0.19-0.33
trims P's group to its last ``len(local)`` ids (``_read_blocks``' prefix-cache trim: 0.19
``nixl_connector.py`` L2649-2653, 0.33 ``base_worker.py::_apply_prefix_caching``), where
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

The check needs ``h``.  0.29+ carry it to the worker (``ReqMeta.local_num_computed_blocks``,
counted in ``update_state_after_alloc``); for 0.19-0.28 this patch counts it there with the same
expression and attaches it to that request's ``ReqMeta`` in ``build_connector_meta``
(:class:`LocalHits`, pdpatch's record on it, :mod:`pdpatch.attached`, which no vLLM code reads;
it travels with the metadata to the worker processes, which receive it pickled).

Judged only where the release's own pairing is the plain end trim of one full-attention group:
one KV-cache group, no decode-context parallelism on either side, the same
physical-per-logical block ratio on both sides, no region-mapped (0.33 MLA) read, no
bidirectional (turn-2) transfers, and a handshaken peer.  With equal block sizes the bound is
exact (``len(remote) == h + k``); where P's blocks are ``r`` times smaller (the release's
``block_size_ratio``) D's token count is not known to the worker to a block, so only a list
longer than ``(h + k) * r`` -- more than D's allocation can hold -- is refused.  A refused load is
failed with the release's own bookkeeping (:func:`pdpatch.vllm_sites.record_recv_failure`): the
scheduler recomputes or fails the request, no READ is posted, the engine serves on.
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


def _region_mapped(worker: Any, engine_id: str) -> bool:
    """0.33's MLA read between peers with different cache-group regions pairs blocks its own
    way (``_apply_prefix_caching_by_region``)."""
    remote = (getattr(worker, "dst_region_group_ids", None) or {}).get(engine_id)
    return remote is not None and (getattr(worker, "region_group_ids", None) or remote) != remote


def refusal(worker: Any, meta: Any, version: Version) -> str | None:
    """Why the release's end-trim would pair the wrong blocks for this receive (None: run the
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
            or getattr(worker, "_bidirectional_kv_xfer_enabled", False) \
            or getattr(worker, "dcp_size", 1) > 1 or _region_mapped(worker, engine_id) \
            or not _single_full_attention_group(worker):
        return None
    peer = vllm_sites.peer_blocks(worker, engine_id, version)
    if peer is None or peer.dcp_size > 1 or peer.physical_per_logical != \
            getattr(worker, "_physical_blocks_per_logical_kv_block", 1):
        return None
    n_listed, n_hits, n_read = len(listed[0]), hits[0], len(local[0])
    allocated = n_hits + n_read
    if peer.block_size_ratio == 1 and n_listed != allocated:
        return (f"it lists {n_listed} remote blocks; this decode engine holds {n_hits} of the "
                f"prompt's blocks from its prefix cache and reads {n_read}, so a prefill engine "
                f"with the same prompt lists exactly {allocated}; vLLM pairs the last {n_read} "
                "listed ids with its blocks and would read the wrong ones")
    if peer.block_size_ratio > 1 and n_listed > allocated * peer.block_size_ratio:
        return (f"it lists {n_listed} remote blocks of 1/{peer.block_size_ratio} this engine's "
                f"block size; this decode engine holds {n_hits} blocks from its prefix cache "
                f"and reads {n_read}, room for at most {allocated * peer.block_size_ratio} of "
                "them; vLLM would read the last ids, the wrong ones")
    return None


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
