"""Where each vLLM concept pdpatch touches lives, per release: the one place for version facts.

Patches ask this module "where is the worker's read path in vLLM X?" instead of carrying
``if version`` branches.  Facts come from reading each release's source in its wheel.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from packaging.version import Version

from pdpatch import versions
from pdpatch.versions import VersionRange, release_of

KVC = "vllm.distributed.kv_transfer.kv_connector"
NIXL_PKG = f"{KVC}.v1.nixl"
NIXL_SINGLE_FILE = f"{KVC}.v1.nixl_connector"      # 0.19 only

# The releases whose NIXL code pdpatch was written against and checked on; a patch that holds
# for all of them declares this range.  Supporting a release that `python -m scripts.qualify`
# finds clean is this one line.
SUPPORTED = VersionRange(">=0.19,<0.35")
# The newest of them: what a patch assumes where no installed distribution names the release
# (a vLLM source tree on the path).
NEWEST_SUPPORTED = Version(f"{SUPPORTED.upper().major}.{SUPPORTED.upper().minor - 1}.0")


def newer_than_verified(versions: VersionRange, version: Version) -> bool:
    """Whether ``version`` is past a patch's range ``versions`` *because* pdpatch has not
    verified it yet: the range reaches the newest release pdpatch supports and ``version`` is
    beyond it.  False for an older release and for a range that ended earlier (the fault was
    fixed upstream, or does not exist there): such a patch never applies by fingerprint or by
    force (pdpatch.verified, PDPATCH_ALLOW_UNTESTED_VLLM)."""
    upper = versions.upper()
    return upper is not None and upper == SUPPORTED.upper() and release_of(version) >= upper


def supported_from(release: str) -> VersionRange:
    """The supported releases from ``release`` on (a patch for a fault vLLM introduced later)."""
    return VersionRange(f">={release},<{SUPPORTED.upper()}")


def supported_until(release: str) -> VersionRange:
    """The supported releases before ``release`` (a patch for a fault vLLM fixed there)."""
    return VersionRange(f">={SUPPORTED.lower()},<{release}")


def running_release() -> Version:
    """The installed vLLM release, or :data:`NEWEST_SUPPORTED` where no distribution says."""
    return versions.vllm_version() or NEWEST_SUPPORTED


class Site(NamedTuple):
    """Where a concept lives in the releases ``versions``.  (A NamedTuple: defining a frozen
    dataclass costs ~0.4 ms, paid by every ``import vllm`` with pdpatch enabled.)"""

    versions: VersionRange
    module: str
    qualname: str

    def matches(self, version: Version) -> bool:
        return version in self.versions


_RANGES: dict[str, VersionRange] = {}


def _site(spec: str, module: str, qualname: str) -> Site:
    """A site; its range parsed once per spec (some 140 sites share 25 specs, all built inside
    ``import vllm``)."""
    versions = _RANGES.get(spec)
    if versions is None:
        versions = _RANGES[spec] = VersionRange(spec)
    return Site(versions, module, qualname)


def lookup(sites: tuple[Site, ...], version: Version) -> Site | None:
    return next((s for s in sites if s.matches(version)), None)


def _until_024(module_20: str, qualname: str) -> tuple[Site, Site]:
    """``qualname`` in 0.19-0.23, which keep one connector, scheduler and worker class: in the
    single file (0.19), then in ``module_20`` of the ``nixl`` package (0.20-0.23)."""
    return (_site(">=0.19,<0.20", NIXL_SINGLE_FILE, qualname),
            _site(">=0.20,<0.24", f"{NIXL_PKG}.{module_20}", qualname))


def _per_worker(qualname: str, pull: bool = False) -> tuple[Site, ...]:
    """A worker method in each release's NIXL module: :func:`_until_024`'s ``worker``, then
    ``pull_worker`` (``pull``) or ``base_worker`` (0.24+)."""
    later = (f"{NIXL_PKG}.pull_worker", f"NixlPullConnectorWorker.{qualname}") if pull else \
        (f"{NIXL_PKG}.base_worker", f"NixlBaseConnectorWorker.{qualname}")
    return (*_until_024("worker", f"NixlConnectorWorker.{qualname}"), _site(">=0.24", *later))


def _per_scheduler(qualname: str, module_24: str, class_24: str) -> tuple[Site, ...]:
    """A scheduler-half method: :func:`_until_024`'s ``scheduler``, then ``module_24``'s
    ``class_24`` (0.24+)."""
    return (*_until_024("scheduler", f"NixlConnectorScheduler.{qualname}"),
            _site(">=0.24", f"{NIXL_PKG}.{module_24}", f"{class_24}.{qualname}"))


# The pull-mode read path (a request's KV load from a remote engine).
READ_BLOCKS_FOR_REQ = _per_worker("_read_blocks_for_req", pull=True)


# The connector classmethod that asks for a KV-cache layout, on the class that defines it
# (>=0.24 `NixlConnector` is only an alias of `NixlPullConnector`; the push connector inherits
# from `NixlBaseConnector` too).  Returns "HND" up to 0.28, "LBHNC" from 0.29.
REQUIRED_KV_LAYOUT = (
    *_until_024("connector", "NixlConnector.get_required_kvcache_layout"),
    _site(">=0.24", f"{NIXL_PKG}.connector", "NixlBaseConnector.get_required_kvcache_layout"),
)

# Where the layout in force is decided.  Up to 0.28 lazily in each worker process through the
# lru_cached `get_kv_cache_layout()`; from 0.29 once in EngineCore by `resolve_kv_cache_layout`,
# which `vllm.v1.engine.core` imports by name (both bindings are listed).
LAYOUT_RESOLVERS = (
    _site(">=0.19,<0.29", "vllm.v1.attention.backends.utils", "get_kv_cache_layout"),
    _site(">=0.29", "vllm.v1.attention.backends.utils", "resolve_kv_cache_layout"),
    _site(">=0.29", "vllm.v1.engine.core", "resolve_kv_cache_layout"),
)

# The worker method that registers KV tensors with NIXL (the push worker's override calls super).
REGISTER_KV_CACHES = _per_worker("register_kv_caches")

# Handshake validation; 0.19 lacks the heterogeneous-TP head-contiguity guard added in 0.20.
VALIDATE_HANDSHAKE = _per_worker("_validate_remote_agent_handshake")

# Module whose global `NixlWrapper` the worker instantiates (vLLM's tests patch it there).
NIXL_WRAPPER_HOME = (
    *_until_024("worker", "NixlWrapper"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlWrapper"),
)

# Handshake entry on the decode worker: registers one remote rank and builds its descriptors
# (runs in the handshake thread; an exception there fails that peer's requests only).
# Signature (meta, remote_tp_rank, remote_tp_size[, remote_dcp_size]) in every release.
ADD_REMOTE_AGENT = _per_worker("add_remote_agent")

# The plan-based descriptor builders (PR #40731, first released in 0.21.0).  Both look the
# attention group up with `next(...)` and no default (0.33 base_worker.py L295, L2207).
BUILD_FA_REMOTE = (
    _site(">=0.21,<0.24", f"{NIXL_PKG}.worker", "NixlConnectorWorker._build_fa_remote"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker._build_fa_remote"),
)
# Before it, the remote builder is a closure inside `add_remote_agent` (no method to wrap).
BUILDER_METHOD_FROM = Version("0.21")


def remote_builder_is_closure(version: Version) -> bool:
    """Whether ``add_remote_agent`` builds a peer's descriptors in a closure (0.19/0.20)."""
    return release_of(version) < BUILDER_METHOD_FROM


# The compatibility-hash function AS BOUND IN THE WORKER MODULE (the worker imported the name, so
# wrapping `metadata`'s binding alone would not be seen).  Signature in every release:
# (vllm_config, attn_backend_name, ...) -- the rest varies (cross_layers_blocks, transfer_mode).
COMPAT_HASH = (
    *_until_024("worker", "compute_nixl_compatibility_hash"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "compute_nixl_compatibility_hash"),
)

# The decode worker's handshake: fetches the peer's `NixlHandshakePayload` over ZMQ, compares the
# compatibility hash, decodes `NixlAgentMetadata` through the worker module's global names, then
# calls `add_remote_agent` (runs in the handshake thread in every release).
NIXL_HANDSHAKE = _per_worker("_nixl_handshake")

