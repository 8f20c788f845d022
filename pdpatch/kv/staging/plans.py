"""Staged K/V conversion: as few NIXL descriptors as the REMOTE layout allows, plus one local copy.

Why: with NIXL the cost of a transfer is mostly per descriptor (about 2.8 µs each on an H200 over
cuda_ipc), and NIXL merges two descriptor pairs of a request only when
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

Here are the pieces :class:`pdpatch.kv.staging.StagingAgent` stages a worker's READs with:
which registered range holds each remote range (:func:`range_ids`), READs grouped across gaps
(:func:`read_spans`) and laid out back to back in staging (:func:`span_layout`), the staging
table prepared once per slot length (:func:`staging_table`), the transport's price of a
descriptor and of a byte (:class:`TransportCost`), and the local copies (:class:`CopyPlan`).
The whole-plan forms the tests and the bench compare the agent with (``stage``, ``stage_ids``,
``split_staged``, ``whole_blocks``, ``nixl_merged_count``) are lab code:
``lab/kv_reference.py``.

Pure module: numpy only; the rest of :mod:`pdpatch.kv.staging` executes these plans.  The copy
itself is the caller's (a device kernel or host memmove) and is described by a
:class:`CopyPlan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

_U64 = np.uint64


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

    def merged(self) -> CopyPlan:
        """The same bytes in fewer copies: a copy that continues its predecessor on both sides
        joins it (a run of blocks lands as one copy per layer and side, not one per block)."""
        n = len(self)
        if n < 2:
            return self
        src, dst, ln = (np.asarray(a, dtype=np.int64) for a in (self.src, self.dst,
                                                               self.length))
        joins = (src[1:] == src[:-1] + ln[:-1]) & (dst[1:] == dst[:-1] + ln[:-1])
        if not bool(joins.any()):
            return self
        first = np.flatnonzero(np.r_[True, ~joins])
        return CopyPlan(src[first], dst[first], np.add.reduceat(ln, first))

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
        it costs one more descriptor, reading it costs its wire time: the largest gap a
        staged READ reads across."""
        return max(int(self.desc_cost_s * self.bandwidth_bps), 0)


# ------------------------------------------------------------------ vLLM form: tables + ids
def staging_table(staging_base: int, slot_len: int, num_slots: int, dev: int = 0) -> np.ndarray:
    """Nx3 descriptors of ``num_slots`` equal, back-to-back staging slots (prepared once)."""
    out = np.empty((num_slots, 3), dtype=_U64)
    out[:, 0] = staging_base + np.arange(num_slots, dtype=np.int64) * slot_len
    out[:, 1] = slot_len
    out[:, 2] = dev
    return out




