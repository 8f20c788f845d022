"""KV geometry and descriptor planning for peers whose K/V layouts differ.

Pure core (numpy only; no torch, no vLLM): :mod:`geometry` (the model), :mod:`infer` (from
tensor strides), :mod:`plan` (descriptor pairs and vLLM-ordered tables).  :mod:`staging` (torch,
no vLLM) stages a converted peer's READs inside a worker; its :mod:`staging.plans` are the pure
(numpy) pieces of a staged READ.  Planning that only tests and benches use (coalescing, NIXL
strided rows, vLLM-form descriptor lists) is lab code: ``lab/kv_reference.py``.

Wiring into vLLM (the PDPATCH_KV_SEGMENTS patch):

* ``register_kv_caches``: ``local = infer_geometry([tensor_info(t) for t in caches],
  num_blocks=worker.num_blocks)``; advertise ``local.to_wire()`` as an extra handshake field.
* handshake: ``kind = handshake_kind(len(meta.kv_caches_base_addr), num_layers,
  advertised=...)``; if ``not needs_conversion(local, kind)`` call stock code unchanged.
  Otherwise ``remote = geometry_from_handshake(meta.kv_caches_base_addr, meta.block_lens,
  meta.num_blocks, num_layers=..., advertised=...)`` and return ``as_tuples(PairPlan(local,
  remote, remote_slice=HeadSlice(tp_ratio, plan.rank_offset_factor),
  block_size_ratio=r).remote_table())`` from ``_build_fa_remote`` (same count and order as
  stock, so desc ids and the per-request path stay untouched).  :class:`GeometryMismatch`
  raised there fails only that peer's requests.
"""

from pdpatch.kv.geometry import (
    KIND_FUSED,
    KIND_PACKED,
    KIND_SPLIT,
    ROLE_K,
    ROLE_KV,
    ROLE_V,
    BlockIdError,
    GeometryMismatch,
    HeadOrderMismatch,
    KVGeometry,
    KVPlanError,
    LayerGeometry,
    Segment,
    UnsupportedLayout,
    geometry_from_handshake,
    handshake_kind,
    needs_conversion,
)
from pdpatch.kv.infer import infer_geometry, infer_layer_geometry, tensor_info
from pdpatch.kv.plan import (
    DescPlan,
    HeadSlice,
    PairPlan,
    Slices,
    as_tuples,
    plan_transfer,
    slices_for,
)

__all__ = [
    "KIND_FUSED",
    "KIND_PACKED",
    "KIND_SPLIT",
    "ROLE_K",
    "ROLE_KV",
    "ROLE_V",
    "BlockIdError",
    "DescPlan",
    "GeometryMismatch",
    "HeadOrderMismatch",
    "HeadSlice",
    "KVGeometry",
    "KVPlanError",
    "LayerGeometry",
    "PairPlan",
    "Segment",
    "Slices",
    "UnsupportedLayout",
    "as_tuples",
    "geometry_from_handshake",
    "handshake_kind",
    "infer_geometry",
    "infer_layer_geometry",
    "needs_conversion",
    "plan_transfer",
    "slices_for",
    "tensor_info",
]