# Sleep/wake re-registration (0.33): re-encodes the handshake metadata through the stock class.
RESTORE_KV_CACHES = (
    _site(">=0.33", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker.restore_kv_caches"),
)

# Releases whose NIXL descriptors still address K and V of a block separately (FlashAttention's
# (2, N, ...) split regions, or a "virtual" K/V split of blocks-first memory); from 0.26 every
# backend packs K and V per token and a block moves as one unit.
KV_SPLIT_DESCRIPTORS = VersionRange(">=0.19,<0.26")

# How a worker pairs a peer's KV regions with its own (what kv_segments' check of a mixed-name
# peer must compare).  Up to 0.33 by position, each side's regions in its registration order:
# its `kv_caches` dict order up to 0.29 (0.29.0 base_worker.py L1154), its layer names sorted
# by `_region_sort_key` (layer numbers as numbers) from 0.30 (0.30.0 base_worker.py L104-109,
# L1315-1321; not for circular-buffer caches, `_is_csa_linear`; the same key through 0.34).
REGIONS_IN_LAYER_NAME_ORDER = VersionRange(">=0.30")
# From 0.34 through the layers both hold (0.34.0 base_worker.py L506-608 `_pair_regions`): each
# layer the peer lists in `region_members` (metadata.py L83, one list of layer names per region)
# pairs its regions, in order, with the local regions of the same layer name; a layer only the
# peer holds is skipped on a PP stage (`pp_size > 1`, L551-557) and refused otherwise
# (L558-561), a layer spanning different region counts is refused (L562-565), a local layer
# the peer lacks too (L577-582), and a peer region whose layers pair with local regions of
# different block lengths too (L584-597).  vLLM then keeps only the peer's paired regions
# (`_select_remote_regions`, L642-660, in place; `add_remote_agent` L2547-2554) and passes the
# local partner of each to `_build_fa_remote` / `_validate_remote_agent_handshake`
# (`local_region_ids`, L2269-2274, L2736-2742); `_compute_desc_ids` takes
# `pairs=(regions, keys)` (L170-179).
REGIONS_PAIRED_BY_LAYER = VersionRange(">=0.34")

# The decode worker's record of the peer ranks it added (`_remote_agents[engine_id]`): keyed by
# the peer's TP rank up to 0.25 (0.25.1 base_worker.py L340, L1467), by (PP rank, TP rank) from
# 0.26 (0.26.0 base_worker.py L347, L1525; 0.34.0 L833, L2516), where `add_remote_agent`
# returns the known agent for `(0, remote_tp_rank)` without doing anything else.
REMOTE_AGENTS_KEYED_BY_PP_FROM = Version("0.26")


def remote_agent_known(worker: Any, engine_id: Any, tp_rank: int, version: Version) -> bool:
    """Whether ``add_remote_agent(meta, tp_rank, ...)`` for ``engine_id`` would return the
    agent it already added (the release's own early return) instead of adding the peer."""
    known = getattr(worker, "_remote_agents", None) or {}
    agents = known.get(engine_id) or {}
    key = (0, tp_rank) if release_of(version) >= REMOTE_AGENTS_KEYED_BY_PP_FROM else tp_rank
    return key in agents


# vLLM's own growable KV cache (0.34+): CUDA VMM memory (cuMemCreate/cuMemMap), on by default on
# CUDA unless a connector that exports FABRIC handles (NIXL) finds no IMEX channel
# (config/vllm.py L3247-3262; `--enable-extensible-kv-cache` forces it, with a warning that
# same-host transfers then fall back to TCP, L3264-3269).  Its pages get a FABRIC handle only
# with an IMEX channel on a FABRIC-capable device (utils/vmm_driver.py L327-348; a failed FABRIC
# allocation falls back to none, L351-368): without one, UCX's cuda_ipc cannot map them.
# `cache_config.enable_extensible_kv_cache` (config/cache.py L395) says whether it is on.
EXTENSIBLE_KV_CACHE = VersionRange(">=0.34")


def extensible_kv_cache_on(vllm_config: Any, version: Version) -> bool:
    """Whether this engine's KV cache is vLLM's own extensible (CUDA VMM) cache."""
    if version not in EXTENSIBLE_KV_CACHE:
        return False
    cache_config = getattr(vllm_config, "cache_config", None)
    return getattr(cache_config, "enable_extensible_kv_cache", None) is True


BUILD_LOCAL_SPLITS = (
    _site(">=0.21,<0.24", f"{NIXL_PKG}.worker",
          "NixlConnectorWorker._build_local_splits_from_plan"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker",
          "NixlBaseConnectorWorker._build_local_splits_from_plan"),
)

# Which per-region byte length a release divides when it reads a head slice / a smaller remote
# block: up to 0.26 `get_backend_aware_kv_block_len(i, first_split)` (the K or V half when K|V
# share a block), from 0.27 `block_len_per_layer[i]` (0.27.1 `_build_fa_remote`; 0.27 no
# longer has the backend-aware method).
SPLIT_LEN_SOURCES = (
    (VersionRange(">=0.19,<0.27"), "backend_aware"),
    (VersionRange(">=0.27"), "block_len_per_layer"),
)


# Request validation in the front-end process, before the request reaches the engine core.
# A `ValueError` (vLLM's `VLLMValidationError`) raised here is a 400 for that one request on
# every entry point (OpenAI/Anthropic servers, `LLM`).  `kv_transfer_params` rides in
# `SamplingParams.extra_args["kv_transfer_params"]` (read back by `v1/request.py`).
# Same module, class and signature (params, supported_tasks) in 0.19.0-0.33.0.
VALIDATE_REQUEST_PARAMS = (
    _site(">=0.19", "vllm.v1.engine.input_processor", "InputProcessor._validate_params"),
)


# The decode worker's per-step result collection up to 0.29 (0.30 renames it
# `get_transfer_results`); every request in `_failed_recv_reqs` (a set up to 0.21, a queue
# from 0.22) is listed there as done receiving.
GET_FINISHED = (
    *_until_024("worker", "NixlConnectorWorker.get_finished"),
    _site(">=0.24,<0.30", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker.get_finished"),
)
# In 0.19-0.21 `get_finished` runs the heterogeneous-block-size post-processing for *failed*
# receives too, looking up the remote engine -- which raises KeyError when the handshake
# failed before the engine was registered (0.19 nixl_connector.py L2302
# `kv_topo.block_size_ratio_from_engine_id`; 0.20.2 worker.py L1685, 0.21.0
# `transfer_topo.get_engine_info`).  0.22 skips failed requests there.
FAILED_RECV_LOOKUP = VersionRange(">=0.19,<0.22")

# A receive with no local blocks owes P only the notification that frees P's blocks: a full
# local prefix hit (`update_state_after_alloc` with `num_external_tokens == 0`) or a request
# aborted before it was scheduled (`request_finished` queues `(request, [])`).  The scheduler
# never parks such a request in WAITING_FOR_REMOTE_KVS (`get_num_new_matched_tokens` returns
# `(0, False)`), and a worker that lists it as finished receiving kills the engine core:
# `_update_from_kv_xfer_finished` asserts `req_id in self.requests` and, unless the request
# is parked, `RequestStatus.is_finished(req.status)` (0.19.1 scheduler.py L2128-2133, the same
# lines through 0.33).  Its own notification failing is only logged, in every release.
# 0.19-0.29 store the receive's metadata like any other; when its handshake fails, the
# release's failure callback marks `meta.local_block_ids[0]` invalid -- an IndexError on the
# empty ids, raised inside the future's callback (logged by concurrent.futures, swallowed)
# before the request is queued as failed -- except for HMA models, whose failure path skips
# the block ids (their "TODO handle failed transfer for HMA"): there the request is queued
# failed and reported (0.19.1 nixl_connector.py L1527-1531; 0.22.1 worker.py L1926-1928;
# 0.29.0 base_worker.py L2433-2435).  0.30 flags these receives (`awaiting_kvs=False`) and
# never stores them, so a failure finds nothing to report.
NOTIFY_ONLY_UNFLAGGED = VersionRange(">=0.19,<0.30")


def is_notify_only(meta: Any) -> bool:
    """Whether a receive's metadata has no local block to fill, in any KV-cache group (the
    test of 0.30's `start_load_kv`, ``any(meta.local_block_ids)``, and of every release's
    `_read_blocks` full-hit branch)."""
    ids = getattr(meta, "local_block_ids", None)
    return ids is not None and all(len(group) == 0 for group in ids)


# The decode worker's view of TP sizes and KV heads: `kv_topo` (TpKVTopology) in 0.19,
# `transfer_topo` (TransferTopology) from 0.20.  Both hold `tp_size` and `total_num_kv_heads`
# (the release's own count, which its TP maths divides).
TRANSFER_TOPOLOGY_FROM = Version("0.20")
TOPOLOGY_ATTRS = (
    (VersionRange(f">=0.19,<{TRANSFER_TOPOLOGY_FROM}"), "kv_topo"),
    (VersionRange(f">={TRANSFER_TOPOLOGY_FROM}"), "transfer_topo"),
)


def topology(worker: Any, version: Version) -> Any:
    """The worker's topology object (``AttributeError`` where it has none)."""
    attr = next(name for spec, name in TOPOLOGY_ATTRS if version in spec)
    return getattr(worker, attr)


def any_topology(worker: Any) -> Any:
    """The worker's topology object under any release's name; None where it has none (for
    wrappers that are not told the release)."""
    return next((t for t in (getattr(worker, name, None) for _, name in TOPOLOGY_ATTRS) if t),
                None)


# vLLM 0.20 added the heterogeneous-TP head-split layout check to
# `_validate_remote_agent_handshake`; 0.19 slices non-HND blocks silently.
HETERO_TP_LAYOUT_CHECK_FROM = Version("0.20")


def checks_hetero_tp_layout(version: Version) -> bool:
    """Whether the release refuses a head split of a non-HND layout itself."""
    return release_of(version) >= HETERO_TP_LAYOUT_CHECK_FROM


# From 0.29 the worker registers `cache.untyped_storage()` whole, not the view it was given.
STORAGE_REGISTRATION_FROM = Version("0.29")


def registers_whole_storage(version: Version) -> bool:
    """Whether ``register_kv_caches`` registers each cache's whole storage (0.29+)."""
    return release_of(version) >= STORAGE_REGISTRATION_FROM


def transfer_tp_size(worker: Any) -> int:
    """The worker's own TP size as its transfer code counts it (``transfer_tp_size`` where the
    release has one, else ``world_size``)."""
    return int(getattr(worker, "transfer_tp_size", 0) or getattr(worker, "world_size", 1))


def transfer_tp_rank(worker: Any) -> int:
    """The worker's own TP rank as its transfer code counts it (``transfer_tp_rank`` where the
    release has one, else ``tp_rank``)."""
    return int(getattr(worker, "transfer_tp_rank", getattr(worker, "tp_rank", 0)))


def remote_engine_known(worker: Any, engine_id: str, version: Version) -> bool:
    """Whether ``get_finished``'s remote-engine lookup (0.19-0.21) would succeed."""
    try:
        if release_of(version) < TRANSFER_TOPOLOGY_FROM:
            worker.kv_topo.block_size_ratio_from_engine_id(engine_id)
        else:
            worker.transfer_topo.get_engine_info(engine_id)
    except KeyError:
        return False
    return True


def split_len_source(version: Version) -> str | None:
    return next((src for spec, src in SPLIT_LEN_SOURCES if version in spec), None)


# The layout names of RFC #42082 (5-D: LBNHC/LBHNC) replace NHD/HND from 0.29.
LAYOUT_5D_NAMES_FROM = Version("0.29")


def layout_names(version: Version) -> tuple[str, str]:
    """(token-major, head-major) layout names of a release: NHD/HND up to 0.28, the 5-D names
    of RFC #42082 (LBNHC/LBHNC) from 0.29."""
    if release_of(version) >= LAYOUT_5D_NAMES_FROM:
        return "LBNHC", "LBHNC"
    return "NHD", "HND"



# vLLM's in-place head-major -> token-major reorder of received blocks (`enable_permute_local_kv`),
# as bound in the worker module that calls it.  Up to 0.28 it handles only 4-D caches (one K or
# V tensor `[N, H, bs, D]`, or packed K|V from 0.26); a blocks-first `[N, 2, bs, H, D]` cache
# (Triton/FlashInfer <= 0.25, FlashAttention 0.23-0.25) raises in `index_copy_` inside
# `get_finished`, which kills the worker.  0.26-0.31 reshape a token-major packed cache's logical
# view (see RECEIVE_PERMUTE_SCRAMBLES).  From 0.32 the worker calls only
# `kv_postprocess_blksize_and_layout_on_receive`, which reads the bytes in memory order itself.
RECEIVE_PERMUTE = (
    *_until_024("worker", "kv_postprocess_layout_on_receive"),
    _site(">=0.24,<0.32", f"{NIXL_PKG}.base_worker", "kv_postprocess_layout_on_receive"),
)

# The same reorder for a peer with smaller blocks (`kv_postprocess_blksize_and_layout_on_receive`,
# which the worker calls instead when the decode engine's blocks are a multiple of the peer's):
# one body in 0.19-0.31 (docstrings aside), reading the cache's logical shape as
# `[N, bs, H, D]` as the reorder above does, so the same wrapper; 0.32 rewrote it to read memory
# order.
RECEIVE_PERMUTE_BLOCK_RATIO = (
    *_until_024("worker", "kv_postprocess_blksize_and_layout_on_receive"),
    _site(">=0.24,<0.32", f"{NIXL_PKG}.base_worker",
          "kv_postprocess_blksize_and_layout_on_receive"),
)

# Releases whose READ into a blocks-first cache `[N, 2, bs, H, D]` (Triton/FlashInfer 0.19-0.25,
# FlashAttention 0.23-0.25) from a peer with smaller blocks overruns into the next block (its V
# descriptors are not divided by the ratio), after which the block-size-and-layout reorder
# raises in `get_finished` and the decode worker dies (`pair_reorder_ratio*` in
# test_kv_segments_harness: FlashAttention 0.23-0.25, Triton 0.20-0.25; 0.19's Triton ignores
# the head-major layout, so no head-major peer of it reaches the reorder there).
BLOCKS_FIRST_RATIO_OVERRUN = VersionRange(">=0.19,<0.26")

# Releases whose receive-side reorder yields the peer's heads in the right place for every cache
# shape their backends allocate, through the layout patch's wrapper above (blocks-first caches
# as their K and V views; 0.26-0.31's token-major packed caches as their memory-order view),
# checked on each release's real worker code (`pair_reorder*` in test_kv_segments_harness,
# which sets 0.29+'s resolved LBNHC/LBHNC layout per side).  Stock 0.26-0.31 reshape the
# *logical* view of a token-major cache, whose logical shape is head-major `(N, H, bs, 2D)`
# there, instead of its memory order: without the wrapper the reordered blocks come out
# scrambled, with no error (on GPU engines, run cc: vLLM 0.30, a kvcached decode engine with
# the flag vLLM's own handshake error advises, 0/6 answers intact).  0.32 reads memory order.
# Open-ended: on a newer release the layout patch applies only where the reorder's code is
# unchanged (its relies_on), and a closed bound here would switch the reorder off there alone.
RECEIVE_PERMUTE_SOUND = VersionRange(">=0.19")
RECEIVE_PERMUTE_SCRAMBLES = VersionRange(">=0.26,<0.32")


def reorders_heads_on_receive(worker: Any, meta: Any, version: Version) -> bool:
    """Whether the release itself will reorder this peer's heads after each receive, rightly.

    Every release 0.19-0.33 has the same rule in ``_validate_remote_agent_handshake``: with
    ``kv_transfer_config.enable_permute_local_kv`` on, a head-major peer (``HND``; ``LBHNC``
    from 0.29) of a token-major decode worker (``NHD``/``LBNHC``) is accepted and the worker
    permutes the received blocks in place.  With a CPU host buffer the layouts compared are
    the buffer's (head-major then), so nothing is reordered on the device.
    """
    ktc = getattr(worker, "kv_transfer_config", None)
    if version not in RECEIVE_PERMUTE_SOUND or not getattr(ktc, "enable_permute_local_kv", False) \
            or getattr(worker, "use_host_buffer", False):
        return False
    token_major, head_major = layout_names(version)
    return getattr(worker, "kv_cache_layout", None) == token_major and \
        getattr(meta, "kv_cache_layout", None) == head_major


# How a release records "this request's KV load failed" on the decode worker (read from each
# release's `_handle_failed_transfer`, `get_finished`/`get_transfer_results` and worker __init__):
#   set      0.19-0.21  `_invalid_block_ids: set`, `_failed_recv_reqs: set`; the release's own
#                       `_handle_failed_transfer(req_id, handle)` needs a real handle and does not
#                       list the request as failed, so the steps are done here, as its
#                       `_read_blocks` except-branch does (0.19 nixl_connector.py L2690-2706).
#   queue    0.22-0.29  both are `queue.Queue`s; `_handle_failed_transfer(req_id, None)` does all
#                       of it (0.22.1 worker.py L1915).  `get_finished` reports a queued failure
#                       at once, so a request with reads still in flight must not be queued.
#   deferred 0.30-0.33  `_handle_failed_transfer(req_id, None, self._recv_failures)`; the
#                       request is reported (`failed_recving`) once no handle is outstanding.
# Up to 0.29 the only per-request failure signal is `invalid_block_ids`, which those releases
# skip for HMA models (their own "TODO handle failed transfer for HMA"): there a failure cannot
# be recorded without the scheduler treating garbage KV as loaded.
RECV_FAILURE_STYLES = (
    (VersionRange(">=0.19,<0.22"), "set"),
    (VersionRange(">=0.22,<0.30"), "queue"),
    (VersionRange(">=0.30"), "deferred"),
)


class FailureNotRecordable(RuntimeError):
    """This release has no way to fail this one request cleanly (HMA before 0.30)."""


def recv_failure_style(version: Version) -> str | None:
    return next((style for spec, style in RECV_FAILURE_STYLES if version in spec), None)


def failure_recordable(worker: Any, version: Version) -> bool:
    """Whether the release can fail one request's KV load alone on this worker: not for HMA
    models before 0.30 (see above; vllm#52234 is the release reporting such a failure as a
    finished load anyway)."""
    return recv_failure_style(version) == "deferred" or not worker._is_hma_required


def record_recv_failure(worker: Any, req_id: str, version: Version | None = None) -> None:
    """Fail one request's KV load the way the running release itself records such failures.

    The scheduler then recomputes or fails that request (``kv_load_failure_policy``) and frees
    its blocks; the worker and every other request carry on.  Raises
    :class:`FailureNotRecordable` where the release cannot express the failure (see above) and
    ``LookupError`` for a release outside the table.
    """
    if version is None:
        from pdpatch.versions import vllm_version

        version = vllm_version()
    style = recv_failure_style(version) if version is not None else None
    if style == "deferred":
        worker._handle_failed_transfer(req_id, None, worker._recv_failures)
        return
    if style not in ("set", "queue"):
        raise LookupError(f"no KV-load failure bookkeeping known for vLLM {version}")
    meta = worker._recving_metadata.get(req_id)
    if meta is None:
        return                      # nothing awaits this load; nothing to report
    if not failure_recordable(worker, version):
        raise FailureNotRecordable(
            f"vLLM {version} reports failed KV loads only as invalid blocks, which it does not "
            "support for hybrid (HMA) KV-cache layouts")
    in_flight = bool(worker._recving_transfers.get(req_id))
    if style == "queue" and not in_flight:
        worker._handle_failed_transfer(req_id, None)
        return
    blocks = set(meta.local_block_ids[0]) if meta.local_block_ids else set()
    if style == "set":
        worker._invalid_block_ids.update(blocks)
    else:
        worker._invalid_block_ids.put(blocks)
    worker.xfer_stats.record_failed_transfer()
    if not in_flight:
        worker._failed_recv_reqs.add(req_id)
    # else: the reads already posted report the request when they finish, and the blocks
    # marked invalid above make the scheduler recompute it.


# ------------------------------------------------------- remote block counts (block_ids_bound)

# D's local prefix-cache hits per KV-cache group, counted by the pull scheduler's
# `update_state_after_alloc` (`block.block_hash is not None and not block.is_null` over the
# request's blocks) and carried to the worker as `ReqMeta.local_num_computed_blocks` from 0.29
# (0.29.0 pull_scheduler.py L161).  0.19-0.28 count nothing of the kind: the worker sees only the
# blocks it reads into.
LOCAL_HITS_IN_METADATA_FROM = Version("0.29")

# The pull scheduler half's `update_state_after_alloc(request, blocks, num_external_tokens)`,
# which queues a receive in `self._reqs_need_recv`, and the `build_connector_meta` that turns the
# queue into the workers' `ReqMeta`s and clears it, in the same scheduler step (only where the
# worker lacks the hit counts).
PULL_UPDATE_STATE_AFTER_ALLOC = (
    *_until_024("scheduler", "NixlConnectorScheduler.update_state_after_alloc"),
    _site(">=0.24,<0.29", f"{NIXL_PKG}.pull_scheduler",
          "NixlPullConnectorScheduler.update_state_after_alloc"),
)
BUILD_CONNECTOR_META = (
    *_until_024("scheduler", "NixlConnectorScheduler.build_connector_meta"),
    _site(">=0.24,<0.29", f"{NIXL_PKG}.base_scheduler",
          "NixlBaseConnectorScheduler.build_connector_meta"),
)


class PeerBlocks(NamedTuple):
    """How a handshaken peer lays out the blocks its ``remote_block_ids`` name."""

    block_size_ratio: int        # local kernel block / peer kernel block (the release's own)
    physical_per_logical: int    # the peer's kernel blocks per logical block
    dcp_size: int                # the peer's decode-context-parallel size


def peer_blocks(worker: Any, engine_id: str, version: Version) -> PeerBlocks | None:
    """The release's own record of peer ``engine_id``; None where it has none (no handshake
    yet).  0.19 keeps the peer's block size in ``kv_topo`` and expands the peer's ids with its
    own physical-per-logical ratio; 0.20+ keep an ``EngineTransferInfo`` per peer."""
    try:
        if release_of(version) < TRANSFER_TOPOLOGY_FROM:
            topo = worker.kv_topo
            return PeerBlocks(int(topo.block_size_ratio_from_engine_id(engine_id)),
                              int(worker._physical_blocks_per_logical_kv_block), 1)
        info = worker.transfer_topo.get_engine_info(engine_id)
        return PeerBlocks(int(worker.transfer_topo.block_size_ratio(info.remote_block_size)),
                          int(info.remote_physical_blocks_per_logical),
                          int(getattr(info, "remote_dcp_size", 1)))
    except (KeyError, AttributeError, AssertionError, ZeroDivisionError):
        return None


# ---------------------------------------------------------------- block keys (patch block_keys)

def lookup_all(sites: tuple[Site, ...], version: Version) -> list[Site]:
    """Every site of ``sites`` for ``version`` (a concept defined on several classes)."""
    return [s for s in sites if s.matches(version)]


# P side: the connector facade's `request_finished` and `request_finished_all_groups` (every
# release has both; each hands the scheduler half `(request, block_ids-per-group)` and returns
# `(delay_free, kv_transfer_params)`).  >=0.24 they are defined on `NixlBaseConnector`, which
# the pull (`NixlConnector` alias) and push connectors share.
REQUEST_FINISHED = (
    *_until_024("connector", "NixlConnector.request_finished"),
    _site(">=0.24", f"{NIXL_PKG}.connector", "NixlBaseConnector.request_finished"),
)
REQUEST_FINISHED_ALL_GROUPS = (
    *_until_024("connector", "NixlConnector.request_finished_all_groups"),
    _site(">=0.24", f"{NIXL_PKG}.connector", "NixlBaseConnector.request_finished_all_groups"),
)

# D side: the scheduler half's `get_num_new_matched_tokens(request, num_computed_tokens)`, which
# turns `do_remote_prefill` params into "load N tokens asynchronously".  `(0, False)` is the
# "no external tokens" answer in every release; `update_state_after_alloc` then sees
# `num_external_tokens == 0` and (pull) queues a receive with no blocks, whose only effect is the
# notification that frees P's blocks -- stock vLLM's path for a full local prefix hit.  Push
# (0.24+) stages no registration then; its `request_finished` frees P when D finishes.
GET_NUM_NEW_MATCHED_TOKENS = (
    *_until_024("scheduler", "NixlConnectorScheduler.get_num_new_matched_tokens"),
    _site(">=0.24", f"{NIXL_PKG}.pull_scheduler",
          "NixlPullConnectorScheduler.get_num_new_matched_tokens"),
    _site(">=0.24", f"{NIXL_PKG}.push_scheduler",
          "NixlPushConnectorScheduler.get_num_new_matched_tokens"),
)
NO_EXTERNAL_TOKENS = (0, False)

# The prompt prefix a remote prefill moves (block_keys hashes exactly that prefix on P and D).
# P stops short of the last b prompt tokens, which D recomputes itself: P's half drops them from
# `prompt_token_ids` (or, for an embeddings prompt, `prompt_embeds`), `_all_token_ids` and
# `num_prompt_tokens` before the prefill, so `request_finished` sees the truncated request.  b is
# 1 for a Mamba hybrid (`_has_mamba`) from 0.19; 0.31+ `_prefill_backoff()`: also the MTP drafter's
# lookahead window minus one (0.31.0 base_scheduler.py L385-398), and 1 under bounded replay from
# 0.32 (0.34.0 base_scheduler.py L385-400).  Called from P's `get_num_new_matched_tokens` up to
# 0.28 (0.28.0 pull_scheduler.py L69), from `on_new_request` from 0.29 (0.34.0
# base_scheduler.py L206); 0.32+ skip a request that reads no external KV (0.34.0 L429).
P_PROMPT_TRUNCATION = (
    *_until_024("scheduler", "NixlConnectorScheduler._truncate_mamba_request_for_prefill"),
    _site(">=0.24,<0.31", f"{NIXL_PKG}.base_scheduler",
          "NixlBaseConnectorScheduler._truncate_mamba_request_for_prefill"),
    _site(">=0.31", f"{NIXL_PKG}.base_scheduler",
          "NixlBaseConnectorScheduler._truncate_request_for_prefill"),
)
# D loads `count(len(request.prompt_token_ids or []))` tokens of a `do_remote_prefill` request
# (minus its local hit), `count` being its half's method below, in the pull and the push
# half alike (0.19.1 nixl_connector.py L786-787; 0.34.0 pull_scheduler.py L61-62,
# push_scheduler.py L120-121; the same two lines in every release between): the prompt less the
# same b, so that D's prefix is the prefix P computed.
REMOTE_PREFILL_TOKEN_COUNT = (
    *_until_024("scheduler", "NixlConnectorScheduler._mamba_prefill_token_count"),
    _site(">=0.24,<0.25", f"{NIXL_PKG}.base_scheduler",
          "NixlBaseConnectorScheduler._mamba_prefill_token_count"),
    _site(">=0.25", f"{NIXL_PKG}.base_scheduler",
          "NixlBaseConnectorScheduler._get_remote_prefill_token_count"),
)


def remote_prefill_tokens(half: Any, request: Any, version: Version) -> int | None:
    """How many prompt tokens D's scheduler half ``half`` loads from P for ``request`` (before
    its local hit), by the release's own method; None where the half lacks it."""
    site = lookup(REMOTE_PREFILL_TOKEN_COUNT, release_of(version))
    count = getattr(half, site.qualname.rsplit(".", 1)[1], None) if site else None
    if count is None:
        return None
    return int(count(len(request.prompt_token_ids or [])))


# From 0.31 the Scheduler drops the connector's answer for a request that reads no external KV
# (prompt logprobs, `skip_reading_prefix_cache`): `ext_tokens, load_kv_async = 0, False` right
# after `get_num_new_matched_tokens` (0.31.0 scheduler.py L953-954, 0.33.0 L1143-1144; 0.34.0
# L1182-1183 asks `request.skip_reading_external_kv`, request.py L358-362).  Up to 0.30 the
# connector's hit is used for such a request too.
EXTERNAL_HIT_DISCARDED_FROM = Version("0.31")
EXTERNAL_KV_SKIP_PROPERTY_FROM = Version("0.34")


def external_hit_discarded(request: Any, version: Version) -> bool:
    """Whether the release's Scheduler ignores what the connector answers for ``request``."""
    release = release_of(version)
    if release < EXTERNAL_HIT_DISCARDED_FROM:
        return False
    attr = ("skip_reading_external_kv" if release >= EXTERNAL_KV_SKIP_PROPERTY_FROM
            else "skip_reading_prefix_cache")
    return getattr(request, attr, False) is True

# The scheduler half's NIXL side channel.  `set_xfer_handshake_metadata(metadata)` starts the
# `nixl_handshake_listener` thread, whose target is the static `_nixl_handshake_listener(
# encoded_data, ready_event, stop_event, [host,] port)`, then waits on `ready_event` with no
# timeout; the listener sets it only once its ZMQ socket is bound.  Same in every release
# 0.19-0.33 (the class moved twice).
HANDSHAKE_LISTENER_OWNER = (
    *_until_024("scheduler", "NixlConnectorScheduler"),
    _site(">=0.24", f"{NIXL_PKG}.base_scheduler", "NixlBaseConnectorScheduler"),
)

# Engine start: `EngineCore.__init__` has created the scheduler (and the connector's scheduler
# half), then `init_none_hash` and the request block hasher -- when prefix caching or a KV
# connector is on -- in every release 0.19-0.33.
ENGINE_CORE_INIT = (
    _site(">=0.19", "vllm.v1.engine.core", "EngineCore.__init__"),
)


# From 0.20 EngineCore takes the hash block size from `resolve_kv_cache_block_sizes`.
RESOLVED_HASH_BLOCK_SIZE_FROM = Version("0.20")


def hash_block_size(vllm_config: Any, kv_cache_config: Any, version: Version) -> int:
    """Tokens per entry of ``request.block_hashes``, as EngineCore passes it to
    ``get_request_block_hasher``.

    0.19: ``block_size * DCP * PCP`` (core.py L137-141).  0.20+: the second value of
    ``resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)``, called with the very
    scheduler-side KV-cache config that the scheduler and its connector hold; 0.32+ also store
    it in ``kv_cache_config.hash_block_size`` (None in a config built outside EngineCore).
    """
    stored = getattr(kv_cache_config, "hash_block_size", None)
    if isinstance(stored, int) and stored > 0:
        return stored
    if release_of(version) < RESOLVED_HASH_BLOCK_SIZE_FROM:
        par = vllm_config.parallel_config
        return (vllm_config.cache_config.block_size * par.decode_context_parallel_size
                * par.prefill_context_parallel_size)
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])


