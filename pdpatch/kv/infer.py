"""Infer a layer's KV geometry from a tensor's shape, STRIDES, element size and address.

Why strides: the logical shape says which dimension is blocks and which is K/V, but not
where the bytes are.  kvcached's split-half tensors have vLLM's blocks-first logical shape
``(N, 2, bs, H, D)`` yet keep K and V half a pool apart; reading them by shape alone is the
bug this module exists to avoid.  The caller passes plain values
(``t.shape, t.stride(), t.element_size(), t.data_ptr()``), so this module needs no torch.

Recognised (element strides; ``seg`` = one K or V block's bytes):

* 5-D ``(2, N, bs, H, D)`` -- FlashAttention <= 0.22: K/V dim first, K and V regions apart;
* 5-D ``(N, 2, bs, H, D)`` with ``stride[0] == 2*stride[1]`` -- blocks-first fused ``[K|V]``
  (FlashInfer, FA 0.23-0.25, kvcached contiguous per layer);
* 5-D ``(N, 2, bs, H, D)`` with ``stride[1]`` >= the whole K pool -- kvcached split-half;
* 4-D ``(N, H, bs, 2D)`` -- vLLM >= 0.26 packed K|V per token (one segment per block);
* any of the above over-allocated (capacity > planned ``num_blocks``), with padded blocks,
  or with a cross-layer block stride (BL* / kvcached block-outer layouts).

Inside a K/V segment, ``(bs, H, D)`` may be token-major (NHD) or head-major (HND); ``D`` must be
innermost and the segment dense.  Anything else raises :class:`UnsupportedLayout`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdpatch.kv.geometry import (
    ROLE_K,
    ROLE_KV,
    ROLE_V,
    KVGeometry,
    LayerGeometry,
    Segment,
    UnsupportedLayout,
)

TensorInfo = tuple[Sequence[int], Sequence[int], int, int]
"""``(shape, stride, element_size, data_ptr)`` of one layer's KV tensor."""


def _dense_inner(shape: Sequence[int], stride: Sequence[int], dims: Sequence[int],
                 what: str) -> bool | None:
    """Check that ``dims`` (the last one innermost with stride 1) tile one dense segment.

    Returns whether the heads dim is outside the tokens dim (head-major, HND: head slices are
    contiguous), or None when one of them has size 1 -- then both orders are the same bytes
    and any head slice is contiguous.
    """
    heads_dim, tokens_dim, content_dim = dims
    if shape[content_dim] > 1 and stride[content_dim] != 1:
        raise UnsupportedLayout(
            f"{what}: the innermost (head_dim) stride must be 1, got {stride[content_dim]} "
            f"(shape {tuple(shape)}, stride {tuple(stride)})"
        )
    expect = shape[content_dim]
    outer = [d for d in (heads_dim, tokens_dim) if shape[d] > 1]
    outer.sort(key=lambda d: stride[d])
    for d in outer:
        if stride[d] != expect:
            raise UnsupportedLayout(
                f"{what}: a block's segment is not dense -- dim {d} has stride {stride[d]}, "
                f"expected {expect} (shape {tuple(shape)}, stride {tuple(stride)})"
            )
        expect *= shape[d]
    if shape[heads_dim] == 1 or shape[tokens_dim] == 1:
        return None
    return stride[heads_dim] > stride[tokens_dim]


