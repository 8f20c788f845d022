"""One staged READ: how it is planned (:class:`ReadPlanner`), its state from posting to the end
of its gather (:class:`StagedRead`), why a request is not staged (:class:`NotStaged`), and what
an agent's staged READs did (:class:`StagingStats`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pdpatch import metrics
from pdpatch.kv.staging.calibration import GapCalibration
from pdpatch.kv.staging.chunked import LANES, ChunkedRead
from pdpatch.kv.staging.nixl_states import INIT_AGENT
from pdpatch.kv.staging.plans import (
    CopyPlan,
    chunk_bounds,
    chunk_descriptors,
    lane_rows_to_try,
    read_spans,
    span_layout,
)
from pdpatch.kv.staging.rows import SortedTwin, Spans, address_order, posted_descriptors

if TYPE_CHECKING:
    from pdpatch.kv.staging.buffer import StagingBuffer
    from pdpatch.kv.staging.lists import PreparedLists

# Stage a READ only when it posts at most this fraction of vLLM's descriptors.
MAX_STAGED_FRACTION = 0.75
# A chunked READ takes at most 1/CHUNKED_SHARE of the staging buffer, so that as many run at
# once (vLLM posts every request of a step together); its lanes shrink to 1/LANE_SHRINK of
# that while other READs hold staging, no further: each chunk is one more NIXL READ.
CHUNKED_SHARE = 2
LANE_SHRINK = 16


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
    spans: Spans | None = None                  # a gap READ: its spans of the peer
    dlists: tuple = ()                           # a gap READ's own lists, freed with it
    ops: list = field(default_factory=list)      # prepared gather, alive until it has run
    failure: Exception | None = None             # planning the gather failed
    event: Any = None
    landed: bool = False

    @property
    def requested(self) -> int:
        """The bytes the request asked for (a gap READ reads more: ``nbytes``)."""
        return self.slot * self.local_addr.size

    def gather(self, base: int) -> CopyPlan:
        """Staging (its buffer at address ``base``) -> the KV cache, one copy per row."""
        n = self.local_addr.size
        offset = self.spans.offset if self.spans is not None else \
            np.arange(n, dtype=np.int64) * self.slot
        # not merged first: the copier cuts every copy into rows of one size anyway
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

    def posted(self, read: StagedRead | ChunkedRead, agent: Any) -> bool:
        """Count a staged READ ``agent`` handed to NIXL (here and for ``/metrics``); True for
        the first one."""
        first = self.staged_reads == 0
        self.staged_reads += 1
        metrics.count(agent, metrics.STAGED_READS)
        metrics.count(agent, metrics.STAGED_READ_BYTES,
                      amount=read.nbytes if isinstance(read, ChunkedRead) else read.requested)
        self.descriptors_stock += read.stock
        self.descriptors_staged += read.staged
        if isinstance(read, ChunkedRead):
            self.staged_bytes += read.nbytes
            self.chunked_reads += 1
            self.chunks += read.bounds.size - 1
            return first
        self.staged_bytes += read.requested
        if read.spans is not None:
            self.gap_reads += 1
            self.gap_bytes += read.nbytes - read.requested
        return first


class ReadPlanner(GapCalibration):
    """Plans a staging agent's READs from converted peers: checks that a request can be
    staged, reserves its staging, and picks a gap READ where one saves descriptors (measuring
    the peer's gap budget first, :class:`GapCalibration`).  Shares the agent's NIXL agent,
    staging buffer, lists, lock and stats."""

    def __init__(self, agent: Any, *, mem_type: str, staging: StagingBuffer,
                 lists: PreparedLists, lock: Any, stats: StagingStats, gap: int | None,
                 capacity_setting: str, gap_setting: str,
                 direct_slow: Callable[[], bool] | None = None) -> None:
        self._agent = agent
        self._direct_slow = direct_slow
        self._slow: bool | None = None
        self._mem_type = mem_type
        self._staging = staging
        self._lists = lists
        self._lock = lock
        self.stats = stats
        self._gap = gap
        self._capacity_setting = capacity_setting
        self._gap_setting = gap_setting

    def plan(self, lh: Any, local_ids: Any, twin: SortedTwin, rh: Any, remote_ids: Any
             ) -> tuple[StagedRead, Any, np.ndarray, np.ndarray] | ChunkedRead:
        """Staging slots and the peer's rows in address order: all NIXL needs to start.
        For a gap READ the read carries its spans and own lists, and the slot list and ids
        are unused.  A request larger than the free staging is a :class:`ChunkedRead`.
        :class:`NotStaged` says why a request cannot be staged."""
        capacity = self._staging.capacity
        if capacity <= 0:
            raise NotStaged("no staging buffer could be made")
        ltab, rtab = self._lists.table(lh), self._lists.table(rh)
        if ltab is None or rtab is None:
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
        position = twin.position[rid]
        order = address_order(position, rid)
        r_ids = position[order]
        stock = posted_descriptors(lid, rid, ltab, rtab)
        joins = (r_ids[1:] == r_ids[:-1] + 1) & twin.table.contiguous_next[r_ids[:-1]]
        runs = lid.size - int(np.count_nonzero(joins))
        slot_handle = self._staging.slot_list(slot, ltab.dev)     # registers staging, too
        spans = self._spans(twin, r_ids, slot, runs, ltab.dev) if need <= capacity else None
        start = None
        if spans is not None and spans.posted <= MAX_STAGED_FRACTION * stock:
            start = self._staging.reserve(spans.nbytes, slot)
        if start is None:           # no gap READ, or other READs hold the room its gaps need
            spans = None
            if runs > MAX_STAGED_FRACTION * stock and not self.direct_slow():
                # the gather would cost more than the few descriptors it saves (measured:
                # 256 KiB isolated blocks from a split peer, 881 of 1024 descriptors, 0.6x)
                raise NotStaged("staging saves under a quarter of the descriptors (blocks "
                                "far apart, or head slices of K and V)")
            if need <= capacity:
                start = self._staging.reserve(need, slot)
            if start is None:       # larger than the buffer, or than its free room: chunks
                return self._chunked(twin, joins, r_ids, ltab.addr[lid[order]], slot,
                                     ltab.dev, stock, slot_handle)
        staged = runs if spans is None else spans.posted
        slot_ids = start // slot + np.arange(lid.size, dtype=np.int64)
        read = StagedRead(start, need if spans is None else spans.nbytes, ltab.addr[lid[order]],
                          slot, twin.peer, stock, staged, ltab.dev, spans)
        return read, slot_handle, slot_ids, r_ids

    def _chunked(self, twin: SortedTwin, joins: np.ndarray, r_ids: np.ndarray,
                 local_addr: np.ndarray, slot: int, dev: int, stock: int, slot_handle: Any
                 ) -> ChunkedRead:
        """A READ staged in chunks through :data:`~.chunked.LANES` lanes of the staging
        buffer, as large as the free room allows (:func:`~.plans.lane_rows_to_try`)."""
        rows, lanes = 0, None
        for rows in lane_rows_to_try(r_ids.size, slot, self._staging.capacity, LANES,
                                     LANE_SHRINK, CHUNKED_SHARE):
            lanes = self._reserve_lanes(rows * slot, slot)
            if lanes is not None:
                break
        if lanes is None:
            raise NotStaged("the staging buffer is full with other requests' READs")
        bounds = chunk_bounds(r_ids.size, rows)
        staged = int(chunk_descriptors(joins, bounds).sum())
        if staged > MAX_STAGED_FRACTION * stock and not self.direct_slow():
            # chunks too small to hold the runs
            for held in lanes:
                self._staging.free(held, rows * slot)
            raise NotStaged("staging saves under a quarter of the descriptors (chunks of "
                            "the staging buffer cut the runs of blocks)")
        return ChunkedRead(twin.peer, twin.agent_name, slot, dev, stock, staged, r_ids,
                           local_addr, lanes, rows * slot, bounds, slot_handle, twin.handle)

    def direct_slow(self) -> bool:
        """Whether READs straight into the local memory cross a slower transport than READs
        into staging (CUDA VMM memory without an IPC handle: TCP loopback, ~1 GB/s, where
        staging is device memory NIXL reads over cuda_ipc): then staging pays even when it
        merges few descriptors.  Asked once, at the first READ that saves few."""
        if self._slow is None:
            self._slow = bool(self._direct_slow and self._direct_slow())
        return self._slow

    def _reserve_lanes(self, nbytes: int, slot: int) -> list[int] | None:
        """:data:`~.chunked.LANES` ranges of ``nbytes``, all held, or none."""
        lanes: list[int] = []
        for _ in range(LANES):
            start = self._staging.reserve(nbytes, slot)
            if start is None:
                for held in lanes:
                    self._staging.free(held, nbytes)
                return None
            lanes.append(start)
        return lanes

    def _spans(self, twin: SortedTwin, r_ids: np.ndarray, slot: int, runs: int, dev: int
               ) -> Spans | None:
        """The gap READ for rows ``r_ids`` of the twin (address order), when it posts fewer
        descriptors than the twin's runs and fits the staging buffer; else None."""
        gap = self._gap_for(twin, slot, dev)
        if gap <= 0 or twin.range_id is None:
            return None
        start = twin.table.addr[r_ids]
        end = start + slot
        rng = twin.range_id[r_ids]
        joinable = (rng[1:] == rng[:-1]) & (rng[1:] >= 0)
        # (the gap is halved until the spans fit; at 0 they are the request, which fits)
        first, last, _ = read_spans(start, end, joinable, gap, self._staging.capacity)
        if first.size >= runs:
            return None
        return Spans(start[first], *span_layout(start, end, first, last))

    def span_lists(self, twin: SortedTwin, read: StagedRead) -> tuple[Any, Any]:
        """A gap READ's own lists: its spans of the peer, and back-to-back staging ranges of
        the same lengths (ids into prepared tables cannot describe a span that no row is)."""
        sp = read.spans
        lh = self._prep(INIT_AGENT, self._staging.base + read.start + sp.span_off, sp.length,
                        read.dev)
        try:
            return lh, self._prep(twin.agent_name, sp.start, sp.length, twin.table.dev)
        except BaseException:
            self._agent.release_dlist_handle(lh)
            raise

    def _prep(self, agent_name: Any, addr: np.ndarray, length: np.ndarray, dev: int) -> Any:
        rows = np.column_stack([addr, length, np.full(addr.size, dev)]).astype(np.uint64)
        return self._agent.prep_xfer_dlist(agent_name,
                                           self._agent.get_xfer_descs(rows, self._mem_type))