def live_none_hash() -> bytes | None:
    """NONE_HASH of this EngineCore process, read at call time (``init_none_hash`` rebinds the
    module global of ``vllm.v1.core.kv_cache_utils`` in every release); None before it ran."""
    import vllm.v1.core.kv_cache_utils as kcu

    value = getattr(kcu, "NONE_HASH", None)
    return value if isinstance(value, bytes) and value else None


# ------------------------------------- requests that never reached the scheduler's allocation
# (patches params_guard and readback_guard)

# A D request still carrying `do_remote_prefill` when it finishes never went through
# `update_state_after_alloc`: it was aborted while waiting, or (from 0.21) the API server
# rejected it after reading its kv_transfer_params and `notify_kv_transfer_request_rejected`
# submitted it `abort_immediately` so that P may free its blocks.  The pull and push
# schedulers' `request_finished` then queue a notification-only receive, and the next
# `build_connector_meta` hands the params to `NixlConnectorMetadata.add_new_req_to_recv`, which
# indexes these keys (every release 0.19-0.33): a missing one raises KeyError in EngineCore.
RECV_PARAMS_INDEXED = ("remote_block_ids", "remote_engine_id", "remote_request_id",
                       "remote_host", "remote_port")
# Params used as dict keys or set members: the decode worker looks the engine up in its agent
# tables (every release), the scheduler half's `on_new_request` (0.22+) adds both to its
# heartbeat tables -- an unhashable value raises TypeError there (EngineCore or worker dies).
HASHED_PARAMS = ("remote_engine_id", "remote_request_id")

