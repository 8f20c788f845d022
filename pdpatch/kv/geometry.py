"""KV-cache geometry: where every K/V segment of every block lives, in bytes.

Why this model: vLLM releases and allocators place the same logical block at different byte
ranges -- FlashAttention up to vLLM 0.22 keeps K and V in two regions (``(2, N, ...)``),
FlashInfer and FlashAttention 0.23-0.25 fuse ``[K|V]`` per block, kvcached's split-half
memory is ``(N, 2, ...)`` with K and V half a pool apart, and from 0.26 every backend packs K
and V per token.  A transfer planner only needs, per layer, the address of block 0, the byte
stride between blocks, the number of blocks, and the *segments* of one block (offset from the
block's address, length, role).  With that, "split" and "fused" are just two placements of the
same segments, and converting between them changes descriptor addresses and lengths only.

Pure module: no torch, no vLLM.  Inference from tensors lives in :mod:`pdpatch.kv.infer`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

ROLE_K = "K"
ROLE_V = "V"
ROLE_KV = "KV"  # K and V packed per token (vLLM >= 0.26): not separable into byte ranges
ROLES = (ROLE_K, ROLE_V, ROLE_KV)

KIND_SPLIT = "split"  # K and V of a block are not adjacent (FA <= 0.22, kvcached split-half)
KIND_FUSED = "fused"  # [K|V] adjacent in one block (FlashInfer, FA 0.23-0.25, kvcached contiguous)
KIND_PACKED = "packed"  # one segment per block, K/V interleaved per token (vLLM >= 0.26)
KIND_CUSTOM = "custom"  # anything else a caller builds by hand

WIRE_VERSION = 1


class KVPlanError(ValueError):
    """Base of every error this package raises about KV geometry or planning."""


class UnsupportedLayout(KVPlanError):
    """Tensor strides that do not describe a KV layout pdpatch understands."""


class GeometryMismatch(KVPlanError):
    """Two peers' geometries cannot exchange blocks byte-exactly.

    Raised while the plan for a peer is built (vLLM's handshake thread), so only that peer's
    requests fail; the message names both geometries and the offending numbers.
    """

    def __init__(self, reason: str, local: KVGeometry | None = None,
                 remote: KVGeometry | None = None) -> None:
        self.reason = reason
        self.local = local
        self.remote = remote
        parts = [f"pdpatch: KV geometries cannot be converted: {reason}"]
        if local is not None:
            parts.append(f"local = {local.describe()}")
        if remote is not None:
            parts.append(f"remote = {remote.describe()}")
        super().__init__("; ".join(parts))


class HeadOrderMismatch(GeometryMismatch):
    """Same segments, heads ordered differently inside them (head-major vs token-major): the
    bytes mean different things unless the receiver reorders them after the transfer."""



class BlockIdError(KVPlanError):
    """Block ids outside a geometry's planned blocks, or block lists that do not pair up."""


@dataclass(frozen=True)
class Segment:
    """One contiguous byte range of a block: ``[block_addr + offset, ... + length)``."""

    role: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UnsupportedLayout(f"segment role {self.role!r} is not one of {ROLES}")
        if self.offset < 0 or self.length <= 0:
            raise UnsupportedLayout(
                f"segment {self.role} needs offset >= 0 and length > 0, "
                f"got offset={self.offset}, length={self.length}"
            )


def _segments_overlap(a: Segment, b: Segment, stride: int, capacity: int, same: bool) -> bool:
    """Whether segment ``a`` of some block overlaps segment ``b`` of another (or the same) block.

    Overlap of ``[oa + i*s, +la)`` and ``[ob + j*s, +lb)`` happens iff, with ``k = j - i``,
    ``oa - ob - la < k*s < oa - ob + lb``; we look for such a ``k`` in ``(-capacity, capacity)``.
    """
    d = a.offset - b.offset
    k_lo = math.floor((d - a.length) / stride) + 1
    k_hi = math.ceil((d + b.length) / stride) - 1
    k_lo = max(k_lo, -(capacity - 1))
    k_hi = min(k_hi, capacity - 1)
    if k_lo > k_hi:
        return False
    if same:
        # k == 0 is the segment itself; any other k in range is a real overlap.
        return not (k_lo == 0 and k_hi == 0)
    return True


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's KV memory: segment ``s`` of block ``b`` is at
    ``base + b * block_stride + segments[s].offset``.

    ``capacity`` is how many blocks the memory really holds (over-allocated views, e.g.
    kvcached's virtual pool); only ``num_blocks`` (the planned ones) may be addressed.
    ``num_heads``/``head_major`` describe the inside of a segment when known: head slices
    for heterogeneous TP are contiguous only when heads are the outermost dimension.
    ``head_major=None`` means unknown (stock handshake) or irrelevant (one head or one token
    per block, where both orders are the same bytes).
    """

    base: int
    block_stride: int
    num_blocks: int
    segments: tuple[Segment, ...]
    num_heads: int | None = None
    head_major: bool | None = None
    capacity: int | None = None

    def __post_init__(self) -> None:
        if self.base < 0:
            raise UnsupportedLayout(f"base address must be >= 0, got {self.base}")
        if self.block_stride <= 0:
            raise UnsupportedLayout(f"block stride must be > 0, got {self.block_stride}")
        if self.num_blocks < 0:
            raise UnsupportedLayout(f"num_blocks must be >= 0, got {self.num_blocks}")
        if not self.segments:
            raise UnsupportedLayout("a layer needs at least one segment")
        roles = tuple(s.role for s in self.segments)
        if roles not in ((ROLE_K, ROLE_V), (ROLE_KV,)):
            raise UnsupportedLayout(f"segment roles must be (K, V) or (KV,), got {roles}")
        cap = self.capacity if self.capacity is not None else self.num_blocks
        if cap < self.num_blocks:
            raise UnsupportedLayout(
                f"{self.num_blocks} planned blocks exceed the memory's capacity of {cap} blocks"
            )
        if self.num_heads is not None and self.num_heads <= 0:
            raise UnsupportedLayout(f"num_heads must be > 0, got {self.num_heads}")
        cap = max(cap, 1)
        for i, a in enumerate(self.segments):
            for j in range(i, len(self.segments)):
                b = self.segments[j]
                if _segments_overlap(a, b, self.block_stride, cap, same=(i == j)):
                    raise UnsupportedLayout(
                        f"segments {a.role}@{a.offset}+{a.length} and {b.role}@{b.offset}"
                        f"+{b.length} overlap across blocks (block stride {self.block_stride},"
                        f" {cap} blocks)"
                    )

    @cached_property
    def roles(self) -> tuple[str, ...]:
        return tuple(s.role for s in self.segments)

    @cached_property
    def kind(self) -> str:
        if self.roles == (ROLE_KV,):
            return KIND_PACKED
        k, v = self.segments
        if k.offset + k.length == v.offset and v.offset + v.length - k.offset <= self.block_stride:
            return KIND_FUSED
        return KIND_SPLIT

    def segment_addr(self, segment: int, block: int) -> int:
        return self.base + block * self.block_stride + self.segments[segment].offset

    def extents(self, num_blocks: int | None = None) -> list[tuple[int, int]]:
        """``[start, end)`` of each segment's memory over the first ``num_blocks`` blocks
        (default: the planned blocks) -- what a peer registers with NIXL."""
        n = self.num_blocks if num_blocks is None else num_blocks
        if n == 0:
            return []
        return [
            (self.base + s.offset, self.base + s.offset + (n - 1) * self.block_stride + s.length)
            for s in self.segments
        ]

    def with_num_blocks(self, num_blocks: int) -> LayerGeometry:
        return LayerGeometry(self.base, self.block_stride, num_blocks, self.segments,
                             self.num_heads, self.head_major, self.capacity)


@dataclass(frozen=True)
class KVGeometry:
    """All attention layers of one worker, in vLLM's layer order.

    ``names``: each layer's name (the worker's ``kv_caches`` keys), where known -- what a
    release that pairs a peer's layers by name (vLLM 0.34+) pairs them by."""

    layers: tuple[LayerGeometry, ...]
    device_id: int = 0
    label: str = field(default="", compare=False)
    names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise UnsupportedLayout("a KV geometry needs at least one layer")
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.names is not None:
            names = tuple(self.names)
            if len(names) != len(self.layers) or not all(isinstance(n, str) for n in names):
                raise UnsupportedLayout(
                    f"{len(self.layers)} layers need as many layer names, got {names!r:.200}")
            if len(set(names)) != len(names):
                raise UnsupportedLayout(f"layer names repeat: {names!r:.200}")
            object.__setattr__(self, "names", names)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def num_blocks(self) -> int:
        """The planned block count, which vLLM requires to be the same for every layer."""
        counts = {layer.num_blocks for layer in self.layers}
        if len(counts) != 1:
            raise UnsupportedLayout(f"layers disagree on num_blocks: {sorted(counts)}")
        return counts.pop()

    @cached_property
    def kind(self) -> str:
        kinds = {layer.kind for layer in self.layers}
        return kinds.pop() if len(kinds) == 1 else KIND_CUSTOM

    @property
    def segments_per_layer(self) -> int:
        return len(self.layers[0].segments)

    def describe(self) -> str:
        """Short human description for error messages and logs."""
        first = self.layers[0]
        segs = ", ".join(f"{s.role}@{s.offset}+{s.length}B" for s in first.segments)
        heads = ""
        if first.num_heads is not None:
            order = {True: "head-major", False: "token-major", None: "order unknown"}
            heads = f", {first.num_heads} heads {order[first.head_major]}"
        uniform = all(
            (la.block_stride, la.segments, la.num_blocks)
            == (first.block_stride, first.segments, first.num_blocks)
            for la in self.layers
        )
        more = "" if uniform else ", layers differ (layer 0 shown)"
        label = f"{self.label}: " if self.label else ""
        return (
            f"{label}{self.kind}(layers={self.num_layers}, blocks={first.num_blocks}, "
            f"block stride={first.block_stride}B, segments=[{segs}]{heads}{more})"
        )

    def with_num_blocks(self, num_blocks: int) -> KVGeometry:
        return KVGeometry(tuple(la.with_num_blocks(num_blocks) for la in self.layers),
                          self.device_id, self.label, self.names)

    def select(self, indices: Iterable[int]) -> KVGeometry:
        """The layers at ``indices``, in that order (a peer's layers as another worker pairs
        them: :func:`pdpatch.kv.pairing.pair_regions_by_layer`)."""
        idx = list(indices)
        names = None if self.names is None else tuple(self.names[i] for i in idx)
        return KVGeometry(tuple(self.layers[i] for i in idx), self.device_id, self.label, names)

    def registration_ranges(self) -> list[tuple[int, int]]:
        """Merged ``[start, end)`` ranges covering exactly the planned blocks of every layer.

        Registering these (not an over-allocated tensor's whole storage) makes NIXL itself
        reject a descriptor past the plan (``NIXL_ERR_NOT_FOUND``) instead of silently reading
        unmapped or zero-page memory (measured on an H200).  A fused layer gives one
        range, a split layer two (K pool, V pool).
        """
        return _merged((span for layer in self.layers for span in layer.extents()),
                       touching=True)

    def read_ranges(self) -> list[tuple[int, int]]:
        """``[start, end)`` ranges a READ may cross whole, unrequested bytes included.

        Each must lie inside one NIXL registration of the peer, whoever registered it: a
        descriptor that crosses two registrations is refused even where they touch.  So
        extents that overlap (a fused layer's K and V, layers interleaved per block) are one
        range, but extents that merely touch stay apart: vLLM < 0.26 registers a split
        layer's adjacent K and V pools separately, and each layer's tensor on its own.
        """
        return _merged((span for layer in self.layers for span in layer.extents()),
                       touching=False)

    # -- wire form: an optional extra handshake field (stock peers ignore unknown fields) --
    def to_wire(self) -> dict[str, Any]:
        """Plain ints/strings/lists only, so msgpack, msgspec and JSON all carry it.  The layer
        names ride in an optional ``names`` key (a reader that predates it ignores it)."""
        wire: dict[str, Any] = {
            "v": WIRE_VERSION,
            "dev": self.device_id,
            "layers": [
                [
                    la.base, la.block_stride, la.num_blocks,
                    [[s.role, s.offset, s.length] for s in la.segments],
                    -1 if la.num_heads is None else la.num_heads,
                    -1 if la.head_major is None else int(la.head_major),
                ]
                for la in self.layers
            ],
        }
        if self.names is not None:
            wire["names"] = list(self.names)
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any], label: str = "") -> KVGeometry:
        if not isinstance(wire, dict) or wire.get("v") != WIRE_VERSION:
            raise UnsupportedLayout(f"unknown advertised KV geometry format: {wire!r:.200}")
        layers = []
        for row in wire["layers"]:
            base, stride, n, segs, heads, head_major = row
            layers.append(LayerGeometry(
                int(base), int(stride), int(n),
                tuple(Segment(str(r), int(o), int(ln)) for r, o, ln in segs),
                None if heads < 0 else int(heads),
                None if head_major < 0 else bool(head_major),
            ))
        names = wire.get("names")
        if names is not None and not isinstance(names, (list, tuple)):
            raise UnsupportedLayout(f"advertised layer names are not a list: {names!r:.200}")
        return cls(tuple(layers), int(wire.get("dev", 0)), label,
                   None if names is None else tuple(names))