# ------------------------------------------------------------------ chunked READs: the schedule
def chunk_rows(rows: int, slot: int, room: int, lanes: int) -> int:
    """Rows per chunk of a READ of ``rows`` rows of ``slot`` bytes staged through ``lanes``
    lanes that share ``room`` bytes: what one lane holds, but no more than an even share of the
    request, so that every lane carries a chunk (a request just over the room is two halves,
    not one full lane and a tail).  0 when a lane cannot hold one row."""
    if min(rows, slot, lanes) <= 0 or room < 0:
        raise ValueError(f"rows, slot and lanes must be > 0 and room >= 0, got {rows}, {slot}, "
                         f"{lanes}, {room}")
    return min(room // lanes // slot, -(-rows // lanes))


def lane_rows_to_try(rows: int, slot: int, capacity: int, lanes: int, shrink: int,
                     share: int) -> list[int]:
    """Chunk sizes (rows) a chunked READ asks the staging allocator for, largest first: the
    size :func:`chunk_rows` gives for ``1/share`` of the buffer (so that ``share`` chunked
    READs run at once; the whole buffer when that part cannot hold a row per lane), then
    halved while other READs hold part of it, down to ``1/shrink`` of the first (a lane at
    least one row).  Smaller chunks cost one NIXL READ each; below that floor the request goes
    the per-segment way."""
    first = chunk_rows(rows, slot, capacity // share, lanes) or \
        chunk_rows(rows, slot, capacity, lanes)
    if first == 0:
        return []
    floor = max(first // shrink, 1)
    out = [first]
    while out[-1] // 2 >= floor:
        out.append(out[-1] // 2)
    return out


def chunk_bounds(rows: int, per_chunk: int) -> np.ndarray:
    """The first row of each chunk of ``per_chunk`` rows, then ``rows``: chunk ``c`` is rows
    ``[bounds[c], bounds[c + 1])``, in the order they are read."""
    if rows <= 0 or per_chunk <= 0:
        raise ValueError(f"rows and per_chunk must be > 0, got {rows}, {per_chunk}")
    return np.append(np.arange(0, rows, per_chunk, dtype=np.int64), rows)


def chunk_descriptors(joins: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """NIXL descriptors of each chunk: its rows less the joins inside it.  ``joins[i]``: row
    ``i + 1`` continues row ``i`` in one descriptor (a chunk's edge cuts a run in two)."""
    inner = np.concatenate(([0], np.cumsum(joins, dtype=np.int64)))
    first, end = bounds[:-1], bounds[1:]
    return (end - first) - (inner[end - 1] - inner[first])


class PackedSpans(NamedTuple):
    """A gap READ too large for the staging buffer, cut into chunks of at most one lane:
    its pieces (each one descriptor of the peer's memory, in address order), chunk by chunk.
    ``bounds`` as :func:`chunk_bounds` gives them (rows in the peer's address order)."""

    bounds: np.ndarray         # chunk c = rows [bounds[c], bounds[c + 1])
    first: np.ndarray          # each piece's first row
    start: np.ndarray          # each piece's address in the peer's memory
    length: np.ndarray         # each piece's bytes (its rows and the gaps between them)
    lane_off: np.ndarray       # each piece's offset in its chunk's lane
    row_off: np.ndarray        # each row's offset in its chunk's lane


def pack_spans(start: np.ndarray, slot: int, first: np.ndarray, last: np.ndarray,
               lane: int) -> PackedSpans:
    """Cut the spans :func:`read_spans` made of address-sorted rows at ``start`` (``slot``
    bytes each; span ``k`` = rows ``first[k]..last[k]``) into pieces of at most ``lane`` bytes
    -- cut only where a row starts, the gap before it left unread -- and lay the pieces back
    to back in chunks of at most ``lane`` bytes, in address order.

    Why: a request larger than the staging buffer (head slices of a 1,500-token request at
    70B geometry, TP 1 -> 2: 15,040 rows of 16 KiB) read row by row posts one descriptor per
    row, ~4 us each on an H200; read across the gaps between its rows, a few descriptors per
    chunk move twice the bytes at ~1 TB/s."""
    if slot <= 0 or lane < slot:
        raise ValueError(f"a lane of {lane} B cannot hold a row of {slot} B")
    ends = start + slot
    p_first: list[int] = []
    for a, b in zip(first.tolist(), last.tolist(), strict=True):
        i = a
        while i <= b:
            p_first.append(i)
            # the last row of the span that ends within a lane of this piece's start
            i = int(np.searchsorted(ends[i:b + 1], start[i] + lane, side="right")) + i
    pf = np.asarray(p_first, dtype=np.int64)
    p_end = np.append(pf[1:], start.size)           # one past each piece's last row
    length = ends[p_end - 1] - start[pf]
    lane_off = np.empty_like(length)
    chunk_first: list[int] = []
    used = lane
    for k, n in enumerate(length.tolist()):
        if used + n > lane:
            chunk_first.append(int(pf[k]))
            used = 0
        lane_off[k] = used
        used += n
    rows_per_piece = p_end - pf
    row_off = start - np.repeat(start[pf] - lane_off, rows_per_piece)
    bounds = np.append(np.asarray(chunk_first, dtype=np.int64), start.size)
    return PackedSpans(bounds, pf, start[pf], length, lane_off, row_off)