# The facade's `on_new_request` (0.22+), called by `Scheduler.add_request` for every request,
# before an `abort_immediately` request is finished.
ON_NEW_REQUEST = (
    _site(">=0.22,<0.24", f"{NIXL_PKG}.connector", "NixlConnector.on_new_request"),
    _site(">=0.24", f"{NIXL_PKG}.connector", "NixlBaseConnector.on_new_request"),
)

# The push scheduler (0.24+) seeds `remote_block_ids = ()` in `request_finished` before
# queueing that receive from 0.26 on (P picks the blocks in push mode); 0.24-0.25 do not.
PUSH_SCHEDULER = (
    _site(">=0.24", f"{NIXL_PKG}.push_scheduler", "NixlPushConnectorScheduler"),
)
PUSH_SEEDS_REMOTE_BLOCK_IDS = VersionRange(">=0.26")


def seeded_recv_params(scheduler: Any, version: Version) -> tuple[str, ...]:
    """The keys of :data:`RECV_PARAMS_INDEXED` that ``scheduler`` (a scheduler half) fills in
    itself before it queues a never-scheduled request's receive."""
    if version not in PUSH_SEEDS_REMOTE_BLOCK_IDS:
        return ()
    pushes_here = is_loaded_instance(scheduler, lookup(PUSH_SCHEDULER, version))
    return ("remote_block_ids",) if pushes_here else ()


