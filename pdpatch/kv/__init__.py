"""KV geometry and descriptor planning for peers whose K/V layouts differ (issue 6).

Pure core (numpy only; no torch, no vLLM): :mod:`geometry` (the model), :mod:`infer` (from
tensor strides), :mod:`plan` (descriptor pairs and vLLM-ordered tables), :mod:`coalesce`
(merged ranges, NIXL strided rows).
"""

from pdpatch.kv.coalesce import (
    coalesce,
    expand_strided,
    plan_from_nx3,
    strided_pair_rows,
    strided_rows,
)
from pdpatch.kv.geometry import (
    KIND_FUSED,
    KIND_PACKED,
    KIND_SPLIT,
    ROLE_K,
    ROLE_KV,
    ROLE_V,
    BlockIdError,
    GeometryMismatch,
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
    as_tuples,
    plan_transfer,
    vllm_local_descs,
    vllm_remote_descs,
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
    "HeadSlice",
    "KVGeometry",
    "KVPlanError",
    "LayerGeometry",
    "PairPlan",
    "Segment",
    "UnsupportedLayout",
    "as_tuples",
    "coalesce",
    "expand_strided",
    "geometry_from_handshake",
    "handshake_kind",
    "infer_geometry",
    "infer_layer_geometry",
    "needs_conversion",
    "plan_from_nx3",
    "plan_transfer",
    "strided_pair_rows",
    "strided_rows",
    "tensor_info",
    "vllm_local_descs",
    "vllm_remote_descs",
]