def handshake_kind(
    num_regions: int,
    num_layers: int,
    *,
    layout: str = "auto",
    advertised: dict[str, Any] | None = None,
) -> str:
    """The peer's segment placement (split / fused / packed) from handshake metadata, without
    building its geometry -- the cheap test a patch runs before delegating to stock code when
    both sides already agree (see :func:`geometry_from_handshake` for the rules)."""
    if advertised is not None:
        return KVGeometry.from_wire(advertised).kind
    if layout != "auto":
        return layout
    if num_regions == 2 * num_layers:
        return KIND_SPLIT
    if num_regions == num_layers:
        return KIND_FUSED
    raise UnsupportedLayout(
        f"peer registers {num_regions} regions for {num_layers} layers: neither 2·L "
        "(split K/V) nor L (blocks-first)"
    )


def needs_conversion(local: KVGeometry, remote_kind: str) -> bool:
    """Whether stock vLLM's remote descriptors would be wrong for this pair.

    Stock code builds the remote descriptors with the *local* layout, which is right exactly
    when both sides place K and V the same way; only then may a patch stay a pass-through.
    """
    return local.kind != remote_kind


def geometry_from_handshake(
    base_addrs: Sequence[int],
    block_lens: Sequence[int],
    num_blocks: int,
    *,
    num_layers: int,
    layout: str = "auto",
    block_strides: Sequence[int] | None = None,
    device_id: int = 0,
    advertised: dict[str, Any] | None = None,
    label: str = "remote",
) -> KVGeometry:
    """A peer's geometry from stock ``NixlAgentMetadata`` fields.

    Stock metadata carries no split/fused flag: a split peer (FA <= 0.22)
    registers 2·L regions whose ``block_lens`` are one K (or V) segment; a blocks-first peer
    registers L regions whose ``block_lens`` are the whole ``[K|V]`` block.  ``layout="auto"``
    decides by the region count; pass ``"packed"`` for vLLM >= 0.26 peers (one region per
    layer, K/V packed per token).  An ``advertised`` pdpatch geometry (see
    :meth:`KVGeometry.to_wire`) wins when present, after a consistency check against the
    stock fields.
    """
    if advertised is not None:
        geom = KVGeometry.from_wire(advertised, label=label)
        if geom.num_layers != num_layers:
            raise GeometryMismatch(
                f"peer advertises {geom.num_layers} layers, the local model has {num_layers}",
                None, geom,
            )
        return geom
    n_regions = len(base_addrs)
    if len(block_lens) != n_regions:
        raise UnsupportedLayout(
            f"{n_regions} base addresses but {len(block_lens)} block lengths in peer metadata"
        )
    strides = list(block_strides) if block_strides else list(block_lens)
    if len(strides) != n_regions:
        raise UnsupportedLayout(f"{n_regions} regions but {len(strides)} block strides")
    if layout == "auto":
        if n_regions == 2 * num_layers:
            layout = KIND_SPLIT
        elif n_regions == num_layers:
            layout = KIND_FUSED
        else:
            raise UnsupportedLayout(
                f"peer registers {n_regions} regions for {num_layers} layers: neither 2·L "
                "(split K/V) nor L (blocks-first)"
            )
    layers: list[LayerGeometry] = []
    if layout == KIND_SPLIT:
        if n_regions != 2 * num_layers:
            raise UnsupportedLayout(f"split layout needs {2 * num_layers} regions, got {n_regions}")
        for li in range(num_layers):
            k_addr, v_addr = base_addrs[2 * li], base_addrs[2 * li + 1]
            k_len, v_len = block_lens[2 * li], block_lens[2 * li + 1]
            k_st, v_st = strides[2 * li], strides[2 * li + 1]
            if k_len != v_len or k_st != v_st:
                raise UnsupportedLayout(
                    f"layer {li}: K and V regions differ (lens {k_len}/{v_len}, "
                    f"strides {k_st}/{v_st})"
                )
            base = min(k_addr, v_addr)
            layers.append(LayerGeometry(
                base, k_st, num_blocks,
                (Segment(ROLE_K, k_addr - base, k_len), Segment(ROLE_V, v_addr - base, v_len)),
            ))
    elif layout in (KIND_FUSED, KIND_PACKED):
        if n_regions != num_layers:
            raise UnsupportedLayout(f"{layout} layout needs {num_layers} regions, got {n_regions}")
        for li in range(num_layers):
            blen = block_lens[li]
            if layout == KIND_PACKED:
                segs: tuple[Segment, ...] = (Segment(ROLE_KV, 0, blen),)
            else:
                if blen % 2:
                    raise UnsupportedLayout(f"layer {li}: odd [K|V] block length {blen}")
                half = blen // 2
                segs = (Segment(ROLE_K, 0, half), Segment(ROLE_V, half, half))
            layers.append(LayerGeometry(base_addrs[li], strides[li], num_blocks, segs))
    else:
        raise UnsupportedLayout(f"unknown layout {layout!r}")
    return KVGeometry(tuple(layers), device_id, label)


def _merged(spans: Iterable[tuple[int, int]], *, touching: bool) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` spans with overlapping ones merged, and touching ones too when
    ``touching``."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and (start < merged[-1][1] or (touching and start == merged[-1][1])):
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