# The pull scheduler's KV *readback* (0.21+, "bidirectional KV transfer"): a request with
# `do_remote_decode` that also carries `remote_block_ids` and the four remote fields is
# answered by `get_num_new_matched_tokens` with `(count, True)` -- load asynchronously -- when
# `count` reaches `kv_recompute_threshold`, whatever the engine's settings.  But
# `update_state_after_alloc` queues that receive only when `bidirectional_kv_xfer` is on, no
# host buffer takes the request first (`use_host_buffer`) and it was not queued before
# (`_remote_blocks_processed`); otherwise the request waits in WAITING_FOR_REMOTE_KVS for a
# transfer nobody started, forever.  The push scheduler (0.24+) has no readback.
READBACK_MATCH = (
    _site(">=0.21,<0.24", f"{NIXL_PKG}.scheduler",
          "NixlConnectorScheduler.get_num_new_matched_tokens"),
    _site(">=0.24", f"{NIXL_PKG}.pull_scheduler",
          "NixlPullConnectorScheduler.get_num_new_matched_tokens"),
)


def readback_receive_queued(scheduler: Any, params: Any) -> bool:
    """Whether the release's ``update_state_after_alloc`` will queue the readback receive
    that its ``get_num_new_matched_tokens`` promised for ``params`` (same conditions, same
    order, 0.21-0.33)."""
    if getattr(scheduler, "use_host_buffer", False):
        return False
    return bool(getattr(scheduler, "is_bidirectional_kv_xfer_enabled", False)) and \
        not params.get("_remote_blocks_processed")


