"""One staged READ: how it is planned (:class:`ReadPlanner`), its state from posting to the end
of its gather (:class:`StagedRead`), why a request is not staged (:class:`NotStaged`), and what
an agent's staged READs did (:class:`StagingStats`)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdpatch.kv.staging.calibration import GapCalibration
from pdpatch.kv.staging.chunked import LANES, ChunkedRead, ChunkRuns
from pdpatch.kv.staging.lists import prep_rows
from pdpatch.kv.staging.nixl_states import INIT_AGENT
from pdpatch.kv.staging.plans import (
    CopyPlan,
    chunk_bounds,
    chunk_descriptors,
    lane_rows_to_try,
    pack_spans,
    range_ids,
    read_spans,
    span_layout,
)
from pdpatch.kv.staging.rows import (
    SortedTwin,
    Spans,
    StagedPeer,
    address_order,
    posted_descriptors,
)
from pdpatch.log import logger

if TYPE_CHECKING:
    from pdpatch.kv.staging.buffer import StagingBuffer
    from pdpatch.kv.staging.lists import PreparedLists

# Stage a READ only when it posts at most this fraction of vLLM's descriptors.
MAX_STAGED_FRACTION = 0.75
FEW_SAVED = ("staging saves under a quarter of the descriptors vLLM's READ posts (NIXL merges "
             "its runs of blocks already, as on vLLM 0.33+'s strided lists, or the blocks lie "
             "far apart, or they are head slices of K and V)")
# Stage a READ only when vLLM's descriptors average under this many bytes.  Below it vLLM's
# READ is bound by its descriptors (NIXL's ~10 us each on an H200): 16-64 KiB per block and
# layer or head slice, where staging took 0.01-0.2x of its time (runs at-cp).  Above it, its
# READ moves bytes at NIXL's pace and staging only adds its gather and the chunk driver's
# host work per chunk: a kvcached pool's 2 MiB pages (1.5-3.2 MiB per descriptor) read in
# 32 MiB chunks took 2-6x of vLLM's own READ into that pool (runs cn, cu, cv).
BYTE_BOUND = 256 << 10
BYTES_BOUND = (f"vLLM's READ moves {BYTE_BOUND >> 10} KiB or more per descriptor: bound by "
               "bytes, not by descriptors (a kvcached pool's pages, or runs of blocks NIXL "
               "merges)")
# A chunked READ takes at most 1/CHUNKED_SHARE of the staging buffer, so that as many run at
# once (vLLM posts every request of a step together); its lanes shrink to 1/LANE_SHRINK of
# that while other READs hold staging, no further: each chunk is one more NIXL READ.
CHUNKED_SHARE = 2
LANE_SHRINK = 16
# A READ of more runs than this takes ids into the peer's address-ordered twin rather than
# lists of its own runs: preparing a list costs ~0.3 us per row and side (NIXL, CPU), so a
# READ of a run per row (head slices) would prepare as many rows as it posts, every time.
RUN_LIST_MAX = 4096


def spans_of(start: np.ndarray, slot: int, joinable: np.ndarray, gap: int,
             limit: int | None) -> Spans:
    """The spans of a READ of address-sorted rows at ``start`` (``slot`` bytes each):
    :func:`~.plans.read_spans` laid out back to back in staging (gap 0: one per run)."""
    end = start + slot
    first, last, _ = read_spans(start, end, joinable, gap, limit)
    return Spans(start[first], *span_layout(start, end, first, last))


class NotStaged(Exception):
    """Why one request goes the per-segment way (counted, logged once per reason)."""


@dataclass
class StagedRead:
    """One staged READ: its staging range and the gather that follows it."""

    start: int
    nbytes: int
    local_addr: np.ndarray     # destination of staging slot i (the peer's address order)
    slot: int
    peer: str
    stock: int                 # descriptors vLLM's own READ would have posted
    staged: int                # descriptors the staged READ posts
    dev: int                   # the device id of the local lists (and of staging)
    spans: Spans | None = None                  # its runs (or gap spans) of the peer
    dlists: tuple = ()                           # the spans' own lists, freed with it
    ids: tuple | None = None                     # else: slot list, slot ids, twin, twin ids
    ops: list = field(default_factory=list)      # prepared gather, alive until it has run
    failure: Exception | None = None             # planning the gather failed
    event: Any = None
    landed: bool = False

    @property
    def requested(self) -> int:
        """The bytes the request asked for (a gap READ reads more: ``nbytes``)."""
        return self.slot * self.local_addr.size

    @property
    def gap_bytes(self) -> int:
        """The unrequested bytes it reads between requested rows."""
        return self.nbytes - self.requested

    def gather(self, base: int) -> CopyPlan:
        """Staging (its buffer at address ``base``) -> the KV cache, one copy per row."""
        n = self.local_addr.size
        offset = self.spans.offset if self.spans is not None else \
            np.arange(n, dtype=np.int64) * self.slot
        # not merged here: the copier merges a plan itself before it places the copies
        return CopyPlan(base + self.start + offset, self.local_addr,
                        np.full(n, self.slot, dtype=np.int64))


@dataclass
class StagingStats:
    staged_reads: int = 0
    staged_bytes: int = 0
    gap_reads: int = 0              # staged READs that also read unrequested bytes
    gap_bytes: int = 0              # those unrequested bytes (they stay in staging)
    gap_budgets: dict = field(default_factory=dict)   # peer -> bytes, once calibrated
    calibration_bytes: int = 0      # read from peers to measure their transport
    descriptors_stock: int = 0      # what the same READs would have posted unstaged
    descriptors_staged: int = 0
    gather_failures: int = 0
    chunked_reads: int = 0          # staged READs larger than the free staging, in chunks
    chunks: int = 0                 # their chunk READs
    chunk_failures: int = 0         # chunked READs that ended ERR
    not_staged: Counter = field(default_factory=Counter)   # reason -> requests

    def posted(self, read: StagedRead | ChunkedRead) -> bool:
        """Count a staged READ handed to NIXL; True for the first one."""
        first = self.staged_reads == 0
        self.staged_reads += 1
        self.descriptors_stock += read.stock
        self.descriptors_staged += read.staged
        if isinstance(read, ChunkedRead):
            self.staged_bytes += read.nbytes
            self.chunked_reads += 1
            self.chunks += read.bounds.size - 1
        else:
            self.staged_bytes += read.requested
        if read.gap_bytes:
            self.gap_reads += 1
            self.gap_bytes += read.gap_bytes
        return first


class ReadPlanner(GapCalibration):
    """Plans a staging agent's READs from converted peers: checks that a request can be
    staged, reserves its staging, and picks a gap READ where one saves descriptors (measuring
    the peer's gap budget first, :class:`GapCalibration`).  Shares the agent's NIXL agent,
    staging buffer, lists, lock and stats."""

    def __init__(self, agent: Any, *, mem_type: str, staging: StagingBuffer,
                 lists: PreparedLists, lock: Any, stats: StagingStats, gap: int | None,
                 capacity_setting: str, gap_setting: str) -> None:
        self._agent = agent
        self._mem_type = mem_type
        self._staging = staging
        self._lists = lists
        self._lock = lock
        self.stats = stats
        self._gap = gap
        self._capacity_setting = capacity_setting
        self._gap_setting = gap_setting

    def plan(self, lh: Any, local_ids: Any, peer: StagedPeer, remote_ids: Any
             ) -> StagedRead | ChunkedRead:
        """The peer's rows in address order and where each lands in staging: all NIXL needs
        to start.  A READ of few runs (and a gap READ) posts lists of its own spans
        (:meth:`own_lists`), one of many runs ids into the peer's twin.  A request larger
        than the free staging is a :class:`ChunkedRead`.  :class:`NotStaged` says why a
        request cannot be staged."""
        capacity = self._staging.capacity
        if capacity <= 0:
            raise NotStaged("no staging buffer could be made")
        ltab, rtab = self._lists.table(lh), peer.table
        if ltab is None:
            raise NotStaged("the local descriptor list was prepared before staging was set up")
        lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
        rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
        if lid.size == 0 or lid.size != rid.size:
            raise NotStaged("empty request, or local and remote id lists of unequal length")
        slot = ltab.length
        if slot is None or slot != rtab.length:
            raise NotStaged("descriptors of unequal lengths")
        need = slot * lid.size
        if LANES * slot > capacity:
            raise NotStaged(f"a descriptor of {slot} B does not fit {LANES} times in the "
                            f"{capacity} B staging buffer (raise {self._capacity_setting})")
        self._staging.ensure()
        if not self._staging.covers(ltab.addr[lid], slot):
            raise NotStaged("the local list points outside the KV memory staging copies into")
        addr = rtab.addr[rid]
        order = address_order(addr, rid)
        start = addr[order]
        stock = posted_descriptors(lid, rid, ltab, rtab)
        if need >= BYTE_BOUND * stock:
            raise NotStaged(BYTES_BOUND)
        rng = None if peer.ranges is None else range_ids(start, start + slot, peer.ranges)
        contiguous = start[1:] == start[:-1] + slot
        joins = contiguous if rng is None else \
            contiguous & (rng[1:] == rng[:-1]) & (rng[1:] >= 0)
        runs = lid.size - int(np.count_nonzero(joins))
        local_addr = ltab.addr[lid[order]]
        spans, at = None, None
        if rng is not None:
            self._staging.register(ltab.dev)
            worth = self._gap_worth(peer, rng, runs, slot, ltab.dev)
            if need <= capacity:    # a gap READ in one piece, where one saves descriptors
                spans = self._gap_spans(start, slot, runs, worth)
                if spans is not None and spans.posted <= MAX_STAGED_FRACTION * stock \
                        and spans.posted <= RUN_LIST_MAX:
                    at = self._staging.reserve(spans.nbytes, slot)
            if at is None:
                spans = None
                # larger than the buffer, or the gaps shrunk to fit it merge too little, or
                # other READs hold its room: a gap READ in chunks (None where it saves little)
                gapped = self._gap_chunked(peer, start, slot, runs, stock, local_addr,
                                           ltab.dev, worth)
                if gapped is not None:
                    return gapped
        r_ids = None
        if at is None and (rng is None or runs > RUN_LIST_MAX):
            if runs > MAX_STAGED_FRACTION * stock:
                raise NotStaged(FEW_SAVED)      # before the twin: it would merge no more
            # NIXL merges what it may itself (it knows the registrations), in the twin
            r_ids = self._twin(peer).position[rid[order]]
            joins = contiguous & (r_ids[1:] == r_ids[:-1] + 1)
            runs = lid.size - int(np.count_nonzero(joins))
        self._staging.register(ltab.dev)
        if at is None:              # no gap READ, or other READs hold the room its gaps need
            if runs > MAX_STAGED_FRACTION * stock:
                # the gather would cost more than the few descriptors it saves (measured:
                # 256 KiB isolated blocks from a split peer, 881 of 1024 descriptors, 0.6x)
                raise NotStaged(FEW_SAVED)
            if need <= capacity:
                at = self._staging.reserve(need, slot)
            if at is None:          # larger than the buffer, or than its free room: chunks
                return self._chunked(peer, joins, start, r_ids, local_addr, slot, ltab.dev,
                                     stock)
            if r_ids is None:                 # one span per run
                spans = spans_of(start, slot, joins, 0, None)
        read = StagedRead(at, need if spans is None else spans.nbytes, local_addr, slot,
                          peer.name, stock, runs if spans is None else spans.posted, ltab.dev,
                          spans)
        if r_ids is not None:
            read.ids = (self._staging.slot_list(slot, ltab.dev),
                        at // slot + np.arange(lid.size, dtype=np.int64),
                        peer.twin.handle, r_ids)
        return read

    def _chunked(self, peer: StagedPeer, joins: np.ndarray, start: np.ndarray,
                 r_ids: np.ndarray | None, local_addr: np.ndarray, slot: int, dev: int,
                 stock: int) -> ChunkedRead:
        """A READ staged in chunks through :data:`~.chunked.LANES` lanes of the staging
        buffer, as large as the free room allows (:func:`~.plans.lane_rows_to_try`)."""
        held = self._lanes_for(start.size, slot)
        if held is None:
            raise NotStaged("the staging buffer is full with other requests' READs")
        lanes, rows = held
        bounds = chunk_bounds(start.size, rows)
        staged = int(chunk_descriptors(joins, bounds).sum())
        if staged > MAX_STAGED_FRACTION * stock:
            # chunks too small to hold the runs
            self._free_lanes(lanes, rows * slot)
            raise NotStaged("staging saves under a quarter of the descriptors (chunks of "
                            "the staging buffer cut the runs of blocks)")
        read = ChunkedRead(peer.name, peer.agent_name, slot, dev, stock, staged, local_addr,
                           lanes, rows * slot, bounds)
        if r_ids is None:
            read.runs = ChunkRuns.of(start, slot, joins, bounds)
        else:
            read.twin_ids = (self._staging.slot_list(slot, dev), peer.twin.handle, r_ids)
        return read

    def _gap_chunked(self, peer: StagedPeer, start: np.ndarray, slot: int, runs: int,
                     stock: int, local_addr: np.ndarray, dev: int,
                     worth: tuple[np.ndarray, int] | None) -> ChunkedRead | None:
        """A gap READ larger than the staging buffer, in chunks (:func:`~.plans.pack_spans`),
        where it posts fewer descriptors than the request's runs -- and no more than
        :data:`MAX_STAGED_FRACTION` of vLLM's, or :data:`RUN_LIST_MAX` (each chunk prepares a
        list of its lane's pieces); else None, and the READ is planned as before.

        Why: head slices (D's TP above P's) are one run per row, so a large request staged
        row by row posts as many descriptors as vLLM's own READ: 1.25 GiB of a 70B TP-2 rank's
        8,000-token request took 0.27-0.39 s on an H200 (runs ay, ba), descriptor-bound."""
        if worth is None:
            return None
        apart, gap = worth
        first, last, _ = read_spans(start, start + slot, ~apart, gap, None)
        # lanes sized for the bytes the gap READ moves, not only the requested rows: a request
        # that fits the buffer but whose gaps do not is then two chunks, not many
        spanned = int((start[last] + slot - start[first]).sum())
        held = self._lanes_for(max(start.size, -(-spanned // slot)), slot)
        if held is None:
            return None
        lanes, rows = held
        lane = rows * slot
        if gap > lane // 2:         # a gap is read only inside a lane: none wider than half
            first, last, _ = read_spans(start, start + slot, ~apart, lane // 2, None)
        packed = pack_spans(start, slot, first, last, lane)
        pieces = int(packed.start.size)
        if pieces >= runs or pieces > MAX_STAGED_FRACTION * stock or pieces > RUN_LIST_MAX:
            self._free_lanes(lanes, lane)
            return None
        read = ChunkedRead(peer.name, peer.agent_name, slot, dev, stock, pieces, local_addr,
                           lanes, lane, packed.bounds)
        read.runs = ChunkRuns(packed.first, packed.start, packed.length, packed.lane_off)
        read.row_off = packed.row_off
        return read

    def _gap_worth(self, peer: StagedPeer, rng: np.ndarray, runs: int, slot: int, dev: int
                   ) -> tuple[np.ndarray, int] | None:
        """Where rows may join across gaps (between rows of one read range), and the peer's
        gap budget, when a gap READ could post fewer descriptors than the request's ``runs``;
        else None.  A gap READ still posts one descriptor per read range it touches (and per
        row outside them): where the runs are no more, the transport need not be measured."""
        apart = (rng[1:] != rng[:-1]) | (rng[1:] < 0)
        if runs <= 1 + int(np.count_nonzero(apart)):
            return None
        gap = self._gap_for(peer, slot, dev)
        return (apart, gap) if gap > 0 else None

    def _lanes_for(self, rows: int, slot: int) -> tuple[list[int], int] | None:
        """:data:`~.chunked.LANES` lanes for a chunked READ of ``rows`` rows of ``slot``
        bytes, as large as the free room allows (:func:`~.plans.lane_rows_to_try`), and the
        rows each holds; None while other READs hold the room."""
        for per_lane in lane_rows_to_try(rows, slot, self._staging.capacity, LANES,
                                         LANE_SHRINK, CHUNKED_SHARE):
            lanes = self._reserve_lanes(per_lane * slot, slot)
            if lanes is not None:
                return lanes, per_lane
        return None

    def _reserve_lanes(self, nbytes: int, slot: int) -> list[int] | None:
        """:data:`~.chunked.LANES` ranges of ``nbytes``, all held, or none."""
        lanes: list[int] = []
        for _ in range(LANES):
            start = self._staging.reserve(nbytes, slot)
            if start is None:
                self._free_lanes(lanes, nbytes)
                return None
            lanes.append(start)
        return lanes

    def _free_lanes(self, lanes: list[int], nbytes: int) -> None:
        for at in lanes:
            self._staging.free(at, nbytes)

    def _twin(self, peer: StagedPeer) -> SortedTwin:
        """The peer's twin, prepared at the first READ that needs it (:class:`NotStaged`
        for good when NIXL would not prepare it)."""
        if peer.twin is not None:
            return peer.twin
        if peer.twin_failure is not None:
            raise NotStaged(peer.twin_failure)
        t0 = time.perf_counter()
        table = peer.table
        order = np.argsort(table.addr, kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        try:
            handle = prep_rows(self._agent, peer.agent_name, table.addr[order],
                               np.full(order.size, table.length), table.dev, self._mem_type)
        except Exception as exc:
            peer.twin_failure = (f"the peer's list could not be prepared in address order "
                                 f"({type(exc).__name__}: {exc})")
            logger.warning("pdpatch kv_segments: READs from %s go per segment: %s", peer.name,
                           peer.twin_failure)
            raise NotStaged(peer.twin_failure) from None
        peer.twin = SortedTwin(handle, position)
        logger.info("pdpatch kv_segments: %s's %d descriptors prepared in address order for "
                    "READs of many runs%s, in %.0f ms", peer.name, order.size,
                    "" if peer.ranges is not None else " (its memory's ranges are unknown)",
                    (time.perf_counter() - t0) * 1e3)
        return peer.twin

    def _gap_spans(self, start: np.ndarray, slot: int, runs: int,
                   worth: tuple[np.ndarray, int] | None) -> Spans | None:
        """The gap READ for address-sorted rows at ``start`` (``worth``: :meth:`_gap_worth`),
        when it posts fewer descriptors than their ``runs`` and fits the staging buffer; else
        None."""
        if worth is None:
            return None
        apart, gap = worth
        # (the gap is halved until the spans fit; at 0 they are the request, which fits)
        spans = spans_of(start, slot, ~apart, gap, self._staging.capacity)
        return spans if spans.posted < runs else None

    def own_lists(self, peer: StagedPeer, read: StagedRead | ChunkedRead) -> None:
        """Prepare the lists of a READ's own spans: for a staged READ both sides (the peer's
        spans, and back-to-back staging ranges of the same lengths), for a chunked one the
        peer's side (each chunk prepares its lane's when posted).  NIXL checks each span
        against the peer's registrations here: an exception means a span crosses one."""
        if isinstance(read, ChunkedRead):
            if read.runs is not None:
                read.runs.handle = prep_rows(self._agent, peer.agent_name, read.runs.start,
                                             read.runs.length, peer.table.dev, self._mem_type)
            return
        sp = read.spans
        if sp is None:
            return
        lh = prep_rows(self._agent, INIT_AGENT, self._staging.base + read.start + sp.span_off,
                       sp.length, read.dev, self._mem_type)
        try:
            read.dlists = (lh, prep_rows(self._agent, peer.agent_name, sp.start, sp.length,
                                         peer.table.dev, self._mem_type))
        except BaseException:
            self._agent.release_dlist_handle(lh)
            raise