def infer_layer_geometry(
    shape: Sequence[int],
    stride: Sequence[int],
    element_size: int,
    data_ptr: int,
    *,
    num_blocks: int | None = None,
    kv_dim: int | None = None,
    heads_dim: int = 1,
    heads_dim_5d: int = 3,
) -> LayerGeometry:
    """One layer's :class:`LayerGeometry` from tensor metadata (see module docstring).

    ``num_blocks``: the planned blocks when the tensor is over-allocated (default: all).
    ``kv_dim``: 0 for ``(2, N, ...)``, 1 for ``(N, 2, ...)``; needed only when both leading
    dims are 2.  ``heads_dim``: for 4-D packed tensors, 1 for ``(N, H, bs, C)``, 2 for
    ``(N, bs, H, C)``.  ``heads_dim_5d``: for 5-D tensors, 3 for ``(.., bs, H, D)``
    (FlashAttention, FlashInfer, Triton), 2 for ``(.., H, bs, D)`` (vLLM's CPU backend up to
    0.22) -- the logical order of a backend's ``get_kv_cache_shape``, which the physical
    (stride) order need not follow.
    """
    shape = tuple(int(x) for x in shape)
    stride = tuple(int(x) for x in stride)
    es = int(element_size)
    where = f"KV tensor shape {shape} stride {stride}"
    if es <= 0:
        raise UnsupportedLayout(f"{where}: element size must be > 0, got {es}")
    if len(shape) != len(stride):
        raise UnsupportedLayout(f"{where}: shape and stride lengths differ")
    if any(s < 0 for s in stride):
        raise UnsupportedLayout(f"{where}: negative strides are not supported")

    if len(shape) == 5:
        if kv_dim is None:
            cands = [d for d in (0, 1) if shape[d] == 2]
            if not cands:
                raise UnsupportedLayout(f"{where}: neither dim 0 nor dim 1 is the K/V dim (size 2)")
            if len(cands) == 2:
                raise UnsupportedLayout(
                    f"{where}: both leading dims have size 2, so the K/V dim is ambiguous; "
                    "pass kv_dim=0 for (2, N, ...) or kv_dim=1 for (N, 2, ...)"
                )
            kv_dim = cands[0]
        if kv_dim not in (0, 1) or shape[kv_dim] != 2:
            raise UnsupportedLayout(f"{where}: kv_dim={kv_dim} is not a size-2 leading dim")
        block_dim = 1 - kv_dim
        if heads_dim_5d not in (2, 3):
            raise UnsupportedLayout(f"{where}: heads_dim_5d must be 2 or 3, got {heads_dim_5d}")
        head_major = _dense_inner(shape, stride, (heads_dim_5d, 5 - heads_dim_5d, 4), where)
        seg_len = shape[2] * shape[3] * shape[4] * es
        capacity = shape[block_dim]
        block_stride = stride[block_dim] * es
        if capacity == 1 and block_stride < seg_len:
            block_stride = seg_len  # a size-1 dim's stride is meaningless
        v_off = stride[kv_dim] * es
        if v_off == 0:
            raise UnsupportedLayout(f"{where}: K and V share memory (K/V stride 0)")
        segments = (Segment(ROLE_K, 0, seg_len), Segment(ROLE_V, v_off, seg_len))
        num_heads = shape[heads_dim_5d]
    elif len(shape) == 4:
        if heads_dim not in (1, 2):
            raise UnsupportedLayout(f"{where}: heads_dim must be 1 or 2, got {heads_dim}")
        tokens_dim = 3 - heads_dim
        head_major = _dense_inner(shape, stride, (heads_dim, tokens_dim, 3), where)
        seg_len = shape[1] * shape[2] * shape[3] * es
        capacity = shape[0]
        block_stride = stride[0] * es
        if capacity == 1 and block_stride < seg_len:
            block_stride = seg_len
        segments = (Segment(ROLE_KV, 0, seg_len),)
        num_heads = shape[heads_dim]
    else:
        raise UnsupportedLayout(
            f"{where}: expected a 5-D (2, N, bs, H, D) / (N, 2, bs, H, D) or a 4-D packed "
            "(N, H, bs, 2D) tensor"
        )
    if block_stride <= 0:
        raise UnsupportedLayout(f"{where}: block stride must be > 0")
    planned = capacity if num_blocks is None else int(num_blocks)
    if planned > capacity:
        raise UnsupportedLayout(
            f"{where}: {planned} planned blocks but the tensor holds only {capacity}"
        )
    try:
        return LayerGeometry(int(data_ptr), block_stride, planned, segments,
                             num_heads, head_major, capacity)
    except UnsupportedLayout as e:
        raise UnsupportedLayout(f"{where}: {e}") from None


def infer_geometry(
    tensors: Sequence[TensorInfo],
    *,
    num_blocks: int | None = None,
    kv_dim: int | None = None,
    heads_dim: int = 1,
    heads_dim_5d: int = 3,
    device_id: int = 0,
    label: str = "",
    names: Sequence[str] | None = None,
) -> KVGeometry:
    """A worker's :class:`KVGeometry` from its per-layer tensors, in layer order (``names``:
    the layers' names, in the same order)."""
    layers = tuple(
        infer_layer_geometry(shape, stride, es, ptr, num_blocks=num_blocks, kv_dim=kv_dim,
                             heads_dim=heads_dim, heads_dim_5d=heads_dim_5d)
        for shape, stride, es, ptr in tensors
    )
    return KVGeometry(layers, device_id, label, None if names is None else tuple(names))


def tensor_info(t: object) -> TensorInfo:
    """``(shape, stride, element_size, data_ptr)`` of a torch tensor, read by duck typing."""
    return (tuple(t.shape), tuple(t.stride()), int(t.element_size()), int(t.data_ptr()))  # type: ignore[attr-defined]