# NIXL statistics on their way to `/metrics`, the same in 0.19-0.33: the worker half's
# `get_kv_connector_stats()` (on the connector facade; the scheduler half has no worker and
# returns None) fills `KVConnectorOutput.kv_connector_stats`; `KVOutputAggregator` folds the
# workers' into one with `NixlKVConnectorStats.aggregate`; `Scheduler.make_stats(spec, kv_stats,
# ...)` puts its plain dict (`to_dict()`) in `SchedulerStats.kv_connector_stats`; the API
# server's `PrometheusStatLogger` hands that dict to `NixlPromMetrics.observe(data, engine_idx)`.
# `_update_waiting_for_remote_kv(request)` runs once per request whose async KV load ended,
# with the request in `failed_recving_kv_req_ids` when it failed.
CONNECTOR_STATS = (
    *_until_024("connector", "NixlConnector.get_kv_connector_stats"),
    _site(">=0.24", f"{NIXL_PKG}.connector", "NixlBaseConnector.get_kv_connector_stats"),
)
NIXL_STATS_HOME = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlKVConnectorStats"),
    _site(">=0.20", f"{NIXL_PKG}.stats", "NixlKVConnectorStats"),
)
NIXL_PROM_HOME = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlPromMetrics"),
    _site(">=0.20", f"{NIXL_PKG}.stats", "NixlPromMetrics"),
)
SCHEDULER_HOME = (
    _site(">=0.19", "vllm.v1.core.sched.scheduler", "Scheduler"),
)


# The push mode's worker (0.24+): P WRITEs into D's KV, where in pull mode D READs P's.
PUSH_WORKER = (
    _site(">=0.24", f"{NIXL_PKG}.push_worker", "NixlPushConnectorWorker"),
)


def pushes(worker: Any, version: Version) -> bool:
    """Whether ``worker`` is a push-mode NIXL worker (P writes into D's KV memory)."""
    return is_loaded_instance(worker, lookup(PUSH_WORKER, version))


def loaded_class(site: Site) -> type | None:
    """The class a site's qualname starts with, if its module is imported in this process
    (a connector of that class can exist only then): no import is triggered."""
    return getattr(sys.modules.get(site.module), site.qualname.split(".")[0], None)


def is_loaded_instance(obj: Any, site: Site | None) -> bool:
    """Whether ``obj`` is an instance of the class ``site`` names (None: the release has no
    such class), its module imported (:func:`loaded_class`)."""
    cls = None if site is None else loaded_class(site)
    return cls is not None and isinstance(obj, cls)


# ------------------------------------------------------------------ KV leases (lease_guard)

