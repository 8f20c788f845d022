"""KV geometry inference from strides (pdpatch.kv.geometry / pdpatch.kv.infer)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kv_helpers import LayoutSpec, build_side

from pdpatch.kv import (
    KIND_FUSED,
    KIND_PACKED,
    KIND_SPLIT,
    GeometryMismatch,
    KVGeometry,
    LayerGeometry,
    Segment,
    UnsupportedLayout,
    geometry_from_handshake,
    infer_geometry,
    infer_layer_geometry,
    tensor_info,
)

L, N, BS, H, D, ES = 2, 6, 4, 2, 8, 2
SEG = BS * H * D * ES


def _infer(spec: LayoutSpec, num_blocks: int | None = N):
    side = build_side(spec, L, N, BS, H, D, ES)
    return side, infer_geometry(side.infos, num_blocks=num_blocks, kv_dim=side.kv_dim)


def test_fa_split_two_regions() -> None:
    side, g = _infer(LayoutSpec("fa_split"))
    la = g.layers[0]
    assert g.kind == KIND_SPLIT
    assert la.block_stride == SEG
    assert [(s.role, s.offset, s.length) for s in la.segments] == [
        ("K", 0, SEG), ("V", N * SEG, SEG)]
    assert la.head_major is True and la.num_heads == H
    # the address of V of block 3 is where numpy puts it
    v3 = side.tensors[0][1, 3]
    assert la.segment_addr(1, 3) == v3.__array_interface__["data"][0] - side.buf.ctypes.data


def test_fused_blocks_first() -> None:
    _, g = _infer(LayoutSpec("fused", head_major=False))
    la = g.layers[1]
    assert g.kind == KIND_FUSED
    assert la.block_stride == 2 * SEG
    assert [(s.offset, s.length) for s in la.segments] == [(0, SEG), (SEG, SEG)]
    assert la.head_major is False


def test_kvcached_split_half_is_not_read_as_fused() -> None:
    """Same logical shape as FlashInfer's (N, 2, bs, H, D); the strides say split."""
    spec = LayoutSpec("split_half", overalloc=5, kv_gap=40)
    side, g = _infer(spec)
    fused_side = build_side(LayoutSpec("fused"), L, N, BS, H, D, ES)
    assert side.tensors[0].shape[1:] == fused_side.tensors[0].shape[1:]  # shape-identical
    la = g.layers[0]
    assert g.kind == KIND_SPLIT
    assert la.block_stride == SEG
    assert la.segments[1].offset == (N + 5) * SEG + 40 * ES
    assert la.num_blocks == N and la.capacity == N + 5


def test_packed_and_cross_layer() -> None:
    _, g = _infer(LayoutSpec("packed"))
    assert g.kind == KIND_PACKED and g.layers[0].block_stride == 2 * SEG
    assert g.layers[0].segments == (Segment("KV", 0, 2 * SEG),)
    _, g = _infer(LayoutSpec("packed", cross_layer=True))
    assert g.layers[0].block_stride == L * 2 * SEG
    assert g.layers[1].base - g.layers[0].base == 2 * SEG
    _, g = _infer(LayoutSpec("fused", cross_layer=True, block_pad=8))
    assert g.kind == KIND_FUSED and g.layers[0].block_stride == L * (2 * SEG + 8 * ES)


def test_over_allocated_view() -> None:
    _, g = _infer(LayoutSpec("fa_split", overalloc=10), num_blocks=N)
    assert g.num_blocks == N and g.layers[0].capacity == N + 10
    assert g.layers[0].segments[1].offset == (N + 10) * SEG
    with pytest.raises(UnsupportedLayout, match="planned blocks"):
        _infer(LayoutSpec("fa_split"), num_blocks=N + 1)


def test_registration_ranges_cover_only_planned_blocks() -> None:
    _, g = _infer(LayoutSpec("split_half", overalloc=10, layer_gap=100))
    ranges = g.registration_ranges()
    assert len(ranges) == 2 * L  # K pool and V pool of each layer
    la = g.layers[0]
    assert ranges[0] == (la.base, la.base + N * SEG)
    _, g = _infer(LayoutSpec("fused", cross_layer=True))
    assert len(g.registration_ranges()) == 1


