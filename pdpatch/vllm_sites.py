"""Where each vLLM concept pdpatch touches lives, per release: the one place for version facts.

Patches ask this module "where is the worker's read path in vLLM X?" instead of carrying
``if version`` branches.  Facts come from reading each release's source (see
``shared/research/vllm_nixl_patch_points.md`` §1 and §9, re-checked against the wheels).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pdpatch.versions import release_of

KVC = "vllm.distributed.kv_transfer.kv_connector"
NIXL_PKG = f"{KVC}.v1.nixl"
NIXL_SINGLE_FILE = f"{KVC}.v1.nixl_connector"      # 0.19 only


@dataclass(frozen=True)
class Site:
    versions: SpecifierSet
    module: str
    qualname: str

    def matches(self, version: Version) -> bool:
        return self.versions.contains(release_of(version), prereleases=True)


def _site(spec: str, module: str, qualname: str) -> Site:
    return Site(SpecifierSet(spec), module, qualname)


def lookup(sites: tuple[Site, ...], version: Version) -> Site | None:
    return next((s for s in sites if s.matches(version)), None)


# The pull-mode read path (a request's KV load from a remote engine).
READ_BLOCKS_FOR_REQ = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlConnectorWorker._read_blocks_for_req"),
    _site(">=0.20,<0.24", f"{NIXL_PKG}.worker", "NixlConnectorWorker._read_blocks_for_req"),
    _site(">=0.24", f"{NIXL_PKG}.pull_worker", "NixlPullConnectorWorker._read_blocks_for_req"),
)


# The connector classmethod that asks for a KV-cache layout, on the class that defines it
# (>=0.24 `NixlConnector` is only an alias of `NixlPullConnector`; the push connector inherits
# from `NixlBaseConnector` too).  Returns "HND" up to 0.28, "LBHNC" from 0.29.
REQUIRED_KV_LAYOUT = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlConnector.get_required_kvcache_layout"),
    _site(">=0.20,<0.24", f"{NIXL_PKG}.connector", "NixlConnector.get_required_kvcache_layout"),
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
REGISTER_KV_CACHES = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlConnectorWorker.register_kv_caches"),
    _site(">=0.20,<0.24", f"{NIXL_PKG}.worker", "NixlConnectorWorker.register_kv_caches"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlBaseConnectorWorker.register_kv_caches"),
)

# Handshake validation; 0.19 lacks the heterogeneous-TP head-contiguity guard added in 0.20.
VALIDATE_HANDSHAKE = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE,
          "NixlConnectorWorker._validate_remote_agent_handshake"),
    _site(">=0.20,<0.24", f"{NIXL_PKG}.worker",
          "NixlConnectorWorker._validate_remote_agent_handshake"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker",
          "NixlBaseConnectorWorker._validate_remote_agent_handshake"),
)

# Module whose global `NixlWrapper` the worker instantiates (vLLM's tests patch it there).
NIXL_WRAPPER_HOME = (
    _site(">=0.19,<0.20", NIXL_SINGLE_FILE, "NixlWrapper"),
    _site(">=0.20,<0.24", f"{NIXL_PKG}.worker", "NixlWrapper"),
    _site(">=0.24", f"{NIXL_PKG}.base_worker", "NixlWrapper"),
)


def layout_names(version: Version) -> tuple[str, str]:
    """(token-major, head-major) layout names of a release: NHD/HND up to 0.28, the 5-D names
    of RFC #42082 (LBNHC/LBHNC) from 0.29."""
    if release_of(version) >= Version("0.29"):
        return "LBNHC", "LBHNC"
    return "NHD", "HND"


def record_recv_failure(worker: object, req_id: str) -> None:
    """Fail one request's KV load the way the running release itself records such failures.

    vLLM ≥0.24 routes failures through ``_handle_failed_transfer`` (what
    ``_read_blocks_for_req`` does for an invalid remote engine); the scheduler then reports the
    request's blocks as invalid and recomputes or fails it.  Older releases keep a plain set.
    """
    handler = getattr(worker, "_handle_failed_transfer", None)
    failures = getattr(worker, "_recv_failures", None)
    if handler is not None and failures is not None:
        handler(req_id, None, failures)
        return
    failed = getattr(worker, "_failed_recv_reqs", None)
    if failed is None:
        raise AttributeError("this vLLM release has no known KV-load failure bookkeeping")
    if hasattr(failed, "put_nowait"):
        failed.put_nowait(req_id)
    else:
        failed.add(req_id)
