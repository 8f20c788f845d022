"""Staged READs inside a worker's NIXL agent, for peers whose K/V placement was converted.

Why: a converted peer pairs a contiguous run on one side with a strided run on the other, so
NIXL cannot merge anything and a READ costs one descriptor per block segment -- 0.04-1.1x of
the fused path on an H100/H200 (docs/gpu_results.md).  Staging (:mod:`pdpatch.kv.stage`)
turns the same request into a READ into a staging buffer laid out in the peer's address
order (remote-contiguous runs merge into one descriptor) plus one local gather.

:class:`StagingAgent` does that without touching vLLM's read path: it stands in for the
worker's ``nixl_wrapper`` and

* remembers the descriptor rows behind every prepared list (``get_xfer_descs`` ->
  ``prep_xfer_dlist``), so a request's ids can be turned back into addresses;
* posts a READ whose remote list was marked converted (:meth:`StagingAgent.mark_converted`)
  against staging slots instead of the local list, with the remote ids in address order;
* when NIXL reports that READ ``DONE``, launches the gather staging -> KV cache (a side CUDA
  stream on GPU) and keeps answering ``PROC`` until it has finished: vLLM counts a request's
  blocks as received on ``DONE``, so they are complete by then.  A failed gather answers
  ``ERR``, which vLLM turns into a per-request failure (its blocks are recomputed).

Everything else goes to the real agent unchanged.  A request that cannot be staged (staging
full or too small, descriptors of unequal lengths, a local list not seen being prepared) is
posted exactly as vLLM built it, and the reason is counted and logged once.

The staging buffer (``capacity`` bytes on the KV cache's device) is allocated at the first
READ to stage and registered with NIXL per slot length.  Needs torch (not vLLM).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdpatch.agent_layers import Layer
from pdpatch.kv.stage import (
    CopyPlan,
    range_ids,
    read_spans,
    span_layout,
    staging_table,
)
from pdpatch.kv.staging.calibration import GapCalibration
from pdpatch.kv.staging.copier import ByteAllocator, ByteCopier, arenas_of
from pdpatch.kv.staging.nixl_states import DONE, ERR, INIT_AGENT, PROC
from pdpatch.kv.staging.rows import (
    RowTable,
    SortedTwin,
    Spans,
    address_order,
    posted_descriptors,
)
from pdpatch.log import logger

# Stage a READ only when it posts at most this fraction of vLLM's descriptors.
MAX_STAGED_FRACTION = 0.75


@dataclass
class _Job:
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


class _NotStaged(Exception):
    """Why one request goes the per-segment way (counted, logged once per reason)."""


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
    not_staged: Counter = field(default_factory=Counter)   # reason -> requests


class StagingAgent(GapCalibration, Layer):
    """A worker's NIXL agent with staged READs for converted peers (see the module doc): the
    ``staging`` layer of :mod:`pdpatch.agent_layers`.

    ``memory`` gives, at the first READ to stage, the tensors whose memory the
    local descriptor lists point into (the KV caches, or vLLM's host buffers); the staging
    buffer is allocated on their device.  ``capacity`` bytes: 0 turns staging off.

    ``gap``: how many unrequested bytes a READ may read between two requested rows of a peer
    marked with its read ranges, so that nearby blocks share one descriptor (the bytes
    between them stay in staging).  ``None`` measures it per peer at its first staged READ
    (:meth:`_calibrate`); 0 turns gap reads off.

    ``capacity_setting`` / ``gap_setting``: what the operator sets to change ``capacity`` /
    ``gap``, named in the messages (the patch knows its settings; this core does not).
    """

    def __init__(self, agent: Any, *, mem_type: str, capacity: int,
                 memory: Callable[[], Sequence[Any]], gap: int | None = None,
                 capacity_setting: str = "the staging capacity",
                 gap_setting: str = "the gap budget") -> None:
        Layer.__init__(self, agent)
        self._capacity_setting = capacity_setting
        self._gap_setting = gap_setting
        self._mem_type = mem_type
        self._capacity = capacity
        self._memory = memory
        self._gap = gap
        self._lock = threading.Lock()
        self._tables: dict[Any, tuple[Any, Any]] = {}   # dlist handle -> (agent, its rows)
        self._arrays: dict[Any, RowTable] = {}            # the same rows as arrays, on first use
        self._unprepped: dict[int, tuple[Any, Any]] = {}   # id(xfer dlist) -> (dlist, rows)
        self._converted: dict[Any, SortedTwin] = {}      # remote dlist handle -> sorted twin
        self._jobs: dict[Any, _Job] = {}              # xfer handle -> staged READ
        self._slot_handles: dict[tuple[int, int], Any] = {}   # (slot len, dev) -> dlist
        self._registered: dict[int, Any] = {}         # dev -> NIXL registration
        self._covers: dict[Any, bool] = {}            # local dlist handle -> inside memory
        self._alloc = ByteAllocator(capacity)
        self._buffer: Any = None
        self._base = 0
        self._copier: ByteCopier | None = None
        self.stats = StagingStats()

    kind = "staging"

    @property
    def agent(self) -> Any:
        return self._agent

    @property
    def staging_allocated(self) -> int:
        """Bytes of staging memory this agent holds (0 until the first READ it stages)."""
        return 0 if self._buffer is None else int(self._buffer.numel())

    @property
    def staging_free(self) -> int:
        """Bytes of staging not held by a READ in flight."""
        with self._lock:
            return self._alloc.free_bytes

    # ------------------------------------------------------------ descriptor-list bookkeeping
    def get_xfer_descs(self, descs: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._agent.get_xfer_descs(descs, *args, **kwargs)
        with self._lock:
            if len(self._unprepped) > 64:      # built and never prepared: forget the oldest
                self._unprepped.pop(next(iter(self._unprepped)))
            self._unprepped[id(out)] = (out, descs)
        return out

    def prep_xfer_dlist(self, agent_name: Any, descs: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._agent.prep_xfer_dlist(agent_name, descs, *args, **kwargs)
        with self._lock:
            entry = self._unprepped.pop(id(descs), None)
            rows = entry[1] if entry is not None and entry[0] is descs else descs
            if isinstance(rows, (list, tuple, np.ndarray)):
                self._tables[handle] = (agent_name, rows)
        return handle

    def release_dlist_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._tables.pop(handle, None)
            self._arrays.pop(handle, None)
            twin = self._converted.pop(handle, None)
        if twin is not None:
            self._agent.release_dlist_handle(twin.handle)
        return self._agent.release_dlist_handle(handle, *args, **kwargs)

    def mark_converted(self, remote_handle: Any, peer: str,
                       read_ranges: Sequence[tuple[int, int]] | None = None) -> bool:
        """READs against ``remote_handle`` (a converted peer's prepared list) are staged from
        now on.  False (and a log line) when staging is off or cannot be set up.

        ``read_ranges``: the peer's memory a READ may cross whole, unrequested bytes
        included (:meth:`pdpatch.kv.geometry.KVGeometry.read_ranges`); without them, no gap
        reads from this peer.

        NIXL merges two pairs only when their ids are consecutive on both sides, and vLLM's
        lists order a peer's rows by layer, then K or V, then block: a fused peer's K and V
        of one block sit side by side in memory but far apart in the list.  So the peer's
        rows are prepared a second time sorted by address (the twin), and staged READs use
        the twin: neighbours in memory are neighbours in the list."""
        if self._capacity <= 0:
            return False
        with self._lock:
            entry = self._tables.get(remote_handle)
        if entry is None:
            logger.warning("pdpatch kv_segments: peer %s's descriptor list was prepared "
                           "before staging was set up; its READs go per segment", peer)
            return False
        table = self._table(remote_handle)
        if table is None or table.length is None:
            logger.info("pdpatch kv_segments: peer %s's descriptors differ in length; its "
                        "READs go per segment", peer)
            return False
        try:
            twin = self._sorted_twin(peer, entry[0], table)
            if read_ranges:
                end = twin.table.addr + table.length
                twin.range_id = range_ids(twin.table.addr, end, read_ranges)
        except Exception as exc:
            logger.warning("pdpatch kv_segments: no staging for peer %s (%s: %s); converted "
                           "READs go per segment (PDPATCH_KV_STAGING_MIB=0 silences this)",
                           peer, type(exc).__name__, exc)
            return False
        with self._lock:
            self._converted[remote_handle] = twin
        return True

    def _sorted_twin(self, peer: str, agent_name: Any, table: RowTable) -> SortedTwin:
        order = np.argsort(table.addr, kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        sorted_rows = np.column_stack([table.addr[order], np.full(order.size, table.length),
                                       np.full(order.size, table.dev)]).astype(np.uint64)
        handle = self._agent.prep_xfer_dlist(
            agent_name, self._agent.get_xfer_descs(sorted_rows, self._mem_type))
        return SortedTwin(peer, agent_name, handle, position, RowTable(sorted_rows))

    def _table(self, handle: Any) -> RowTable | None:
        with self._lock:
            table = self._arrays.get(handle)
            entry = self._tables.get(handle) if table is None else None
        if table is None and entry is not None:
            table = RowTable(entry[1])
            with self._lock:
                self._arrays[handle] = table
        return table

    def _ensure_buffer(self) -> None:
        """The staging buffer, made at the first READ to stage: a worker that only writes to
        a converted peer (a push-mode prefill) never pays for it."""
        if self._buffer is not None:
            return
        try:
            self._setup_buffer()
        except Exception as exc:
            self._capacity = 0
            logger.warning("pdpatch kv_segments: no staging buffer (%s: %s); converted READs "
                           "go per segment (PDPATCH_KV_STAGING_MIB=0 silences this)",
                           type(exc).__name__, exc)
            raise _NotStaged("no staging buffer could be made") from None

    def _setup_buffer(self) -> None:
        import torch

        memory = list(self._memory())
        device = ByteCopier(arenas_of(memory)).device
        buffer = torch.empty(self._capacity, dtype=torch.uint8, device=device)
        self._copier = ByteCopier(arenas_of([*memory, buffer]))
        self._buffer, self._base = buffer, int(buffer.data_ptr())
        logger.info("pdpatch kv_segments: %d MiB staging buffer on %s for converted READs "
                    "(PDPATCH_KV_STAGING_MIB)", self._capacity >> 20, device)

    # -------------------------------------------------------------------------- transfers
    def make_prepped_xfer(self, op: str, local_handle: Any, local_ids: Any, remote_handle: Any,
                          remote_ids: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            twin = self._converted.get(remote_handle) if op == "READ" else None
        if twin is None:
            return self._agent.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                                 remote_ids, *args, **kwargs)
        try:
            job, slot_handle, slot_ids, r_ids = self._plan(local_handle, local_ids, twin,
                                                           remote_handle, remote_ids)
        except _NotStaged as why:
            self._not_staged(str(why))
            return self._agent.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                                 remote_ids, *args, **kwargs)
        if job.spans is not None:
            try:
                job.dlists = self._span_lists(twin, job)
            except Exception as exc:     # NIXL refused a span: this peer gets no gap reads
                self._release(job)
                twin.gap = 0
                logger.warning("pdpatch kv_segments: no gap reads from %s: NIXL refused a "
                               "span of its memory (%s: %s); its READs are staged without "
                               "them", twin.peer, type(exc).__name__, exc)
                return self.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                              remote_ids, *args, **kwargs)
        try:
            if job.spans is None:
                handle = self._agent.make_prepped_xfer("READ", slot_handle, slot_ids,
                                                       twin.handle, r_ids, *args, **kwargs)
            else:
                local, remote = job.dlists
                ids = np.arange(job.spans.start.size, dtype=np.int64)
                handle = self._agent.make_prepped_xfer("READ", local, ids, remote, ids,
                                                       *args, **kwargs)
        except BaseException:
            self._release(job)
            raise
        requested = job.slot * job.local_addr.size
        with self._lock:
            self._jobs[handle] = job
            first = self.stats.staged_reads == 0
            self.stats.staged_reads += 1
            self.stats.staged_bytes += requested
            self.stats.descriptors_stock += job.stock
            self.stats.descriptors_staged += job.staged
            if job.spans is not None:
                self.stats.gap_reads += 1
                self.stats.gap_bytes += job.nbytes - requested
        (logger.info if first else logger.debug)(
            "pdpatch kv_segments: staged READ from %s: %d KiB in %d descriptors instead of "
            "%d%s", job.peer, requested >> 10, job.staged, job.stock,
            "" if job.spans is None else
            f", reading {(job.nbytes - requested) >> 10} KiB between requested blocks")
        return handle

    def _plan(self, lh: Any, local_ids: Any, twin: SortedTwin, rh: Any, remote_ids: Any
              ) -> tuple[_Job, Any, np.ndarray, np.ndarray]:
        """Staging slots and the peer's rows in address order: all NIXL needs to start.
        For a gap READ the job carries its spans, and the slot list and ids are unused."""
        if self._capacity <= 0:
            raise _NotStaged("no staging buffer could be made")
        ltab, rtab = self._table(lh), self._table(rh)
        if ltab is None or rtab is None:
            raise _NotStaged("the local descriptor list was prepared before staging was set up")
        lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
        rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
        if lid.size == 0 or lid.size != rid.size:
            raise _NotStaged("empty request, or local and remote id lists of unequal length")
        slot = ltab.length
        if slot is None or slot != rtab.length:
            raise _NotStaged("descriptors of unequal lengths")
        need = slot * lid.size
        if need > self._capacity:
            raise _NotStaged(f"a request is larger than the {self._capacity >> 20} MiB staging "
                             f"buffer (raise {self._capacity_setting})")
        self._ensure_buffer()
        if not self._covered(lh, ltab):
            raise _NotStaged("the local list points outside the KV memory staging copies into")
        position = twin.position[rid]
        order = address_order(position, rid)
        r_ids = position[order]
        stock = posted_descriptors(lid, rid, ltab, rtab)
        runs = lid.size - int(np.count_nonzero(
            (r_ids[1:] == r_ids[:-1] + 1) & twin.table.contiguous_next[r_ids[:-1]]))
        slot_handle = self._slot_handle(slot, ltab.dev)     # registers staging, too
        spans = self._spans(twin, r_ids, slot, runs, ltab.dev)
        start = None
        if spans is not None and spans.posted <= MAX_STAGED_FRACTION * stock:
            with self._lock:
                start = self._alloc.alloc(spans.nbytes, slot)
        if start is None:           # no gap READ, or other READs hold the room its gaps need
            spans = None
            if runs > MAX_STAGED_FRACTION * stock:
                # the gather would cost more than the few descriptors it saves (measured:
                # 256 KiB isolated blocks from a split peer, 881 of 1024 descriptors, 0.6x)
                raise _NotStaged("staging saves under a quarter of the descriptors (blocks "
                                 "far apart, or head slices of K and V)")
            with self._lock:
                start = self._alloc.alloc(need, slot)
            if start is None:
                raise _NotStaged("the staging buffer is full with other requests' READs")
        staged = runs if spans is None else spans.posted
        slot_ids = start // slot + np.arange(lid.size, dtype=np.int64)
        job = _Job(start, need if spans is None else spans.nbytes, ltab.addr[lid[order]],
                   slot, twin.peer, stock, staged, ltab.dev, spans)
        return job, slot_handle, slot_ids, r_ids

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
        first, last, _ = read_spans(start, end, joinable, gap, self._capacity)
        if first.size >= runs:
            return None
        return Spans(start[first], *span_layout(start, end, first, last))

    def _covered(self, handle: Any, table: RowTable) -> bool:
        """Every row of a local list lies in memory the copier can write (checked once)."""
        with self._lock:
            known = self._covers.get(handle)
        if known is None:
            try:
                self._copier.locate(table.addr, np.full(table.addr.size, table.length or 0))
                known = True
            except ValueError:
                known = False
            with self._lock:
                self._covers[handle] = known
        return known

    def _plan_gather(self, job: _Job) -> None:
        n = job.local_addr.size
        offset = job.spans.offset if job.spans is not None else \
            np.arange(n, dtype=np.int64) * job.slot
        staging = self._base + job.start + offset
        # not merged first: prepare cuts every copy into rows of one size anyway
        job.ops = self._copier.prepare(CopyPlan(staging, job.local_addr,
                                                np.full(n, job.slot, dtype=np.int64)))

    def _slot_handle(self, slot: int, dev: int) -> Any:
        """The staging buffer as a prepared list of ``slot``-byte entries, registered with the
        device id the local lists use (NIXL matches a descriptor to its registration by it)."""
        key = (slot, dev)
        with self._lock:
            handle = self._slot_handles.get(key)
            registered = dev in self._registered
        if handle is not None:
            return handle
        if not registered:
            self._register(dev)
        table = staging_table(self._base, slot, self._capacity // slot, dev)
        handle = self.prep_xfer_dlist(INIT_AGENT, self.get_xfer_descs(table, self._mem_type))
        with self._lock:
            self._slot_handles[key] = handle
        return handle

    def _register(self, dev: int) -> None:
        descs = self._agent.get_reg_descs([(self._base, self._capacity, dev, "")],
                                          self._mem_type)
        reg = self._agent.register_memory(descs)
        with self._lock:
            self._registered[dev] = reg if reg is not None else descs

    def _span_lists(self, twin: SortedTwin, job: _Job) -> tuple[Any, Any]:
        """A gap READ's own lists: its spans of the peer, and back-to-back staging ranges of
        the same lengths (ids into prepared tables cannot describe a span that no row is)."""
        sp = job.spans
        lh = self._prep(INIT_AGENT, self._base + job.start + sp.span_off, sp.length, job.dev)
        try:
            return lh, self._prep(twin.agent_name, sp.start, sp.length, twin.table.dev)
        except BaseException:
            self._agent.release_dlist_handle(lh)
            raise

    def _prep(self, agent_name: Any, addr: np.ndarray, length: np.ndarray, dev: int) -> Any:
        rows = np.column_stack([addr, length, np.full(addr.size, dev)]).astype(np.uint64)
        return self._agent.prep_xfer_dlist(agent_name,
                                           self._agent.get_xfer_descs(rows, self._mem_type))

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        state = self._agent.transfer(handle, *args, **kwargs)
        with self._lock:
            job = self._jobs.get(handle)
        if job is None:
            return state
        try:
            self._plan_gather(job)   # host work while NIXL moves the bytes
        except Exception as exc:     # fail the request once NIXL is done with the staging slots
            job.failure = exc
        # Landed in staging is not landed in the KV cache: the caller must poll, which copies.
        return PROC if state == DONE else state

    def check_xfer_state(self, handle: Any) -> Any:
        with self._lock:
            job = self._jobs.get(handle)
        if job is None:
            return self._agent.check_xfer_state(handle)
        if not job.landed:
            state = self._agent.check_xfer_state(handle)
            if state != DONE:
                if state != PROC:
                    self._finish(handle)
                return state
            job.landed = True
            try:
                if job.failure is not None:
                    raise job.failure
                if not job.ops:      # posted without our transfer(): plan the gather now
                    self._plan_gather(job)
                job.event = self._copier.launch(job.ops, sync=False)
            except Exception as exc:
                return self._gather_failed(handle, exc)
        if job.event is not None and not job.event.query():
            return PROC
        self._finish(handle)
        return DONE

    def _gather_failed(self, handle: Any, exc: Exception) -> str:
        with self._lock:
            self.stats.gather_failures += 1
        logger.error("pdpatch kv_segments: copying a staged READ into the KV cache failed "
                     "(%s: %s); the request fails and its blocks are recomputed",
                     type(exc).__name__, exc)
        self._finish(handle)
        return ERR

    def release_xfer_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        # NIXL first: should it refuse to let go of a READ in flight, the staging slots stay
        # reserved rather than be handed to another READ while this one still writes them.
        result = self._agent.release_xfer_handle(handle, *args, **kwargs)
        self._finish(handle)
        return result

    def _finish(self, handle: Any) -> None:
        with self._lock:
            job = self._jobs.pop(handle, None)
        if job is None:
            return
        if job.event is not None:
            job.event.synchronize()   # a gather still reading the slots (request aborted)
        self._release(job)

    def _release(self, job: _Job) -> None:
        for dlist in job.dlists:
            self._agent.release_dlist_handle(dlist)
        self._release_range(job.start, job.nbytes)

    def _release_range(self, start: int, nbytes: int) -> None:
        with self._lock:
            self._alloc.free(start, nbytes)

    def close(self) -> None:
        """Release the staging lists and registration (the worker's shutdown, or a test's)."""
        with self._lock:
            handles, self._slot_handles = list(self._slot_handles.values()), {}
            regs, self._registered = list(self._registered.values()), {}
            twins = [t.handle for t in self._converted.values()]
            self._converted.clear()
            self._capacity = 0
        for handle in twins:
            self._agent.release_dlist_handle(handle)
        for handle in handles:
            self.release_dlist_handle(handle)
        for reg in regs:
            self._agent.deregister_memory(reg)
        self._buffer = self._copier = None

    def _not_staged(self, reason: str) -> None:
        with self._lock:
            self.stats.not_staged[reason] += 1
            first = self.stats.not_staged[reason] == 1
        (logger.info if first else logger.debug)(
            "pdpatch kv_segments: READ posted per segment: %s", reason)