# From 0.26 the pull worker measures each peer's clock at the handshake (`_engine_clock_offset`,
# the peer scheduler's `perf_counter` less its own, sampled at the lowest round trip) and
# declines a turn-2 readback whose expiry has (nearly) passed: `_is_turn2_read_expired`, margin
# `_KV_BLOCKS_EXPIRY_SAFETY_MARGIN` (5 s) in the pull worker's module.  P's scheduler half holds a
# finished request's blocks in `_reqs_need_send` (request id -> its `perf_counter` expiry, the
# clock the handshake reports); D's scheduler half puts heartbeats for the P requests it holds
# into the step's metadata (`heartbeat_by_engine`: engine id -> `HeartbeatInfo.req_ids`) and the
# worker's `_send_heartbeats(metadata)` sends them to engines it has met (`_remote_agents`).
# 0.22-0.25 lease and heartbeat too, but measure no peer clock; 0.19-0.21 hold blocks 480 s.
LEASE_CHECK_FROM = "0.26"
ADD_NEW_REQ_TO_RECV = (
    _site(">=0.26", f"{NIXL_PKG}.metadata", "NixlConnectorMetadata.add_new_req_to_recv"),
)
SEND_HEARTBEATS = (
    _site(">=0.26", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker._send_heartbeats"),
)
EXPIRY_MARGIN_MODULE = f"{NIXL_PKG}.pull_worker"
# From 0.31 `_handle_failed_transfer` takes `record_failed_transfer`, which an expired read
# sets False (it is counted as expired, not as a failed transfer).
FAILED_TRANSFER_FLAG_FROM = Version("0.31")


def expiry_margin() -> float:
    """The release's safety margin for a read against a lease (5 s in 0.26-0.33)."""
    module = sys.modules.get(EXPIRY_MARGIN_MODULE)
    return float(getattr(module, "_KV_BLOCKS_EXPIRY_SAFETY_MARGIN", 5.0))


def decline_expired_read(worker: Any, req_id: str, version: Version) -> None:
    """Decline one request's READ as the release declines an expired turn-2 readback in
    `_read_blocks_for_req` (0.26.0 pull_worker.py L129-131, 0.30.0 L158-159, 0.31.0 L164-169):
    its expired-request counter, then its failure path for a read that never started."""
    worker.xfer_stats.record_kv_expired_req()
    if recv_failure_style(version) == "queue":
        worker._handle_failed_transfer(req_id, None)
    elif release_of(version) < FAILED_TRANSFER_FLAG_FROM:      # "deferred", no flag yet
        worker._handle_failed_transfer(req_id, None, worker._recv_failures)
    else:
        worker._handle_failed_transfer(req_id, None, worker._recv_failures,
                                       record_failed_transfer=False)


# ------------------------------------------------------------ what patches rest on (relies_on)
# Beyond its targets, each patch names the vLLM code its correctness rests on: where the fault it
# fixes lives, and where an upstream fix would land.  On a release newer than pdpatch verified, a
# patch applies by itself only where all of it is unchanged (pdpatch.verified); a change here
# turns the patch off until it is verified again.  Each concept is its sites per release.

# The decode worker's read path around `_read_blocks_for_req`: its unguarded caller, the READ it
# posts (asserts, descriptor ids), the failure bookkeeping, and how failures are reported.
START_LOAD_KV = _per_worker("start_load_kv", pull=True)
READ_BLOCKS = _per_worker("_read_blocks", pull=True)
HANDLE_FAILED_TRANSFER = _per_worker("_handle_failed_transfer")
GET_TRANSFER_RESULTS = (
    _site(">=0.30", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker.get_transfer_results"),
)
DESC_IDS = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlConnectorWorker._get_block_descs_ids"),
    _site(">=0.20,<0.21", f"{NIXL_PKG}.worker", "NixlConnectorWorker._get_block_descs_ids"),
    _site(">=0.21,<0.24", f"{NIXL_PKG}.worker", "NixlConnectorWorker._compute_desc_ids"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker._compute_desc_ids"),
)
# The end-trim pairing of D's blocks with P's (inline in `_read_blocks` before 0.22).
APPLY_PREFIX_CACHING = (
    _site(">=0.22,<0.24", f"{NIXL_PKG}.worker", "NixlConnectorWorker._apply_prefix_caching"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker._apply_prefix_caching"),
)
# Blocks of different sizes: kernel ids per logical block, the positional ratio mapping
# (0.27+; inline in `_read_blocks` before), pairing from the last token (0.34+).
BLOCK_SIZE_PAIRING = (
    _site(">=0.20,<0.24", f"{NIXL_PKG}.worker", "NixlConnectorWorker._logical_to_kernel_block_ids"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker",
          "NixlBaseConnectorWorker._logical_to_kernel_block_ids"),
    _site(">=0.27", f"{NIXL_PKG}.base_worker",
          "NixlBaseConnectorWorker._map_block_ids_for_block_size_ratio"),
    _site(">=0.34", f"{NIXL_PKG}.base_worker",
          "NixlBaseConnectorWorker._pair_blocks_by_last_token"),
)
# P's list of blocks for a finished request: the blocks of its computed tokens.
CONNECTOR_FINISHED = (
    _site(">=0.19", "vllm.v1.core.sched.scheduler", "Scheduler._connector_finished"),
)

# The handshake thread, which records the peer (and, 0.26+, its clock offset).
BACKGROUND_HANDSHAKE = _per_worker("_background_nixl_handshake")
# vLLM's own decline of an expired turn-2 read, the idiom lease_guard follows (0.26+).
TURN2_EXPIRY = (
    _site(">=0.26", f"{NIXL_PKG}.pull_worker", "NixlPullConnectorWorker._is_turn2_read_expired"),
    _site(">=0.26", f"{NIXL_PKG}.pull_worker", "_KV_BLOCKS_EXPIRY_SAFETY_MARGIN"),
)
# P's scheduler half stamping and extending a finished request's lease.
SCHEDULER_REQUEST_FINISHED = _per_scheduler("request_finished", "pull_scheduler",
                                            "NixlPullConnectorScheduler")
HANDLE_HEARTBEAT = (
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker._handle_heartbeat"),
)
# Where the pull scheduler queues a receive (and a readback, 0.21+).
UPDATE_STATE_AFTER_ALLOC = _per_scheduler("update_state_after_alloc", "pull_scheduler",
                                          "NixlPullConnectorScheduler")
# The wire: the handshake payload's classes, their version, and the compatibility hash.
CONNECTOR_VERSION = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NIXL_CONNECTOR_VERSION"),
    _site(">=0.20", f"{NIXL_PKG}.metadata", "NIXL_CONNECTOR_VERSION"),
)
# 0.34 pairs a peer's regions with the decode worker's by layer name.
PAIR_REGIONS = (
    _site(">=0.34", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker._pair_regions"),
)
# How a KV-cache group's spec is classified (the next() lookups spec_classify guards).
SPEC_CLASSIFIERS = (
    _site(">=0.21", f"{NIXL_PKG}.tp_mapping", "_is_attention_spec"),
    _site(">=0.21", f"{NIXL_PKG}.utils", "get_representative_spec_type"),
)
# The statistics channel's other ends (the metrics patch).
STATS_FOLD = (
    _site(">=0.19", "vllm.distributed.kv_transfer.kv_connector.utils",
          "KVOutputAggregator.aggregate"),
)
PROM_BASE = (
    _site(">=0.19", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
          "KVConnectorPromMetrics.__init__"),
)
# The layout a worker runs with: the connector's answer entering resolution, where it is
# resolved (0.29+), and the receive-side reorder's caller and memory-order body (0.32+).
CONNECTOR_LAYOUT_LOOKUP = (
    _site(">=0.19", "vllm.distributed.kv_transfer.kv_connector.utils",
          "get_kv_connector_cache_layout"),
)
RESOLVED_LAYOUT = (
    _site(">=0.29", "vllm.config.cache", "CacheConfig.get_resolved_kv_cache_layout"),
)
RECEIVE_POSTPROCESS = _per_worker("post_process_device_kv_on_receive")
RECEIVE_PERMUTE_MEMORY_ORDER = (
    _site(">=0.32", f"{NIXL_PKG}.base_worker", "kv_postprocess_blksize_and_layout_on_receive"),
)
# Block counts: the kernel/logical block sync, and the counts the handshake advertises.
SYNC_BLOCK_SIZE = _per_worker("_sync_block_size_with_kernel")
ADVERTISED_COUNTS = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlAgentMetadata.num_blocks"),
    _site(">=0.20", f"{NIXL_PKG}.metadata", "NixlAgentMetadata.num_blocks"),
    _site(">=0.30", f"{NIXL_PKG}.metadata", "NixlAgentMetadata.region_num_blocks"),
)
# vLLM's own growable KV cache (0.34+): the connector gets the committed views only.
EXTENSIBLE_COMMITTED_VIEWS = (
    _site(">=0.34", "vllm.v1.worker.extensible_kv_cache", "extend_kv_cache"),
)
# Which side of a P/D pair a worker is.
KV_ROLE_PREDICATES = (
    _site(">=0.19", "vllm.config.kv_transfer", "KVTransferConfig.is_kv_producer"),
    _site(">=0.19", "vllm.config.kv_transfer", "KVTransferConfig.is_kv_consumer"),
)
# The NIXL descriptors of both sides and their completion: what staged reads mirror.
LOCAL_XFER_HANDLER = _per_worker("register_local_xfer_handler")
POP_DONE_TRANSFERS = _per_worker("_pop_done_transfers")
TP_MAPPING = (_site(">=0.21", f"{NIXL_PKG}.tp_mapping", "compute_tp_mapping"),)
# What a request's inputs are (block_keys hashes them; params ride in its extra args).
REQUEST_INIT = (_site(">=0.19", "vllm.v1.request", "Request.__init__"),)
# vLLM's block hashing, which block_keys' keys must equal.
BLOCK_HASHING = (
    _site(">=0.19", "vllm.v1.core.kv_cache_utils", "hash_block_tokens"),
    _site(">=0.19", "vllm.v1.core.kv_cache_utils", "get_request_block_hasher"),
    _site(">=0.19", "vllm.v1.core.kv_cache_utils", "generate_block_hash_extra_keys"),
    _site(">=0.19", "vllm.v1.core.kv_cache_utils", "init_none_hash"),
)
# The front end's request processing around the validation params_check wraps.
PROCESS_INPUTS = (
    _site(">=0.19", "vllm.v1.engine.input_processor", "InputProcessor.process_inputs"),
)
# The receive metadata a request's params become (the keys the scheduler indexes).
ADD_RECV_METADATA = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlConnectorMetadata.add_new_req_to_recv"),
    _site(">=0.20", f"{NIXL_PKG}.metadata", "NixlConnectorMetadata.add_new_req_to_recv"),
)
# The scheduler half's step metadata, which hands queued receives to the workers.
SCHEDULER_BUILD_META = _per_scheduler("build_connector_meta", "base_scheduler",
                                      "NixlBaseConnectorScheduler")
# Stock code that meets the counts the metrics patch adds to NIXL's statistics, and the caller
# that makes `_update_waiting_for_remote_kv` run once per ended load.
STATS_READERS = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlKVConnectorStats.is_empty"),
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlKVConnectorStats.reduce"),
    _site(">=0.20", f"{NIXL_PKG}.stats", "NixlKVConnectorStats.is_empty"),
    _site(">=0.20", f"{NIXL_PKG}.stats", "NixlKVConnectorStats.reduce"),
)
LOAD_ENDED_CALLER = (
    _site(">=0.19,<0.31", "vllm.v1.core.sched.scheduler",
          "Scheduler._try_promote_blocked_waiting_request"),
    _site(">=0.31", "vllm.v1.core.sched.scheduler", "Scheduler._handle_blocked_waiting_request"),
)


# --------------------------------------------------- peers that come and go (peer_restart)
# P's scheduler half receives its workers' handshake payloads (`NixlHandshakePayload`: the
# compatibility hash and the encoded `NixlAgentMetadata`, whose `agent_metadata` is NIXL's own
# serialized agent -- named `str(uuid.uuid4())` at every worker start, in every release: a
# restarted P always has new bytes there, whatever engine id it keeps) and serves them on its
# side channel: `set_xfer_handshake_metadata({rank: payload})`, keys `tp_rank` up to 0.25,
# `(pp_rank, tp_rank)` from 0.26 (0.19 nixl_connector.py L649-660; 0.25.1 base_scheduler.py
# L246-257; 0.26.0 L248-259; 0.34.0 L296-316).  D loads those very bytes in `add_remote_agent`.
SET_HANDSHAKE_METADATA = _per_scheduler("set_xfer_handshake_metadata", "base_scheduler",
                                        "NixlBaseConnectorScheduler")
# D's per-remote-engine teardown (0.24+): releases the engine's remote descriptor lists and
# agents, pops every per-engine table, unregisters it from the transfer topology.  Asserts the
# engine is held; 0.24-0.25 `del` each table (0.24.0 base_worker.py L2342-2364), 0.26+ pop.
CLEANUP_REMOTE_ENGINE = (
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker._cleanup_remote_engine"),
)
CLEANUP_REMOTE_ENGINE_FROM = Version("0.24")
# 0.31+ forget an engine when another engine id answers at its side-channel address
# (`_track_remote_engine_replacement`, then `_cleanup_replaced_remote_engines` (0.31) /
# `_cleanup_remote_engines` (0.32+) each step, once none of its requests is queued).
ADDRESS_REPLACEMENT = (
    _site(">=0.31", f"{NIXL_PKG}.base_worker",
          "NixlBaseConnectorWorker._track_remote_engine_replacement"),
)
ADDRESS_REPLACEMENT_FROM = Version("0.31")
# Where a release starts a handshake for a request of an engine it does not hold: `start_load_kv`
# up to 0.31 (0.19 nixl_connector.py L2472), `_read_blocks_for_req` from 0.32 (0.33.0
# pull_worker.py L152); both through `_background_nixl_handshake(req_id, engine_id, meta)`,
# which puts the request in `_ready_requests` once the handshake is done (0.19 L1482-1531).
HANDSHAKE_IN_READ_FROM = Version("0.32")
# The per-remote-engine tables of releases without `_cleanup_remote_engine` (0.19-0.23), and
# the topology's own (`kv_topo` 0.19: `_tp_size`/`_block_size` of the worker, shared; 0.20-0.22
# `transfer_topo._engines[engine_id]`, 0.23+ `[(engine_id, pp_rank)]`): a re-handshake under
# the same engine id reuses whatever stays there (first-wins: 0.19 L1895-1915, 0.22.1
# utils.py L467-468), so a forgotten engine's entries must all go.
PER_ENGINE_TABLES = ("kv_caches_base_addr", "dst_num_blocks", "_tp_size", "_block_size",
                     "_physical_blocks_per_logical", "tp_mappings", "draft_tp_mappings",
                     "_engine_last_active", "_engine_clock_offset", "dst_region_num_blocks",
                     "dst_region_group_ids", "dst_region_mem_types", "_dst_pairs")