def test_read_ranges_never_cross_a_registration() -> None:
    """A fused layer is one range; a split layer's K and V pools stay two even when adjacent
    (vLLM registers them apart), and so do adjacent layers; layers interleaved per block
    share one range."""
    _, g = _infer(LayoutSpec("fa_split"))       # K pool directly followed by the V pool
    la = g.layers[0]
    assert la.extents()[0][1] == la.extents()[1][0]
    assert g.read_ranges() == sorted(r for layer in g.layers for r in layer.extents())
    _, g = _infer(LayoutSpec("fused"))          # layers back to back
    assert len(g.registration_ranges()) == 1
    assert g.read_ranges() == [(la.base + la.segments[0].offset,
                                la.base + (la.num_blocks - 1) * la.block_stride
                                + la.segments[1].offset + la.segments[1].length)
                               for la in g.layers]
    _, g = _infer(LayoutSpec("fused", cross_layer=True))
    assert g.read_ranges() == g.registration_ranges() and len(g.read_ranges()) == 1


def test_ambiguous_leading_dims_need_kv_dim() -> None:
    side = build_side(LayoutSpec("fused"), 1, 2, BS, H, D, ES)  # shape (2, 2, ...)
    shape, stride, es, ptr = side.infos[0]
    with pytest.raises(UnsupportedLayout, match="ambiguous"):
        infer_layer_geometry(shape, stride, es, ptr)
    assert infer_layer_geometry(shape, stride, es, ptr, kv_dim=1).kind == KIND_FUSED
    # the same strides read with kv_dim=0 are a split (2, N) tensor: different bytes
    assert infer_layer_geometry(shape, stride, es, ptr, kv_dim=0).kind == KIND_SPLIT


@pytest.mark.parametrize(
    ("shape", "stride", "match"),
    [
        ((2, 4, 4, 2, 8), (256, 64, 16, 8, 2), "innermost"),  # head_dim not stride 1
        ((2, 4, 4, 2, 8), (512, 128, 16, 64, 1), "not dense"),  # a hole inside a block
        ((4, 2, 4, 2, 8), (64, 32, 16, 8, 1), "overlap"),  # V overlaps the next K
        ((4, 2, 4, 2, 8), (128, 0, 16, 8, 1), "share memory"),
        ((4, 4, 8), (32, 8, 1), "expected a 5-D"),
        ((3, 4, 4, 2, 8), (256, 64, 16, 8, 1), "K/V dim"),
    ],
)
def test_unknown_strides_fail_clearly(shape, stride, match) -> None:
    with pytest.raises(UnsupportedLayout, match=match):
        infer_layer_geometry(shape, stride, 2, 4096)


def test_lhbnc_heads_outside_blocks_rejected() -> None:
    # vLLM 0.33+ LHBNC: per-layer view (B, H, N, C) with H stride > B stride.
    shape = (8, 2, 4, 16)
    stride = (64, 8 * 64, 16, 1)
    with pytest.raises(UnsupportedLayout):
        infer_layer_geometry(shape, stride, 2, 0)


def test_layer_geometry_validation() -> None:
    with pytest.raises(UnsupportedLayout, match="roles"):
        LayerGeometry(0, 64, 4, (Segment("V", 0, 32), Segment("K", 32, 32)))
    with pytest.raises(UnsupportedLayout, match="overlap"):
        LayerGeometry(0, 48, 4, (Segment("K", 0, 32), Segment("V", 32, 32)))
    # a single block cannot overlap itself across blocks
    LayerGeometry(0, 48, 1, (Segment("K", 0, 32), Segment("V", 32, 32)))


def test_wire_round_trip_and_handshake() -> None:
    _, g = _infer(LayoutSpec("split_half", overalloc=3))
    wire = g.to_wire()
    back = KVGeometry.from_wire(wire)

    def key(la: LayerGeometry):
        return (la.base, la.block_stride, la.num_blocks, la.segments, la.num_heads,
                la.head_major)

    assert [key(la) for la in back.layers] == [key(la) for la in g.layers]
    assert back.layers[0].head_major is True and back.layers[0].num_heads == H
    same = geometry_from_handshake([], [], N, num_layers=L, advertised=wire)
    assert same.layers[0].segments == g.layers[0].segments
    with pytest.raises(GeometryMismatch, match="advertises 2 layers, the local model has 3"):
        geometry_from_handshake([], [], N, num_layers=3, advertised=wire)
    with pytest.raises(UnsupportedLayout, match="format"):
        KVGeometry.from_wire({"v": 99})


