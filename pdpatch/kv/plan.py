"""Plan local/remote descriptor pairs between any two KV geometries.

Why: when P and D place K and V differently (split regions vs fused ``[K|V]`` blocks), stock
vLLM builds the remote descriptors with the *local* layout and either refuses the peer or
reads the wrong bytes.  Both layouts share one descriptor-id space -- per layer, one logical
region per segment role (K then V), id = ``region * num_blocks + block`` -- so a conversion
only changes each descriptor's address and length, never the count or the order.
:class:`PairPlan` validates the pair once (at handshake) and then produces:

* per request, address-level descriptor pairs (:meth:`PairPlan.descs`), or descriptor ids into
  per-side tables (:meth:`PairPlan.desc_ids`), exactly as vLLM computes them;
* per peer, the remote (and local) descriptor tables in vLLM's desc-id order, as tuples, Nx3
  rows (vLLM <= 0.32) or Nx5 strided rows (vLLM 0.33+ / NIXL >= 1.5; 0.34.0 base_worker.py
  L2210 ``_block_strided_descs``, L2318-2324).

Heterogeneous TP: a side can move one of ``parts`` equal contiguous slices of every segment
(:class:`HeadSlice`), which is a head slice when heads are outermost inside the segment.
Block-size ratio ``r``: a local block holds ``r`` remote blocks; local block ``b`` is split
into ``r`` equal byte chunks, chunk ``j`` pairing with the ``j``-th remote block of that local
block -- vLLM's byte semantics (it re-permutes head-major data after receive).

Anything that does not pair up byte-exactly raises :class:`GeometryMismatch`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pdpatch.kv.geometry import (
    BlockIdError,
    GeometryMismatch,
    HeadOrderMismatch,
    KVGeometry,
    LayerGeometry,
)

logger = logging.getLogger("pdpatch.kv")

_U64 = np.uint64


@dataclass(frozen=True)
class HeadSlice:
    """Move slice ``index`` of ``parts`` equal contiguous slices of each segment.

    In vLLM terms: a decode rank with ``tp_ratio`` = D_TP/P_TP > 1 reads
    ``remote_slice=HeadSlice(tp_ratio, rank_offset_factor)``; with P_TP > D_TP a decode rank
    reads ``num_reads`` remotes into ``local_slice=HeadSlice(num_reads, slot)``.
    """

    parts: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.parts < 1 or not 0 <= self.index < self.parts:
            raise GeometryMismatch(
                f"head slice {self.index} of {self.parts} parts is not a valid slice"
            )


@dataclass(frozen=True)
class Slices:
    """How one local rank's blocks pair with one remote rank's (vLLM's TP mapping in bytes)."""

    local: HeadSlice
    remote: HeadSlice
    block_size_ratio: int


def slices_for(total_heads: int, local_tp: int, local_rank: int, remote_tp: int,
               local_block_size: int, remote_block_size: int) -> Slices:
    """Head slices as vLLM >= 0.21 computes them (``compute_tp_mapping``), in pdpatch terms:
    D TP > P TP reads slice ``rank_offset_factor`` of ``remote heads / local heads`` parts of
    the peer's segment; P TP > D TP reads ``local heads / remote heads`` peers into as many
    parts of the local segment.  Non-divisible sizes raise :class:`GeometryMismatch`."""
    if remote_block_size <= 0 or local_block_size % remote_block_size:
        raise GeometryMismatch(
            f"local block size {local_block_size} is not a multiple of the peer's "
            f"{remote_block_size} tokens")
    ratio = local_block_size // remote_block_size
    h_local = max(1, total_heads // local_tp)
    h_remote = max(1, total_heads // remote_tp)
    if local_tp >= remote_tp:
        if h_remote % h_local:
            raise GeometryMismatch(
                f"peer holds {h_remote} KV heads per rank, not a multiple of the local "
                f"{h_local}")
        remote_rank = local_rank * remote_tp // local_tp
        local_start = local_rank * total_heads // local_tp
        remote_start = remote_rank * total_heads // remote_tp
        parts = h_remote // h_local
        index = (local_start - remote_start) // h_local
        return Slices(HeadSlice(), HeadSlice(parts, index), ratio)
    if h_local % h_remote:
        raise GeometryMismatch(
            f"local rank holds {h_local} KV heads, not a multiple of the peer's {h_remote}")
    return Slices(HeadSlice(h_local // h_remote, 0), HeadSlice(), ratio)


@dataclass(frozen=True)
class DescPlan:
    """Descriptor pairs: ``length[i]`` bytes at ``local_addr[i]`` <-> ``remote_addr[i]``.

    ``region[i]`` (optional) is the logical region (layer, segment) of pair ``i``: NIXL wants
    every strided row inside one registered memory region, so rows never cross regions.
    """

    local_addr: np.ndarray
    remote_addr: np.ndarray
    length: np.ndarray
    local_dev: int = 0
    remote_dev: int = 0
    region: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum(dtype=_U64))

    def local_nx3(self) -> np.ndarray:
        return _nx3(self.local_addr, self.length, self.local_dev)

    def remote_nx3(self) -> np.ndarray:
        return _nx3(self.remote_addr, self.length, self.remote_dev)


def _nx3(addr: np.ndarray, length: np.ndarray, dev: int) -> np.ndarray:
    out = np.empty((addr.shape[0], 3), dtype=_U64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = dev
    return out


def as_tuples(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Nx3 rows as the ``list[(addr, len, dev)]`` that vLLM 0.19-0.25 hands to NIXL."""
    return [(int(a), int(n), int(d)) for a, n, d in rows.tolist()]


def _shape_key(la: LayerGeometry) -> tuple:
    return (la.block_stride, la.segments, la.num_heads, la.head_major)


def _pair_layer(
    li: int, la: LayerGeometry, ra: LayerGeometry, p: int, pi: int, q: int, qi: int, r: int,
    fail: Callable[..., GeometryMismatch], receiver_reorders_heads: bool = False,
) -> list[tuple[int, int, int, int]]:
    """Validate one layer pair; per segment ``(local offset, remote offset, local chunk,
    transfer length)`` with the head-slice offsets applied."""
    if la.roles != ra.roles:
        raise fail(
            f"layer {li}: local segments {'/'.join(la.roles)} ({la.kind}) vs remote "
            f"{'/'.join(ra.roles)} ({ra.kind}); K|V packed per token cannot be split "
            "into K and V byte ranges"
        )
    # The receiver's reorder (vLLM's `enable_permute_local_kv`) reads each received block of a
    # token-major cache as head-major and permutes it whole: until then the local block holds
    # head-major bytes, so its head slices are contiguous too.
    # A one-head peer's order is unknown (both are the same bytes).
    received_head_major = bool(receiver_reorders_heads and la.head_major is False
                               and ra.head_major is not False and r == 1)
    if None not in (la.head_major, ra.head_major) and la.head_major != ra.head_major \
            and not received_head_major:
        why = ("the receiver reorders heads only with equal block sizes"
               if receiver_reorders_heads and ra.head_major
               else "nothing reorders them, so the bytes mean different things")
        raise fail(
            f"layer {li}: local segments are {'head' if la.head_major else 'token'}-major, "
            f"remote {'head' if ra.head_major else 'token'}-major; {why}",
            HeadOrderMismatch)
    for side, geo, parts in (("local", la, p), ("remote", ra, q)):
        head_major = True if side == "local" and received_head_major else geo.head_major
        if parts > 1 and head_major is False:
            raise fail(
                f"layer {li}: {side} heads are not outermost inside a segment "
                f"(token-major), so a 1/{parts} head slice is not contiguous"
            )
        if parts > 1 and geo.num_heads is not None and geo.num_heads % parts:
            raise fail(
                f"layer {li}: {side} has {geo.num_heads} heads, not divisible into "
                f"{parts} head slices"
            )
    if la.num_heads is not None and ra.num_heads is not None and (
        la.num_heads * q != ra.num_heads * p
    ):
        raise fail(
            f"layer {li}: local {la.num_heads} heads / {p} local slices != remote "
            f"{ra.num_heads} heads / {q} remote slices"
        )
    out = []
    for lseg, rseg in zip(la.segments, ra.segments, strict=True):
        if lseg.length % (r * p):
            raise fail(
                f"layer {li} segment {lseg.role}: local {lseg.length} B is not divisible "
                f"by block-size ratio {r} x {p} local slices"
            )
        chunk = lseg.length // r
        n = chunk // p
        if rseg.length % q or rseg.length // q != n:
            raise fail(
                f"layer {li} segment {lseg.role}: spans differ -- local {lseg.length} B "
                f"/ block-size ratio {r} / {p} local slices = {n} B per descriptor, but "
                f"remote {rseg.length} B / {q} remote slices = {rseg.length / q:g} B"
            )
        out.append((lseg.offset + pi * n, rseg.offset + qi * n, chunk, n))
    return out


class PairPlan:
    """A validated transfer geometry between one local and one remote worker.

    Built once per peer (vLLM's handshake thread); raising here fails only that peer.
    Per logical region (layer-major, segment role order) it keeps the local and remote start
    address, block strides, the local chunk size and the transfer length.
    """

    def __init__(
        self,
        local: KVGeometry,
        remote: KVGeometry,
        *,
        local_slice: HeadSlice | None = None,
        remote_slice: HeadSlice | None = None,
        block_size_ratio: int = 1,
        receiver_reorders_heads: bool = False,
    ) -> None:
        self.local = local
        self.remote = remote
        self.local_slice = local_slice or HeadSlice()
        self.remote_slice = remote_slice or HeadSlice()
        self.block_size_ratio = r = int(block_size_ratio)

        def fail(reason: str, kind: type[GeometryMismatch] = GeometryMismatch
                 ) -> GeometryMismatch:
            return kind(reason, local, remote)

        if r < 1 or r != block_size_ratio:
            raise fail(f"block-size ratio must be a positive integer, got {block_size_ratio}")
        if local.num_layers != remote.num_layers:
            raise fail(f"local has {local.num_layers} layers, remote {remote.num_layers}")
        p, pi = self.local_slice.parts, self.local_slice.index
        q, qi = self.remote_slice.parts, self.remote_slice.index
        l_base: list[int] = []
        l_stride: list[int] = []
        l_chunk: list[int] = []
        r_base: list[int] = []
        r_stride: list[int] = []
        xfer: list[int] = []
        # Layers usually share one shape: validate each distinct (local, remote) shape once.
        checked: dict[tuple, list[tuple[int, int, int, int]]] = {}
        for li, (la, ra) in enumerate(zip(local.layers, remote.layers, strict=True)):
            key = (_shape_key(la), _shape_key(ra))
            segs = checked.get(key)
            if segs is None:
                segs = checked[key] = _pair_layer(li, la, ra, p, pi, q, qi, r, fail,
                                                   receiver_reorders_heads)
            for l_off, r_off, chunk, n in segs:
                l_base.append(la.base + l_off)
                l_stride.append(la.block_stride)
                l_chunk.append(chunk)
                r_base.append(ra.base + r_off)
                r_stride.append(ra.block_stride)
                xfer.append(n)
        self.num_regions = len(xfer)
        self._l_base = np.asarray(l_base, dtype=np.int64)
        self._l_stride = np.asarray(l_stride, dtype=np.int64)
        self._l_chunk = np.asarray(l_chunk, dtype=np.int64)
        self._r_base = np.asarray(r_base, dtype=np.int64)
        self._r_stride = np.asarray(r_stride, dtype=np.int64)
        self._xfer = np.asarray(xfer, dtype=np.int64)
        self.local_num_blocks = local.num_blocks
        self.remote_num_blocks = remote.num_blocks
        # Stock vLLM builds the remote descriptors with the local layout, which is right exactly
        # when both sides place segments the same way (split/split, fused/fused, packed/packed).
        self.converts = local.kind != remote.kind
        if self.converts:
            logger.debug("pdpatch KV conversion planned: local %s <- remote %s",
                         local.describe(), remote.describe())

    # ---------------------------------------------------------------- per request
    def _pair_ids(
        self, local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Validated (local sub-block ids, remote block ids), paired 1:1 like vLLM's
        ``_map_block_ids_for_block_size_ratio`` (local blocks expand to ``r`` sub-blocks,
        clipped to the remote list)."""
        lids = np.asarray(local_block_ids, dtype=np.int64).reshape(-1)
        rids = np.asarray(remote_block_ids, dtype=np.int64).reshape(-1)
        r = self.block_size_ratio
        if lids.size and (lids.min() < 0 or lids.max() >= self.local_num_blocks):
            raise BlockIdError(
                f"local block ids must be in [0, {self.local_num_blocks}), got "
                f"min {lids.min()} max {lids.max()}"
            )
        if rids.size and (rids.min() < 0 or rids.max() >= self.remote_num_blocks):
            raise BlockIdError(
                f"remote block ids must be in [0, {self.remote_num_blocks}), got "
                f"min {rids.min()} max {rids.max()}"
            )
        if r == 1:
            if lids.size != rids.size:
                raise BlockIdError(f"{lids.size} local blocks vs {rids.size} remote blocks")
            return lids, rids
        if not (lids.size - 1) * r < rids.size <= lids.size * r:
            raise BlockIdError(
                f"{lids.size} local blocks hold {lids.size * r} remote blocks at block-size "
                f"ratio {r}; {rids.size} remote blocks do not fill them"
            )
        sub = (lids[:, None] * r + np.arange(r, dtype=np.int64)[None, :]).reshape(-1)
        return sub[: rids.size], rids

    def descs(
        self, local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
    ) -> DescPlan:
        """Descriptor pairs for one request, region-major (vLLM's order)."""
        sub, rids = self._pair_ids(local_block_ids, remote_block_ids)
        r = self.block_size_ratio
        lblk, lchunk = (sub, None) if r == 1 else np.divmod(sub, r)
        l_addr = self._l_base[:, None] + self._l_stride[:, None] * lblk[None, :]
        if lchunk is not None:
            l_addr += self._l_chunk[:, None] * lchunk[None, :]
        r_addr = self._r_base[:, None] + self._r_stride[:, None] * rids[None, :]
        length = np.broadcast_to(self._xfer[:, None], l_addr.shape)
        region = np.repeat(np.arange(self.num_regions, dtype=np.int32), sub.size)
        return DescPlan(
            l_addr.reshape(-1).astype(_U64), r_addr.reshape(-1).astype(_U64),
            length.reshape(-1).astype(_U64), self.local.device_id, self.remote.device_id,
            region,
        )

    def desc_ids(
        self, local_block_ids: Sequence[int] | np.ndarray,
        remote_block_ids: Sequence[int] | np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Indices into :meth:`local_table` / :meth:`remote_table` for one request -- the same
        ids vLLM's ``_compute_desc_ids`` produces (region * num_blocks + block)."""
        sub, rids = self._pair_ids(local_block_ids, remote_block_ids)
        regions = np.arange(self.num_regions, dtype=np.int64)[:, None]
        n_local = self.local_num_blocks * self.block_size_ratio
        lid = (regions * n_local + sub[None, :]).reshape(-1)
        rid = (regions * self.remote_num_blocks + rids[None, :]).reshape(-1)
        return lid, rid

    # ---------------------------------------------------------------- per peer tables
    def remote_table(self) -> np.ndarray:
        """Nx3 remote descriptors in vLLM's desc-id order: ``num_regions * remote blocks``."""
        n = self.remote_num_blocks
        blocks = np.arange(n, dtype=np.int64)
        addr = self._r_base[:, None] + self._r_stride[:, None] * blocks[None, :]
        length = np.broadcast_to(self._xfer[:, None], addr.shape)
        return _nx3(addr.reshape(-1), length.reshape(-1), self.remote.device_id)

    def remote_rows(self) -> np.ndarray:
        """Nx5 strided rows of :meth:`remote_table`: one ``(addr, len, dev, stride, count)``
        row per region, as vLLM 0.33+'s ``_build_fa_remote`` emits."""
        out = np.empty((self.num_regions, 5), dtype=_U64)
        out[:, 0] = self._r_base
        out[:, 1] = self._xfer
        out[:, 2] = self.remote.device_id
        out[:, 3] = self._r_stride
        out[:, 4] = self.remote_num_blocks
        return out

    def local_table(self) -> np.ndarray:
        """Nx3 local descriptors in desc-id order: ``num_regions * local blocks * ratio``."""
        r = self.block_size_ratio
        sub = np.arange(self.local_num_blocks * r, dtype=np.int64)
        blk, chunk = np.divmod(sub, r)
        addr = (self._l_base[:, None] + self._l_stride[:, None] * blk[None, :]
                + self._l_chunk[:, None] * chunk[None, :])
        length = np.broadcast_to(self._xfer[:, None], addr.shape)
        return _nx3(addr.reshape(-1), length.reshape(-1), self.local.device_id)

    def local_rows(self) -> np.ndarray:
        """Nx5 strided rows of :meth:`local_table` (vLLM 0.33+ ``_block_strided_descs`` shape:
        one row per region when sub-blocks are evenly spaced, else one row per block)."""
        r = self.block_size_ratio
        n = self.local_num_blocks
        dev = self.local.device_id
        parts: list[np.ndarray] = []
        for i in range(self.num_regions):
            base, stride = int(self._l_base[i]), int(self._l_stride[i])
            chunk, length = int(self._l_chunk[i]), int(self._xfer[i])
            if r == 1 or stride == r * chunk:
                parts.append(np.array([[base, length, dev, stride // r, n * r]], dtype=_U64))
            else:
                rows = np.empty((n, 5), dtype=_U64)
                rows[:, 0] = base + np.arange(n, dtype=np.int64) * stride
                rows[:, 1] = length
                rows[:, 2] = dev
                rows[:, 3] = chunk
                rows[:, 4] = r
                parts.append(rows)
        return np.concatenate(parts) if parts else np.empty((0, 5), dtype=_U64)


def plan_transfer(
    local: KVGeometry,
    remote: KVGeometry,
    local_block_ids: Sequence[int] | np.ndarray,
    remote_block_ids: Sequence[int] | np.ndarray,
    *,
    local_slice: HeadSlice | None = None,
    remote_slice: HeadSlice | None = None,
    block_size_ratio: int = 1,
) -> DescPlan:
    """One-shot :meth:`PairPlan.descs` (validates the pair every call; cache a
    :class:`PairPlan` per peer on hot paths)."""
    return PairPlan(
        local, remote, local_slice=local_slice, remote_slice=remote_slice,
        block_size_ratio=block_size_ratio,
    ).descs(local_block_ids, remote_block_ids)
