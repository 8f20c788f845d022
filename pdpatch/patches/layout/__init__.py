"""Patch ``layout``: NixlConnector asks for a token-major KV layout where kvcached allocates.

Why: NixlConnector asks for the head-major layout (``HND``; ``LBHNC`` from vLLM 0.29) for faster
transfers, and vLLM then re-strides the KV tensors -- which kvcached's ``from_blob`` views over
CUDA virtual memory cannot be.  Where kvcached runs in this deployment (its ``init_kvcached`` ran
in this process, :mod:`pdpatch.kvcached`) or the operator forces it, the connector's answer
becomes the release's token-major name instead: ``NHD`` up to 0.28, ``LBNHC`` from 0.29.

Why return the name rather than ``None``: ``None`` also ends at token-major with most backends
(0.19-0.28 ``get_kv_connector_cache_layout`` defaults to ``NHD``; 0.29+ takes the first
candidate, ``LBNHC`` for most CUDA backends), but an explicit name (a) wins over a backend whose
preference merely *lists* a head-major layout first, and (b) makes ``MultiConnector`` report a
sibling that insists on head-major instead of silently taking the sibling's answer.

Where it acts: up to 0.28 the classmethod is consulted lazily in each worker process (through the
lru_cached ``get_kv_cache_layout``); from 0.29 once, in EngineCore, by ``resolve_kv_cache_layout``.
Both resolvers are wrapped too: when the override is
active and the layout in force is still head-major (an attention backend that supports only
head-major, a ``MultiConnector`` sibling, ``VLLM_KV_CACHE_LAYOUT``, a preset
``cache_config.kv_cache_layout``), startup fails with a message naming the component and what to
change, instead of kvcached crashing later on a tensor it cannot re-stride.

A decode engine whose layout the override made token-major also turns on vLLM's own
``enable_permute_local_kv`` in its NIXL workers (:func:`let_decode_reorder`): stock prefill
engines stay head-major, and the release then accepts them and reorders their blocks after
receive instead of refusing every request.

On 0.19 (no upstream guard) a handshake that would split heads across heterogeneous TP on a
token-major layout is rejected: 0.19 slices a token-major block as if it were head-major and
corrupts data silently.  vLLM 0.20 added the same check.

Through 0.34 (0.34.0 paths under ``distributed/kv_transfer/kv_connector/``): NixlConnector still
asks for head-major (``v1/nixl/connector.py`` L163-181, ``return "LBHNC"``), resolved in
EngineCore (``v1/attention/backends/utils.py`` L311, imported by ``v1/engine/core.py``); a
token-major decode worker still refuses a head-major peer unless ``enable_permute_local_kv`` is
set (``v1/nixl/base_worker.py`` L2857-2877), and its reorder,
``kv_postprocess_blksize_and_layout_on_receive`` (``utils.py`` L298-320), is 0.33's
byte for byte (it reads memory order), called for every block-size ratio with the flag on
(base_worker.py L3169-3173).  What changed is who triggers the override: kvcached 0.1.6 refuses
vLLM 0.31+ at ``EngineCore.__init__`` (:mod:`pdpatch.kvcached`), so from 0.31 only
``PDPATCH_LAYOUT_FORCE`` does; vLLM 0.34's own extensible KV cache builds its views in whatever
layout was resolved, so it needs nothing here.

Settings: toggle ``PDPATCH_LAYOUT``; per deployment ``kv_connector_extra_config["pdpatch"]``
``{"layout": false}`` switches it off, ``{"layout_force": true}`` forces token-major without
kvcached (``PDPATCH_LAYOUT_FORCE=1`` does the same), ``{"layout_permute": false}`` (or
``PDPATCH_LAYOUT_PERMUTE=0``) leaves ``enable_permute_local_kv`` as configured.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from

NAME = "layout"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    out: list[Target] = []
    site = vllm_sites.lookup(vllm_sites.REQUIRED_KV_LAYOUT, version)
    if site is not None:
        out.append(Target(site.module, site.qualname, _code("required_layout")))
    for s in vllm_sites.LAYOUT_RESOLVERS:
        if s.matches(version):
            wrapper = "get_layout_checked" if s.qualname == "get_kv_cache_layout" \
                else "resolve_checked"
            out.append(Target(s.module, s.qualname, _code(wrapper)))
    site = vllm_sites.lookup(vllm_sites.REGISTER_KV_CACHES, version)
    if site is not None:
        out.append(Target(site.module, site.qualname, _code("let_decode_reorder")))
    for sites in (vllm_sites.RECEIVE_PERMUTE, vllm_sites.RECEIVE_PERMUTE_BLOCK_RATIO):
        site = vllm_sites.lookup(sites, version)
        if site is not None:
            out.append(Target(site.module, site.qualname, _code("reorder_in_memory_order")))
    site = vllm_sites.lookup(vllm_sites.VALIDATE_HANDSHAKE, version)
    if site is not None and not vllm_sites.checks_hetero_tp_layout(version):
        out.append(Target(site.module, site.qualname, _code("hetero_tp_guard")))
    if site is not None and version in vllm_sites.BLOCKS_FIRST_RATIO_OVERRUN:
        out.append(Target(site.module, site.qualname, _code("blocks_first_ratio_guard")))
    return out


PATCH = Patch(
    name=NAME,
    summary="token-major KV layout for NixlConnector where kvcached allocates (or forced), "
            "verified after resolution; 0.19 hetero-TP head-split guard",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.CONNECTOR_LAYOUT_LOOKUP, vllm_sites.RESOLVED_LAYOUT,
               vllm_sites.VALIDATE_HANDSHAKE, vllm_sites.RECEIVE_POSTPROCESS,
               vllm_sites.RECEIVE_PERMUTE_MEMORY_ORDER),
    state=_code("LayoutState"),
    runtime_status=_code("status_line"),
)
