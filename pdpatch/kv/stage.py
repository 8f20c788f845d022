"""Staged K/V conversion: as few NIXL descriptors as the REMOTE layout allows, plus one local copy.

Why: with NIXL the cost of a transfer is mostly per descriptor (about 2.8 µs each on an H200 over
cuda_ipc, research/gpu_probe.md), and NIXL merges two descriptor pairs of a request only when
they are consecutive entries of the prepared lists on BOTH sides and contiguous in memory on both
sides (measured with NIXL 1.5.1: consecutive ids over contiguous entries give ``descCount`` 1;
the same memory reached through non-consecutive ids is not merged).  A split<->fused conversion
pairs a contiguous run on one side with a strided run on the other, so nothing merges: a run of
16 blocks costs 32 descriptors per layer instead of one.  NIXL >= 1.5 strided rows
``(addr, len, dev, stride, count)`` do not help at transfer time: NIXL expands them back into
one descriptor per element (measured: ``descCount`` equals the element count).

Staging moves the layout change out of NIXL.  The local side of the transfer becomes a staging
buffer laid out in REMOTE address order, so every run that is contiguous on the remote side is
one descriptor, whatever the local layout; one local gather/scatter (a device copy at memory
bandwidth) then moves the bytes into (READ) or out of (WRITE) the local KV layout.  The number of
descriptors equals what the same-layout path needs whenever the remote side is fused (fused
remote -> split local), and drops from one per block-segment to one per run and segment pool
when the remote side is split.

Two forms, the same semantics:

* :func:`stage` -- address level, from a :class:`~pdpatch.kv.plan.DescPlan` (per-request
  descriptor lists);
* :func:`stage_ids` -- vLLM's form: tables prepared once per peer (the stock remote table and a
  :func:`staging_table` of equal slots), per request only descriptor ids, which NIXL merges.

:func:`whole_blocks` gives the same-layout fused path its best tables: one descriptor per
``[K|V]`` block, so consecutive blocks are consecutive, contiguous entries that NIXL merges (what
vLLM >= 0.26 does for its packed layout).  :func:`nixl_merged_count` predicts NIXL's
``descCount`` for a request.

Pure module: numpy only.  The copy itself is the caller's (a device kernel or host memmove) and
is described by a :class:`CopyPlan`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pdpatch.kv.geometry import (
    KIND_FUSED,
    KIND_PACKED,
    ROLE_KV,
    KVGeometry,
    KVPlanError,
    LayerGeometry,
    Segment,
)
from pdpatch.kv.plan import DescPlan

_U64 = np.uint64
OPS = ("READ", "WRITE")


@dataclass(frozen=True)
class CopyPlan:
    """Local copies: ``length[i]`` bytes from ``src[i]`` to ``dst[i]`` (addresses)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum(dtype=_U64))

    def chunks(self, max_bytes: int) -> CopyPlan:
        """The same copies cut into pieces of at most ``max_bytes`` (in order), so a kernel can
        give every piece one thread block however long the merged runs are."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        n = len(self)
        if n == 0:
            return self
        ln = self.length.astype(np.int64)
        pieces = np.maximum((ln + max_bytes - 1) // max_bytes, 1)
        if int(pieces.max()) == 1:
            return self
        idx = np.repeat(np.arange(n), pieces)
        first = np.cumsum(pieces) - pieces
        k = np.arange(idx.size, dtype=np.int64) - np.repeat(first, pieces)
        off = k * max_bytes
        length = np.minimum(ln[idx] - off, max_bytes)
        return CopyPlan(
            (self.src.astype(np.int64)[idx] + off).astype(_U64),
            (self.dst.astype(np.int64)[idx] + off).astype(_U64),
            length.astype(_U64),
        )


def merge_copies(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> CopyPlan:
    """Merge consecutive copies (in the given order) that are contiguous on both sides."""
    src = np.asarray(src, dtype=_U64).reshape(-1)
    dst = np.asarray(dst, dtype=_U64).reshape(-1)
    length = np.asarray(length, dtype=_U64).reshape(-1)
    if length.size <= 1:
        return CopyPlan(src, dst, length)
    joins = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return CopyPlan(src[starts], dst[starts],
                    np.add.reduceat(length, starts).astype(_U64))


@dataclass(frozen=True)
class StagedPlan:
    """A staged transfer: NIXL moves ``transfer`` (local side = staging), the caller runs
    ``copies`` locally -- after the transfer for READ, before it for WRITE."""

    transfer: DescPlan
    copies: CopyPlan
    staging_bytes: int
    op: str


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def stage(plan: DescPlan, staging_base: int, *, op: str = "READ",
          staging_dev: int | None = None, staging_bytes: int | None = None,
          max_gap: int = 0, remote_ranges: Sequence[tuple[int, int]] | None = None
          ) -> StagedPlan:
    """Route ``plan`` through a staging buffer at ``staging_base`` (registered with NIXL like
    any local memory).

    Pairs are laid out in the staging buffer in remote-address order, so remote-contiguous runs
    become one descriptor each; ``copies`` move staging <-> the plan's local addresses.  A plan
    whose remote ranges overlap (a WRITE that lands twice) is refused.

    ``max_gap`` (READ only, needs the peer's registered ``remote_ranges``): also read across
    gaps of up to ``max_gap`` unrequested bytes inside one registered range, so nearby blocks
    share a descriptor.  Worth it while a gap costs less wire time than a descriptor:
    :meth:`TransportCost.gap_budget` of the measured transport (3-7 MiB between two
    processes on one H100/H200 over cuda_ipc); the gap bytes land in staging only
    and are never copied out.  Never for WRITE, which would overwrite other blocks.  When
    ``staging_bytes`` is too small for the gaps, the allowed gap is halved until it fits.
    """
    _check_op(op)
    if max_gap and op != "READ":
        raise KVPlanError("max_gap reads unrequested bytes; it is for READ only")
    if max_gap and remote_ranges is None:
        raise KVPlanError("max_gap needs the peer's registered remote_ranges")
    n = len(plan)
    ra = plan.remote_addr.astype(_U64)
    ln = plan.length.astype(_U64)
    order = np.argsort(ra, kind="stable")
    ra_o, ln_o = ra[order], ln[order]
    ends = ra_o + ln_o
    if n > 1 and bool(np.any(ra_o[1:] < ends[:-1])):
        raise KVPlanError("remote ranges of the plan overlap; staging needs disjoint ranges")
    need = int(ln_o.sum(dtype=_U64))
    if staging_bytes is not None and need > staging_bytes:
        raise KVPlanError(f"request needs {need} B of staging, only {staging_bytes} B exist")
    start_i, end_i = ra_o.astype(np.int64), ends.astype(np.int64)
    joinable = start_i[1:] == end_i[:-1]
    if max_gap and n > 1:
        rid = range_ids(start_i, end_i, remote_ranges)
        joinable |= (rid[1:] == rid[:-1]) & (rid[1:] >= 0)
    first, last, _ = read_spans(start_i, end_i, joinable, max_gap, staging_bytes)
    span_len, span_off, row_off = span_layout(start_i, end_i, first, last)
    total = int(span_len.sum())
    st = (staging_base + row_off).astype(_U64)
    dev = plan.local_dev if staging_dev is None else staging_dev
    transfer = DescPlan((staging_base + span_off).astype(_U64), ra_o[first],
                        span_len.astype(_U64), dev, plan.remote_dev)
    la_o = plan.local_addr.astype(_U64)[order]
    copies = merge_copies(st, la_o, ln_o) if op == "READ" else merge_copies(la_o, st, ln_o)
    return StagedPlan(transfer, copies, total, op)


def range_ids(start: np.ndarray, end: np.ndarray, ranges: Sequence[tuple[int, int]]
              ) -> np.ndarray:
    """Which of ``ranges`` (disjoint ``[start, end)``) holds each ``[start[i], end[i])``; -1
    for one that no range holds whole."""
    bounds = sorted((int(s), int(e)) for s, e in ranges)
    starts_r = np.asarray([s for s, _ in bounds], dtype=np.int64)
    ends_r = np.asarray([e for _, e in bounds], dtype=np.int64)
    ri = np.searchsorted(starts_r, start, side="right") - 1
    inside = (ri >= 0) & (end <= (ends_r[np.maximum(ri, 0)] if ends_r.size else 0))
    return np.where(inside, ri, -1)


def read_spans(start: np.ndarray, end: np.ndarray, joinable: np.ndarray, max_gap: int,
               limit: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """Group address-sorted ranges ``[start[i], end[i])`` into READs: range ``i + 1`` joins
    range ``i``'s READ when ``joinable[i]`` and at most ``max_gap`` bytes lie between them.
    While the READs' bytes exceed ``limit``, the gap is halved (a gap of 0 adds no bytes).

    Returns the index of each READ's first and last range, and the gap used."""
    n = start.size
    gap = start[1:] - end[:-1]
    while True:
        join = joinable & (gap >= 0) & (gap <= max_gap)
        first = np.flatnonzero(np.concatenate(([True], ~join))) if n else np.empty(0, np.int64)
        last = np.concatenate((first[1:], [n])) - 1 if n else first
        total = int((end[last] - start[first]).sum())
        if limit is None or total <= limit or max_gap == 0:
            return first, last, max_gap
        max_gap //= 2


def span_layout(start: np.ndarray, end: np.ndarray, first: np.ndarray, last: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Staging for the READs :func:`read_spans` made of ranges ``[start[i], end[i])``, laid
    back to back: each READ's length and staging offset, and each range's staging offset
    (its address less its READ's start, plus that READ's offset)."""
    length = end[last] - start[first]
    span_off = np.cumsum(length) - length
    return length, span_off, start - np.repeat(start[first] - span_off, last - first + 1)


class TransportCost(NamedTuple):
    """What one READ costs on a transport: a fixed price per descriptor plus wire time.

    Measured, not assumed: between two processes on one H100/H200 (cuda_ipc) a descriptor
    costs about 3 µs and one large descriptor moves over 1 TB/s; over TCP or an RDMA NIC both
    figures differ by orders of magnitude, and so does the gap worth reading.
    """

    desc_cost_s: float
    bandwidth_bps: float  # bytes per second

    @classmethod
    def from_timings(cls, a: tuple[int, int, float], b: tuple[int, int, float]
                     ) -> TransportCost:
        """Solve ``seconds = descs * desc_cost + bytes / bandwidth`` from two READs given as
        ``(descs, bytes, seconds)``: one of many small descriptors, one of few large ones."""
        (d1, b1, t1), (d2, b2, t2) = a, b
        det = d1 * b2 - d2 * b1
        if det == 0 or min(t1, t2) <= 0:
            raise ValueError(f"two independent READs with positive times needed, got {a}, {b}")
        inv_bw = (d1 * t2 - d2 * t1) / det
        if inv_bw <= 0:
            raise ValueError(f"timings {a}, {b} imply no positive bandwidth")
        return cls(max((t1 * b2 - t2 * b1) / det, 0.0), 1.0 / inv_bw)

    @classmethod
    def from_reads(cls, spaced: tuple[int, int, float], one: tuple[int, int, float],
                   big: tuple[int, int, float]) -> TransportCost:
        """The cost from three READs given as ``(descs, bytes, seconds)``: ``spaced`` and
        ``one`` move the same bytes in many descriptors and in one, so their difference is
        the descriptors' cost alone (what a READ costs to post and poll cancels); ``big``, one
        descriptor of many bytes, bounds the bandwidth from below, since its time includes
        that fixed cost.  So the gap budget errs small, the cheap side: a gap left unread
        costs one descriptor, a gap read in vain costs its wire time in every READ.  (A
        least-squares fit with a fixed-cost term, on 32 and 64 MiB READs of 20-40 us over
        cuda_ipc, gave an H200 budgets of 8 MiB to 1 GiB where 512 MiB READs give 3-9 MiB:
        those READs differ by a few microseconds, which is noise.)"""
        (d1, b1, t1), (d2, b2, t2), (_, b3, t3) = spaced, one, big
        if b1 != b2 or d1 <= d2:
            raise ValueError(f"spaced {spaced} and one {one} must move the same bytes in more "
                             "descriptors and in fewer")
        if min(t1, t2, t3) <= 0 or b3 <= 0:
            raise ValueError(f"READ times and bytes must be positive: {spaced}, {one}, {big}")
        return cls(max((t1 - t2) / (d1 - d2), 0.0), b3 / t3)

    def gap_budget(self) -> int:
        """The largest gap of unrequested bytes that is cheaper to read than to skip: skipping
        it costs one more descriptor, reading it costs its wire time.  This is the
        ``max_gap`` for :func:`stage`."""
        return max(int(self.desc_cost_s * self.bandwidth_bps), 0)


def split_staged(staged: StagedPlan, parts: int) -> list[StagedPlan]:
    """Cut a staged transfer into up to ``parts`` pieces of about equal bytes, each with the
    copies of its own staging range, so the copy of piece ``i`` can run while NIXL still moves
    piece ``i + 1`` (READ: wait for piece i, then copy it out; WRITE: copy piece i in, then
    post it).  Copies that straddle a cut are clipped at it."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    t = staged.transfer
    n = len(t)
    if n == 0 or parts == 1:
        return [staged]
    cum = np.cumsum(t.length.astype(np.int64))
    total = int(cum[-1])
    cuts = np.searchsorted(cum, [total * (i + 1) / parts for i in range(parts - 1)],
                           side="left") + 1
    bounds = np.unique(np.concatenate(([0], np.minimum(cuts, n), [n])))
    out = []
    on_src = staged.op == "READ"  # the staging side of each copy
    c_st = (staged.copies.src if on_src else staged.copies.dst).astype(np.int64)
    c_ot = (staged.copies.dst if on_src else staged.copies.src).astype(np.int64)
    c_ln = staged.copies.length.astype(np.int64)
    for lo, hi in itertools.pairwise(bounds.tolist()):
        if hi <= lo:
            continue
        piece = DescPlan(t.local_addr[lo:hi], t.remote_addr[lo:hi], t.length[lo:hi],
                         t.local_dev, t.remote_dev)
        gs = int(t.local_addr[lo])
        ge = int(t.local_addr[hi - 1]) + int(t.length[hi - 1])
        start = np.maximum(c_st, gs)
        end = np.minimum(c_st + c_ln, ge)
        keep = end > start
        st_a = start[keep]
        ot_a = c_ot[keep] + (st_a - c_st[keep])
        ln_a = (end - start)[keep]
        src, dst = (st_a, ot_a) if on_src else (ot_a, st_a)
        out.append(StagedPlan(piece, CopyPlan(src.astype(_U64), dst.astype(_U64),
                                              ln_a.astype(_U64)),
                              int(piece.length.sum(dtype=_U64)), staged.op))
    return out


# ------------------------------------------------------------------ vLLM form: tables + ids
def staging_table(staging_base: int, slot_len: int, num_slots: int, dev: int = 0) -> np.ndarray:
    """Nx3 descriptors of ``num_slots`` equal, back-to-back staging slots (prepared once)."""
    out = np.empty((num_slots, 3), dtype=_U64)
    out[:, 0] = staging_base + np.arange(num_slots, dtype=np.int64) * slot_len
    out[:, 1] = slot_len
    out[:, 2] = dev
    return out


@dataclass(frozen=True)
class StagedIds:
    """Per-request ids for ``make_prepped_xfer(op, staging, staging_ids, remote, remote_ids)``
    and the local copies (see :class:`StagedPlan` for when to run them)."""

    staging_ids: np.ndarray
    remote_ids: np.ndarray
    copies: CopyPlan
    op: str


def stage_ids(local_table: np.ndarray, remote_table: np.ndarray, local_ids: np.ndarray,
              remote_ids: np.ndarray, staging_base: int, slot_len: int, num_slots: int, *,
              op: str = "READ") -> StagedIds:
    """Staged form of a request given as desc ids into vLLM-style Nx3 tables.

    Every selected descriptor must be ``slot_len`` bytes (one K or V segment, or a head slice
    of it).  Staging slot ``i`` receives the ``i``-th pair in remote-address order, so NIXL
    merges remote-contiguous runs (the staging side is always contiguous).
    """
    _check_op(op)
    lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if lid.size != rid.size:
        raise KVPlanError(f"{lid.size} local ids vs {rid.size} remote ids")
    if lid.size > num_slots:
        raise KVPlanError(f"request has {lid.size} descriptors, staging has {num_slots} slots")
    if lid.size == 0:
        empty = np.empty(0, dtype=_U64)
        return StagedIds(np.empty(0, dtype=np.int64), rid, CopyPlan(empty, empty, empty), op)
    lens = remote_table[rid, 1]
    if not (np.all(lens == slot_len) and np.all(local_table[lid, 1] == slot_len)):
        raise KVPlanError(f"staging slots are {slot_len} B but the request's descriptors are "
                          f"{sorted(set(lens.tolist()))} B")
    order = np.argsort(remote_table[rid, 0], kind="stable")
    slots = np.arange(lid.size, dtype=np.int64)
    st = (np.uint64(staging_base) + slots.astype(_U64) * np.uint64(slot_len)).astype(_U64)
    la = local_table[lid[order], 0].astype(_U64)
    ln = np.full(lid.size, slot_len, dtype=_U64)
    copies = merge_copies(st, la, ln) if op == "READ" else merge_copies(la, st, ln)
    return StagedIds(slots, rid[order], copies, op)


def whole_blocks(geo: KVGeometry) -> KVGeometry:
    """The same memory described as one ``[K|V]`` segment per block (fused and packed layers).

    For the same-layout fused path only (no head slicing: a whole block is not a head slice):
    its tables then have one entry per block, consecutive blocks being consecutive, contiguous
    entries.  A split layer has no whole-block range and is refused.
    """
    layers = []
    for li, la in enumerate(geo.layers):
        if la.kind == KIND_PACKED:
            layers.append(la)
            continue
        if la.kind != KIND_FUSED:
            raise KVPlanError(f"layer {li} is {la.kind}: K and V are not one range per block")
        k, v = la.segments
        layers.append(LayerGeometry(la.base + k.offset, la.block_stride, la.num_blocks,
                                    (Segment(ROLE_KV, 0, k.length + v.length),),
                                    capacity=la.capacity))
    return KVGeometry(tuple(layers), geo.device_id, geo.label)


def nixl_merged_count(local_table: np.ndarray, remote_table: np.ndarray,
                      local_ids: np.ndarray, remote_ids: np.ndarray) -> int:
    """The ``descCount`` NIXL will post for a request over prepared Nx3 tables: a pair joins
    the previous one when both ids are the previous ids + 1 and both ranges continue the
    previous ranges in memory (inside one registration: NIXL does not join two).  For a
    per-request list (ids ``0..n-1``) this is the number of both-side-contiguous runs,
    :func:`merge_copies`."""
    lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if lid.size <= 1:
        return int(lid.size)
    la = local_table[lid, 0].astype(np.int64)
    ra = remote_table[rid, 0].astype(np.int64)
    ln = local_table[lid, 1].astype(np.int64)
    joins = ((lid[1:] == lid[:-1] + 1) & (rid[1:] == rid[:-1] + 1)
             & (la[1:] == la[:-1] + ln[:-1]) & (ra[1:] == ra[:-1] + ln[:-1]))
    return int(lid.size - int(joins.sum()))