def test_geometry_from_stock_handshake_fields() -> None:
    # FA <= 0.22 peer: 2 regions per layer, block_lens = one K block
    split = geometry_from_handshake([1000, 9000, 20000, 28000], [64] * 4, 100, num_layers=2)
    assert split.kind == KIND_SPLIT
    assert split.layers[1].segments[1].offset == 8000 and split.layers[1].block_stride == 64
    # blocks-first peer: 1 region per layer, block_lens = [K|V]
    fused = geometry_from_handshake([1000, 50000], [128, 128], 100, num_layers=2)
    assert fused.kind == KIND_FUSED and fused.layers[0].segments[1].offset == 64
    packed = geometry_from_handshake([1000], [128], 10, num_layers=1, layout="packed",
                                     block_strides=[512])
    assert packed.kind == KIND_PACKED and packed.layers[0].block_stride == 512
    with pytest.raises(UnsupportedLayout, match="neither"):
        geometry_from_handshake([1, 2, 3], [8] * 3, 4, num_layers=2)
    with pytest.raises(UnsupportedLayout, match="odd"):
        geometry_from_handshake([0], [33], 4, num_layers=1)


def test_describe_names_the_numbers() -> None:
    _, g = _infer(LayoutSpec("fa_split"))
    text = g.describe()
    assert "split" in text and f"blocks={N}" in text and f"K@0+{SEG}B" in text
    assert "head-major" in text


def test_real_torch_tensors() -> None:
    """The documented call: tensor.shape, tensor.stride(), element_size(), data_ptr()."""
    torch = pytest.importorskip("torch")
    n, bs, h, d = 10, 16, 4, 32
    # FlashAttention <= 0.22 with HND stride order: (2, N, bs, H, D) viewed from (2, N, H, bs, D)
    fa = torch.zeros(2, n, h, bs, d, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    g = infer_layer_geometry(*tensor_info(fa))
    assert g.kind == KIND_SPLIT and g.head_major and g.block_stride == bs * h * d * 2
    # FlashInfer blocks-first NHD
    fi = torch.zeros(n, 2, bs, h, d, dtype=torch.float16)
    g = infer_layer_geometry(*tensor_info(fi))
    assert g.kind == KIND_FUSED and g.head_major is False
    # kvcached split-half: a (2, cap, ...) pool transposed to (N, 2, ...) and over-allocated
    pool = torch.zeros(2, 3 * n, bs, h, d, dtype=torch.float16)
    kvc = pool.transpose(0, 1)
    g = infer_layer_geometry(*tensor_info(kvc), num_blocks=n)
    assert g.kind == KIND_SPLIT and g.segments[1].offset == 3 * n * bs * h * d * 2
    assert g.capacity == 3 * n and g.num_blocks == n
    # vLLM >= 0.26 packed (N, H, bs, 2D)
    packed = torch.zeros(n, h, bs, 2 * d, dtype=torch.float16)
    g = infer_layer_geometry(*tensor_info(packed))
    assert g.kind == KIND_PACKED and g.head_major
    assert g.base == packed.data_ptr()


def test_core_imports_neither_torch_nor_vllm() -> None:
    code = (
        "import sys, pdpatch.kv; "
        "bad = [m for m in ('torch', 'vllm') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": ":".join(p for p in sys.path if p)})
    assert out.returncode == 0, out.stdout + out.stderr


def test_single_head_or_token_has_no_head_order() -> None:
    # (2, N, bs=1, H, D): one token per block -- NHD and HND are the same bytes
    g = infer_layer_geometry((2, 4, 1, 4, 8), (128, 32, 32, 8, 1), 2, 0)
    assert g.head_major is None
    g = infer_layer_geometry((2, 4, 16, 1, 8), (512, 128, 8, 8, 1), 2, 0)
    assert g.head_major is None


def test_handshake_kind_is_the_cheap_pass_through_test() -> None:
    from pdpatch.kv import handshake_kind, needs_conversion

    _, split = _infer(LayoutSpec("fa_split"))
    _, fused = _infer(LayoutSpec("fused"))
    assert handshake_kind(2 * L, L) == KIND_SPLIT
    assert handshake_kind(L, L) == KIND_FUSED
    assert handshake_kind(L, L, layout="packed") == KIND_PACKED
    assert handshake_kind(L, L, advertised=split.to_wire()) == KIND_SPLIT  # kvcached-style
    assert needs_conversion(fused, handshake_kind(2 * L, L))
    assert not needs_conversion(fused, handshake_kind(L, L))
    with pytest.raises(UnsupportedLayout, match="neither"):
        handshake_kind(3, L)
