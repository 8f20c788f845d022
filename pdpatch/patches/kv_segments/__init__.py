"""Patch ``kv_segments``: P and D whose attention backends place K and V differently exchange
blocks byte-exactly; pairs pdpatch cannot convert fail that peer's handshake with both
geometries named.

Why: up to vLLM 0.22 FlashAttention keeps a layer's K and V in two regions (``(2, N, ...)``)
while FlashInfer / Triton fuse ``[K|V]`` per block (``(N, 2, ...)``); kvcached's split-half
memory does the same on 0.23-0.25.  Stock vLLM refuses such a pair twice over: the NIXL
compatibility hash covers the backend *name*, and with that check off
``_validate_remote_agent_handshake`` asserts on block lengths and region counts -- and even
then the remote descriptors would be built with the *local* layout.  From 0.26 every backend
packs K|V per token, so two backend names can share one geometry, and the hash still refuses
(through 0.34: 0.34.0 metadata.py L200 hashes ``attn_backend_name``).

The pipeline, one module each:

* :mod:`.advertise` -- at ``register_kv_caches`` the worker's geometry, inferred from tensor
  strides, is added to its encoded ``NixlAgentMetadata`` as an optional field that every stock
  decoder drops, so vLLM's code on either side sees exactly the release's metadata;
* :mod:`.handshake` -- vLLM's hash is sent unchanged, but a peer whose hash differs only in an
  interchangeable backend name is let through to the geometry check, and a pdpatch peer's
  advertised geometry is read from the raw payload;
* :mod:`.planning` -- pure: equal K/V placements run stock code; different ones (0.19-0.25)
  are planned with :class:`pdpatch.kv.PairPlan`; mixed backend names (all releases) are accepted
  only on an exact byte pairing of the layers the release pairs -- by position up to 0.33
  (layer-name order from 0.30), by layer name from 0.34 (:mod:`pdpatch.kv.pairing`); anything
  else raises :class:`GeometryMismatch` in the handshake thread, which fails only that peer's
  requests;
* :mod:`.substitution` -- vLLM's own ``add_remote_agent`` runs on a shadow of the peer's
  metadata and its remote descriptor list is swapped for pdpatch's;
* :mod:`.staged_reads` -- a converted peer's READs go through
  :class:`pdpatch.kv.staging.StagingAgent` (``PDPATCH_KV_STAGING_MIB``, ``PDPATCH_KV_GAP_KIB``),
  and, opt-in (``PDPATCH_KV_COALESCE``), a same-layout peer's too: stock code pairs its
  descriptors, staging merges runs of its blocks;
* :mod:`.state` -- the patch's state: counters and hash alternates per process, geometry
  and conversions in flight per worker; :mod:`.settings` -- names and settings.

D (the reading side) must run pdpatch; P needs it only to advertise its geometry (without it
D derives P's geometry from vLLM's own metadata fields).  Toggle: ``PDPATCH_KV_SEGMENTS``,
or ``kv_connector_extra_config["pdpatch"]["kv_segments"] = false``; extra interchangeable
backend names: ``kv_connector_extra_config["pdpatch"]["kv_segments_backends"] = [...]``.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Lazy, Patch, Target, lazy_from

NAME = "kv_segments"
# The pipeline's modules, each imported when vLLM imports a module it wraps (or its state is
# first kept): none of them at install.
_advertise = lazy_from(f"{__name__}.advertise")
_handshake = lazy_from(f"{__name__}.handshake")
_substitution = lazy_from(f"{__name__}.substitution")
_state = lazy_from(f"{__name__}.state")


def _targets(version: Version) -> list[Target]:
    """What this patch wraps in vLLM ``version`` (nothing without a handshake to wrap)."""
    out: list[Target] = []

    def add(sites: tuple, wrapper: Lazy) -> None:
        site = vllm_sites.lookup(sites, version)
        if site is not None:
            out.append(Target(site.module, site.qualname, wrapper))

    handshake = vllm_sites.lookup(vllm_sites.NIXL_HANDSHAKE, version)
    if handshake is None:
        return []
    add(vllm_sites.COMPAT_HASH, _handshake("hash_wrapper"))
    out.append(Target(handshake.module, handshake.qualname,
                      _handshake("make_handshake_wrapper", handshake.module)))
    add(vllm_sites.REGISTER_KV_CACHES, _advertise("make_register_wrapper", version))
    add(vllm_sites.RESTORE_KV_CACHES, _advertise("restore_wrapper"))
    add(vllm_sites.ADD_REMOTE_AGENT, _substitution("make_add_remote_wrapper", version))
    if version in vllm_sites.KV_SPLIT_DESCRIPTORS:
        add(vllm_sites.BUILD_FA_REMOTE, _substitution("build_fa_remote_wrapper"))
    return out


PATCH = Patch(
    name=NAME,
    summary="P/D with different K/V segment layouts (FlashAttention split vs FlashInfer fused, "
            "kvcached split-half) convert descriptors byte-exactly, their READs staged so runs "
            "of blocks merge (0.19-0.25, PDPATCH_KV_STAGING_MIB); mixed backend names with "
            "identical geometry are accepted, real differences fail that peer clearly",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.CONNECTOR_VERSION, vllm_sites.VALIDATE_HANDSHAKE,
               vllm_sites.BUILD_FA_REMOTE, vllm_sites.BUILD_LOCAL_SPLITS,
               vllm_sites.LOCAL_XFER_HANDLER, vllm_sites.DESC_IDS, vllm_sites.READ_BLOCKS_FOR_REQ,
               vllm_sites.READ_BLOCKS, vllm_sites.POP_DONE_TRANSFERS, vllm_sites.TP_MAPPING,
               vllm_sites.RECEIVE_PERMUTE, vllm_sites.RECEIVE_PERMUTE_BLOCK_RATIO,
               vllm_sites.RECEIVE_PERMUTE_MEMORY_ORDER, vllm_sites.PAIR_REGIONS),
    state=_state("KvSegmentsState"),
    object_state=_state("WorkerState"),
)