def remote_rank_key(key: Any) -> str:
    """A remote rank as ``"pp:tp"``: D's ``_remote_agents[engine]`` keys (``tp`` up to 0.25,
    ``(pp, tp)`` from 0.26) and P's handshake-metadata keys alike."""
    if isinstance(key, tuple) and len(key) == 2:
        return f"{int(key[0])}:{int(key[1])}"
    return f"0:{int(key)}"


# How long P keeps a finished request's blocks for D without a READ: `kv_lease_duration` of
# the connector's extra config (0.22+, 30 s by default: 0.22.1 worker.py L219, 0.34.0
# base_worker.py L686), `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` before (480 s: 0.19
# nixl_connector.py L978, 0.21.0 scheduler.py L562).  Stock vLLM serves a request's blocks
# only if D reads them within it (D's heartbeats, 0.22+, extend it only while D holds the
# request).
LEASE_FROM = Version("0.22")


def lease_seconds(worker: Any, version: Version) -> float:
    """P's lease on a finished request's blocks, as this engine's configuration states it."""
    if release_of(version) < LEASE_FROM:
        import os

        return float(os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480"))
    ktc = getattr(getattr(worker, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None) or {}
    try:
        return float(extra.get("kv_lease_duration", 30))
    except (TypeError, ValueError):
        return 30.0


# vllm#52234 (0.22-0.29): a failed receive of an HMA model is reported finished, not failed.
# The worker's single failure gate, `_handle_failed_transfer`, skips the invalid blocks (the
# only per-request failure signal before 0.30's `failed_recving`) for HMA models and queues the
# request, which `get_finished` lists as done receiving.  The channel pdpatch uses instead:
# the connector's `build_connector_worker_meta()` (the base class's, NIXL does not override
# it), called by the model runner right after `get_finished` in the same step (0.22.1
# kv_connector_model_runner_mixin.py L109-116; 0.29.0 L97-104) into
# `KVConnectorOutput.kv_connector_worker_meta`, folded across workers with `aggregate`; the
# scheduler's `update_from_output` calls `_handle_invalid_blocks(invalid_block_ids,
# num_scheduled_tokens)` only when some id is listed (0.22.1 scheduler.py L1311-1319, 0.29.0
# L1830-1838), finishes what it returns FINISHED_ERROR under the "fail" policy (0.22-0.25
# `finish_requests`, 0.26-0.29 `error_req_ids`), and `_update_waiting_for_remote_kv` frees a
# request in `failed_recving_kv_req_ids` with no computed tokens for recomputation.
HMA_FAILURE_UNREPORTED = VersionRange(">=0.22,<0.30")
CONNECTOR_WORKER_META = (
    _site(">=0.22", f"{KVC}.v1.base", "KVConnectorBase_V1.build_connector_worker_meta"),
)
SCHEDULER_UPDATE_FROM_OUTPUT = (
    _site(">=0.19", "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output"),
)
SCHEDULER_INVALID_BLOCKS = (
    _site(">=0.19", "vllm.v1.core.sched.scheduler", "Scheduler._handle_invalid_blocks"),
)
UPDATE_WAITING_FOR_REMOTE_KV = (
    _site(">=0.19", "vllm.v1.core.sched.scheduler", "Scheduler._update_waiting_for_remote_kv"),
)
KV_XFER_FINISHED = (
    _site(">=0.19", "vllm.v1.core.sched.scheduler", "Scheduler._update_from_kv_xfer_finished"),
)
WORKER_META_CALLER = (
    _site(">=0.22", "vllm.v1.worker.kv_connector_model_runner_mixin",
          "KVConnectorModelRunnerMixin._get_kv_connector_output"),
)


def fail_unread(worker: Any, req_id: str, version: Version) -> None:
    """Fail a request whose READ was never posted, as the release fails a request it declines
    before reading (0.26+: an expired readback; its transport-failure counter untouched where
    it has the flag, 0.31+); raises :class:`FailureNotRecordable` where it cannot (HMA before
    0.30)."""
    style = recv_failure_style(version)
    if style == "deferred":
        if release_of(version) < FAILED_TRANSFER_FLAG_FROM:
            worker._handle_failed_transfer(req_id, None, worker._recv_failures)
        else:
            worker._handle_failed_transfer(req_id, None, worker._recv_failures,
                                           record_failed_transfer=False)
        return
    record_recv_failure(worker, req_id, version)


# ---------------------------------------------------------------- block_ids_bound, params_check

# 0.34 pairs D's blocks with a peer's of another size (a block-size ratio, or other physical
# blocks per logical block: 0.34.0 pull_worker.py L179-183) from P's last token:
# `_pair_blocks_by_last_token` (base_worker.py L3683-3727) drops each side's sub-blocks past token
# `remote_num_tokens` (`RemoteMeta.num_tokens`, metadata.py L242, L347) and pairs the lists from
# their ends (pull_worker.py L311-333); without that count the read is declined (L188-205).  Up
# to 0.33 such blocks pair by position (`_map_block_ids_for_block_size_ratio`, 0.33.0
# pull_worker.py L435).
PAIRS_BY_LAST_TOKEN_FROM = Version("0.34")
# 0.34 pairs regions by layer name and reads region by region where the two sides put a layer
# in different cache groups: `not _dst_pairs[engine_id].groups_match` (0.34.0 pull_worker.py
# L217, L233; base_worker.py L132-157, L550-605).  0.33 compares `dst_region_group_ids` with
# `region_group_ids` (0.33.0 pull_worker.py).
REGION_READ_BY_GROUPS_MATCH_FROM = Version("0.34")

# Optional `kv_transfer_params` fields of a remote prefill that a decode engine's NIXL code
# reads, from the release that first reads each (params_check validates a field only where the
# running release reads it).  `tp_size`: `ReqMeta.tp_size` (0.19.1 nixl_connector.py; 0.34.0
# metadata.py L308), the peer's TP in the handshake; `pp_size`: 0.26.0 metadata.py, 0.34.0 L311,
# the handshake's PP ranks (base_worker.py L1535) and the heartbeat (base_scheduler.py L219);
# `dcp_size`: 0.29.0 metadata.py, 0.34.0 L309, base_worker.py L1534, base_scheduler.py L218;
# `remote_blocks_expiry_time`: 0.26.0 metadata.py, 0.34.0 L346 (the turn-2 expiry, pull_worker.py
# L130-136); `remote_num_tokens`: 0.30.0 metadata.py L330, 0.34.0 L347 (0.33's region-mapped
# reads, 0.34's pairing: a non-integer raises TypeError in `_pair_blocks_by_last_token`);
# `remote_registration_generation`: 0.33.0 metadata.py L343, 0.34.0 L348-350, compared with
# an int at pull_worker.py L147.  No release reads `remote_tp_size`, `remote_dcp_size` or
# `remote_pp_size` from them (the push scheduler's `remote_tp_size`/`remote_pp_size` are keys of
# its own registration message, built from `tp_size`/`pp_size`: 0.34.0 push_scheduler.py
# L187-188).  (Specs as strings: parsed when asked, not inside every `import vllm`.)
RECV_PARAMS_READ = (
    ("tp_size", ">=0.19"),
    ("pp_size", ">=0.26"),
    ("dcp_size", ">=0.29"),
    ("remote_blocks_expiry_time", ">=0.26"),
    ("remote_num_tokens", ">=0.30"),
    ("remote_registration_generation", ">=0.33"),
)


def recv_params_read(version: Version) -> frozenset[str]:
    """The optional remote-prefill fields of :data:`RECV_PARAMS_READ` that ``version`` reads."""
    return frozenset(name for name, since in RECV_PARAMS_READ if version in VersionRange(since))
