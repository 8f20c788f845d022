"""The local worker's true K/V geometry, from its registered tensors, added to its encoded
handshake metadata as the optional field :data:`FIELD` (every stock decoder drops it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.log import logger
from pdpatch.patches.kv_segments.settings import FIELD, allowed, coalesce
from pdpatch.patches.kv_segments.staged_reads import install_staging
from pdpatch.patches.kv_segments.state import count, existing_worker_state, worker_state
from pdpatch.registry import Wrapper

if TYPE_CHECKING:
    from pdpatch.kv import KVGeometry


def _probe_heads_dims(worker: Any) -> dict[str, int]:
    """Where the backend's ``get_kv_cache_shape`` puts the heads dimension (its logical order;
    vLLM's CPU backend up to 0.22 is ``(2, N, H, bs, D)``, FlashAttention ``(2, N, bs, H, D)``)."""
    backends = getattr(worker, "attn_backends", None) or []
    shape_fn = getattr(backends[0], "get_kv_cache_shape", None) if backends else None
    if shape_fn is None:
        return {}
    try:
        shape = tuple(shape_fn(num_blocks=5, block_size=16, num_kv_heads=3, head_size=64))
    except Exception:
        return {}
    if shape.count(3) != 1:
        return {}
    dim = shape.index(3)
    if len(shape) == 5 and dim in (2, 3):
        return {"heads_dim_5d": dim}
    if len(shape) == 4 and dim in (1, 2):
        return {"heads_dim": dim}
    return {}


def local_geometry(worker: Any, kv_caches: Mapping[str, Any]) -> KVGeometry | None:
    """The worker's registered KV memory as :class:`KVGeometry` (from strides), or None where
    pdpatch does not model it (MLA, Mamba, shared or non-tensor caches)."""
    from pdpatch.kv import infer_geometry, tensor_info

    if getattr(worker, "use_mla", False) or getattr(worker, "_has_mamba", False):
        return None
    if getattr(worker, "use_host_buffer", False):
        kv_caches = getattr(worker, "host_xfer_buffers", None) or {}
    if not isinstance(kv_caches, Mapping):
        return None
    tensors = list(kv_caches.values())
    if not tensors or not all(hasattr(t, "stride") and hasattr(t, "data_ptr") and
                              len(getattr(t, "shape", ())) in (4, 5) for t in tensors):
        return None
    if len({t.data_ptr() for t in tensors}) != len(tensors):
        return None          # layers sharing one tensor (HMA pools): regions != layers
    return infer_geometry(
        [tensor_info(t) for t in tensors], num_blocks=int(worker.num_blocks),
        device_id=int(getattr(worker, "device_id", 0) or 0),
        label=f"engine {getattr(worker, 'engine_id', '?')} rank {getattr(worker, 'tp_rank', 0)}",
        names=[str(name) for name in kv_caches], **_probe_heads_dims(worker))


def _set_advertised(worker: Any, geometry: KVGeometry) -> None:
    """Add the geometry to the already-encoded handshake metadata (a msgpack map)."""
    import msgspec

    payload = getattr(worker, "xfer_handshake_metadata", None)
    raw = getattr(payload, "agent_metadata_bytes", None)
    if raw is None:
        return
    meta = msgspec.msgpack.decode(raw)
    if not isinstance(meta, dict):
        return
    meta[FIELD] = geometry.to_wire()
    payload.agent_metadata_bytes = msgspec.msgpack.encode(meta)


def _advertise(instance: Any, kv_caches: Any) -> None:
    from pdpatch.kv import KVPlanError

    geometry = None
    try:
        geometry = local_geometry(instance, kv_caches)
        if geometry is not None:
            _set_advertised(instance, geometry)
    except KVPlanError as exc:
        logger.info("pdpatch kv_segments: local KV geometry not advertised: %s", exc)
        geometry = None
    except Exception as exc:  # the advertisement is optional: never fail registration for it
        logger.warning("pdpatch kv_segments: local KV geometry not advertised (%s: %s)",
                       type(exc).__name__, exc)
        geometry = None
    worker_state(instance).geometry = geometry
    if geometry is not None:
        count("advertised")
        logger.debug("pdpatch kv_segments: advertising %s", geometry.describe())


def make_register_wrapper(version: Version) -> Wrapper:
    """``register_kv_caches``: the staging agent goes in front before vLLM prepares its local
    lists (it must see them prepared) where a peer may be converted (0.19-0.25) or same-layout
    peers are coalesced (``PDPATCH_KV_COALESCE``); the geometry is advertised after vLLM
    encoded them."""
    converts = version in vllm_sites.KV_SPLIT_DESCRIPTORS

    def register_kv_caches(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        kv_caches = args[0] if args else kwargs.get("kv_caches")
        if (converts or coalesce()) and allowed(instance):
            install_staging(instance, kv_caches)
        result = wrapped(*args, **kwargs)
        if allowed(instance):
            _advertise(instance, kv_caches)
        return result

    return register_kv_caches


def restore_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """0.33+ re-encode the metadata through the stock class on wake-up (0.34.0 base_worker.py
    L2046-2052, as 0.33's): advertise again."""
    result = wrapped(*args, **kwargs)
    state = existing_worker_state(instance)
    geometry = state.geometry if state is not None else None
    if geometry is not None and allowed(instance):
        _set_advertised(instance, geometry)
    return result
