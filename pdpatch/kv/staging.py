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

import bisect
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdpatch.kv.stage import (
    CopyPlan,
    TransportCost,
    range_ids,
    read_spans,
    span_layout,
    staging_table,
)
from pdpatch.log import logger

DONE, PROC, ERR = "DONE", "PROC", "ERR"
INIT_AGENT = "NIXL_INIT_AGENT"
STAGING_VAR = "PDPATCH_KV_STAGING_MIB"
GAP_VAR = "PDPATCH_KV_GAP_KIB"
# Stage a READ only when it posts at most this fraction of vLLM's descriptors.
MAX_STAGED_FRACTION = 0.75
# Calibration READs: descriptors of the many-descriptor READ, the bytes of the big one (more
# bytes, a truer bandwidth: 64 MiB take ~40 us over cuda_ipc, 0.13 s over TCP loopback).
CALIBRATION_DESCS = 256
CALIBRATION_MAX_BYTES = 64 << 20
CALIBRATION_REPS = 3
SLOW_READ_S = 0.01


class ByteAllocator:
    """First-fit ranges of one buffer; each range starts at a multiple of its ``align``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self._free)

    def alloc(self, nbytes: int, align: int) -> int | None:
        if nbytes <= 0 or align <= 0:
            raise ValueError(f"nbytes and align must be > 0, got {nbytes}, {align}")
        for i, (s, e) in enumerate(self._free):
            start = -(-s // align) * align
            if start + nbytes <= e:
                rest = [r for r in ((s, start), (start + nbytes, e)) if r[1] > r[0]]
                self._free[i:i + 1] = rest
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        end = start + nbytes
        i = bisect.bisect_left(self._free, (start, end))
        if (i > 0 and self._free[i - 1][1] > start) or \
                (i < len(self._free) and self._free[i][0] < end):
            raise ValueError(f"range {start}+{nbytes} is already free")
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))


def arenas_of(tensors: Iterable[Any]) -> list[tuple[int, Any]]:
    """``(base address, flat uint8 tensor)`` over the storage of each tensor (once each): the
    memory a :class:`ByteCopier` may read and write, whatever the tensors' shapes."""
    import torch

    arenas: dict[int, Any] = {}
    for t in tensors:
        storage = t.untyped_storage()
        base = int(storage.data_ptr())
        if base not in arenas:
            arenas[base] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return list(arenas.items())


class ByteCopier:
    """Runs a :class:`CopyPlan` inside known arenas with torch index kernels, on CPU and GPU.

    Why rows: the copies of a staged READ are thousands of equal segments; one
    ``index_copy_`` per (source, destination) arena moves them all where a loop would launch
    one copy each.  The row is the largest power of two (up to 64 KiB) dividing every length and
    offset, so no byte outside a copy is written; rows of 8-byte words when it allows.  When
    one side's rows are consecutive (the staging side of a READ usually is) that side is a
    plain slice and no temporary is made.  On CUDA the copies run on the copier's own
    non-blocking stream: not behind the model's kernels, and not on the legacy stream that
    waits for NIXL's copies in flight.
    """

    name = "torch-index"

    def __init__(self, arenas: Sequence[tuple[int, Any]]) -> None:
        import torch

        self.arenas = sorted(((int(b), t) for b, t in arenas), key=lambda a: a[0])
        self.bases = np.array([a[0] for a in self.arenas], dtype=np.int64)
        self.ends = self.bases + np.array([t.numel() for _, t in self.arenas], dtype=np.int64)
        devices = {t.device for _, t in self.arenas}
        if len(devices) != 1:
            raise ValueError(f"arenas must share one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._stream = (torch.cuda.Stream(self.device, priority=0)
                        if self.device.type == "cuda" else None)

    def locate(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The arena of each range; ValueError names the first one no arena holds."""
        first = int(np.searchsorted(self.bases, int(addr.min()), side="right")) - 1
        if first >= 0 and int((addr + length).max()) <= int(self.ends[first]):
            return np.full(addr.size, first, dtype=np.int64)   # all in one (staging's side)
        i = np.searchsorted(self.bases, addr, side="right") - 1
        ok = (i >= 0) & (addr + length <= self.ends[np.maximum(i, 0)])
        if not bool(np.all(ok)):
            bad = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"copy of {int(length[bad])} B at {int(addr[bad]):#x} lies outside "
                             "the memory this copier was given")
        return i

    def prepare(self, plan: CopyPlan) -> list[tuple]:
        """Index tensors per (source arena, destination arena): host work that needs no bytes
        yet, so a READ can do it while NIXL still moves them."""
        import torch

        if len(plan) == 0:
            return []
        src, dst, ln = (np.asarray(a, dtype=np.int64) for a in (plan.src, plan.dst,
                                                               plan.length))
        sa, da = self.locate(src, ln), self.locate(dst, ln)
        s_off, d_off = src - self.bases[sa], dst - self.bases[da]
        # the largest power of two dividing every offset and length (np.gcd.reduce: ~1 ms)
        low = int(np.bitwise_or.reduce(np.concatenate([s_off, d_off, ln])))
        g = min(low & -low, 1 << 16)
        dtype, esz = (torch.int64, 8) if g % 8 == 0 else (torch.uint8, 1)
        rows = ln // g
        src_rows, dst_rows, keys = s_off // g, d_off // g, sa * len(self.arenas) + da
        if int(rows.max()) > 1:      # copies of several rows each: one index per row
            within = np.arange(int(rows.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(rows) - rows, rows)
            src_rows = np.repeat(src_rows, rows) + within
            dst_rows = np.repeat(dst_rows, rows) + within
            keys = np.repeat(keys, rows)
        ops = []
        present = np.flatnonzero(np.bincount(keys))    # (a sort, as np.unique, costs ~1 ms)
        for key in present.tolist():
            sel = keys == key if present.size > 1 else slice(None)
            s_r, d_r = src_rows[sel], dst_rows[sel]
            s2 = self._rows(key // len(self.arenas), g, dtype, esz)
            d2 = self._rows(key % len(self.arenas), g, dtype, esz)
            if _consecutive(s_r):
                ops.append(("scatter", s2[s_r[0]: s_r[0] + s_r.size], d2, self._index(d_r)))
            elif _consecutive(d_r):
                ops.append(("gather", s2, d2[d_r[0]: d_r[0] + d_r.size], self._index(s_r)))
            else:
                ops.append(("both", s2, d2, (self._index(s_r), self._index(d_r))))
        return ops

    def _rows(self, arena: int, g: int, dtype: Any, esz: int) -> Any:
        flat = self.arenas[arena][1]
        return flat[: flat.numel() // g * g].view(dtype).view(-1, g // esz)

    def _index(self, rows: np.ndarray) -> Any:
        import torch

        return torch.from_numpy(rows).to(self.device, non_blocking=True)

    def launch(self, ops: list[tuple], sync: bool = True) -> Any:
        """Run prepared copies.  ``sync=False`` on CUDA returns an event to poll; the caller
        keeps ``ops`` alive until it has completed (their index tensors are in use)."""
        import torch

        if not ops:
            return None
        with torch.cuda.stream(self._stream) if self._stream is not None else _nothing():
            for kind, src, dst, idx in ops:
                if kind == "scatter":
                    dst.index_copy_(0, idx, src)
                elif kind == "gather":
                    torch.index_select(src, 0, idx, out=dst)
                else:
                    dst.index_copy_(0, idx[1], src.index_select(0, idx[0]))
            if self._stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self._stream)
        if sync:
            event.synchronize()
            return None
        return event

    def run(self, plan: CopyPlan, sync: bool = True) -> Any:
        return self.launch(self.prepare(plan), sync)

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


def _consecutive(rows: np.ndarray) -> bool:
    return bool(rows.size) and int(rows[-1]) - int(rows[0]) + 1 == rows.size and \
        bool(np.all(np.diff(rows) == 1))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@dataclass(frozen=True)
class _Spans:
    """A gap READ: its spans of the peer's memory, and where each requested row lands."""

    start: np.ndarray          # remote address of each span
    length: np.ndarray
    span_off: np.ndarray       # each span's offset in staging (back to back)
    offset: np.ndarray         # each row's offset in staging (rows in address order)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @property
    def posted(self) -> int:
        """The descriptors counted for this READ, one per span: an upper bound of NIXL's
        ``descCount``.  Two spans touch only across read ranges, and NIXL merges them when
        one registration holds both (measured: yes for a peer that registered both ranges
        as one region, no for two regions)."""
        return int(self.start.size)


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
    spans: _Spans | None = None                  # a gap READ: its spans of the peer
    dlists: tuple = ()                           # a gap READ's own lists, freed with it
    ops: list = field(default_factory=list)      # prepared gather, alive until it has run
    failure: Exception | None = None             # planning the gather failed
    event: Any = None
    landed: bool = False


class _Table:
    """A prepared list's rows as arrays, built once on first use (vLLM keeps lists of
    tuples; turning 10^5 of them into addresses per request would cost more than NIXL)."""

    __slots__ = ("addr", "contiguous_next", "dev", "length")

    def __init__(self, rows: Any) -> None:
        arr = _as_rows(rows)
        self.addr = arr[:, 0].astype(np.int64)
        lens = arr[:, 1].astype(np.int64)
        # one length per list, or None (then no staging: slots are of one size)
        self.length = int(lens[0]) if lens.size and bool(np.all(lens == lens[0])) else None
        self.dev = int(arr[0, 2]) if arr.size else 0
        # row i ends where row i + 1 starts: NIXL can merge them when both are requested
        self.contiguous_next = np.append(self.addr[1:] == self.addr[:-1] + lens[:-1], False)


@dataclass
class _Sorted:
    """A converted peer's rows prepared once more in address order."""

    peer: str
    agent_name: Any
    handle: Any
    position: np.ndarray       # row id in vLLM's list -> row id in the sorted twin
    table: _Table              # the twin's rows
    range_id: np.ndarray | None = None   # the peer's read range holding each row (-1: none)
    gap: int | None = None     # bytes a READ may read between requested rows (None: unknown)


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


class StagingAgent:
    """A worker's NIXL agent with staged READs for converted peers (see the module doc).

    ``memory`` gives, at the first READ to stage, the tensors whose memory the
    local descriptor lists point into (the KV caches, or vLLM's host buffers); the staging
    buffer is allocated on their device.  ``capacity`` bytes: 0 turns staging off.

    ``gap``: how many unrequested bytes a READ may read between two requested rows of a peer
    marked with its read ranges, so that nearby blocks share one descriptor (the bytes
    between them stay in staging).  ``None`` measures it per peer at its first staged READ
    (:meth:`_calibrate`); 0 turns gap reads off.
    """

    def __init__(self, agent: Any, *, mem_type: str, capacity: int,
                 memory: Callable[[], Sequence[Any]], gap: int | None = None) -> None:
        self._agent = agent
        self._mem_type = mem_type
        self._capacity = capacity
        self._memory = memory
        self._gap = gap
        self._lock = threading.Lock()
        self._tables: dict[Any, tuple[Any, Any]] = {}   # dlist handle -> (agent, its rows)
        self._arrays: dict[Any, _Table] = {}            # the same rows as arrays, on first use
        self._unprepped: dict[int, tuple[Any, Any]] = {}   # id(xfer dlist) -> (dlist, rows)
        self._converted: dict[Any, _Sorted] = {}      # remote dlist handle -> sorted twin
        self._jobs: dict[Any, _Job] = {}              # xfer handle -> staged READ
        self._slot_handles: dict[tuple[int, int], Any] = {}   # (slot len, dev) -> dlist
        self._registered: dict[int, Any] = {}         # dev -> NIXL registration
        self._covers: dict[Any, bool] = {}            # local dlist handle -> inside memory
        self._alloc = ByteAllocator(capacity)
        self._buffer: Any = None
        self._base = 0
        self._copier: ByteCopier | None = None
        self.stats = StagingStats()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

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

    def _sorted_twin(self, peer: str, agent_name: Any, table: _Table) -> _Sorted:
        order = np.argsort(table.addr, kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        sorted_rows = np.column_stack([table.addr[order], np.full(order.size, table.length),
                                       np.full(order.size, table.dev)]).astype(np.uint64)
        handle = self._agent.prep_xfer_dlist(
            agent_name, self._agent.get_xfer_descs(sorted_rows, self._mem_type))
        return _Sorted(peer, agent_name, handle, position, _Table(sorted_rows))

    def _table(self, handle: Any) -> _Table | None:
        with self._lock:
            table = self._arrays.get(handle)
            entry = self._tables.get(handle) if table is None else None
        if table is None and entry is not None:
            table = _Table(entry[1])
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

    def _plan(self, lh: Any, local_ids: Any, twin: _Sorted, rh: Any, remote_ids: Any
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
                             f"buffer (raise {STAGING_VAR})")
        self._ensure_buffer()
        if not self._covered(lh, ltab):
            raise _NotStaged("the local list points outside the KV memory staging copies into")
        position = twin.position[rid]
        order = address_order(position, rid)
        r_ids = position[order]
        stock = _posted(lid, rid, ltab, rtab)
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

    def _spans(self, twin: _Sorted, r_ids: np.ndarray, slot: int, runs: int, dev: int
               ) -> _Spans | None:
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
        return _Spans(start[first], *span_layout(start, end, first, last))

    def _covered(self, handle: Any, table: _Table) -> bool:
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

    def _gap_for(self, twin: _Sorted, slot: int, dev: int) -> int:
        """The twin's gap budget: the agent's setting, else measured at the peer's first
        staged READ (0 until it could be)."""
        if twin.range_id is None:
            return 0
        if twin.gap is None and self._gap is not None:
            twin.gap = self._gap
        if twin.gap is None:
            twin.gap = self._calibrate(twin, slot, dev)
        return twin.gap or 0

    def _calibrate(self, twin: _Sorted, slot: int, dev: int) -> int | None:
        """The most bytes worth reading to save one descriptor, measured on this peer: three
        READs of its memory into staging -- :data:`CALIBRATION_DESCS` rows one apart, the
        same bytes as one descriptor, and one descriptor of up to
        :data:`CALIBRATION_MAX_BYTES` -- best of :data:`CALIBRATION_REPS` each
        (:meth:`~pdpatch.kv.stage.TransportCost.from_reads`).

        Why measure: the budget is ``cost x bandwidth``, a few MiB over cuda_ipc on one node,
        tens of KiB over host memory, a few KiB over TCP: no default fits every transport.
        None (try again at the next READ) while other READs hold the staging it needs."""
        run_start, run_len = _longest_run(twin)
        room = min(CALIBRATION_MAX_BYTES, self._capacity, run_len * slot) // (2 * slot)
        descs = min(CALIBRATION_DESCS, run_len // 2, 2 * room)
        if descs < 2:
            logger.info("pdpatch kv_segments: no gap reads from %s: no run of its rows, or "
                        "no staging, large enough to measure the transport with", twin.peer)
            return 0
        with self._lock:
            start = self._alloc.alloc(2 * room * slot, slot)
        if start is None:
            return None
        addr = twin.table.addr
        try:
            spaced = self._timed(twin, start, addr[run_start:run_start + 2 * descs:2], slot,
                                 dev)
            one = self._timed(twin, start, addr[run_start:run_start + 1], descs * slot, dev)
            big = self._timed(twin, start, addr[run_start:run_start + 1], 2 * room * slot, dev)
            cost = TransportCost.from_reads(spaced, one, big)
        except Exception as exc:
            logger.warning("pdpatch kv_segments: no gap reads from %s: measuring its "
                           "transport failed (%s: %s); set %s to choose a gap", twin.peer,
                           type(exc).__name__, exc, GAP_VAR)
            return 0
        finally:
            self._release_range(start, 2 * room * slot)
        gap = cost.gap_budget()
        with self._lock:
            self.stats.gap_budgets[twin.peer] = gap
        logger.info("pdpatch kv_segments: READs from %s cost %.1f us per descriptor at %.1f "
                    "GB/s: staged READs read up to %d KiB between requested blocks rather than "
                    "post another descriptor (%s overrides; 0 turns it off)", twin.peer,
                    cost.desc_cost_s * 1e6, cost.bandwidth_bps / 1e9, gap >> 10, GAP_VAR)
        return gap

    def _timed(self, twin: _Sorted, start: int, remote: np.ndarray, length: int, dev: int
               ) -> tuple[int, int, float]:
        """``(descs, bytes, best seconds)`` of READing ``length`` bytes at each of ``remote``
        into staging at ``start``, posted and polled as vLLM does."""
        n = remote.size
        lens = np.full(n, length, dtype=np.int64)
        local = self._base + start + np.arange(n, dtype=np.int64) * length
        lh = self._prep(INIT_AGENT, local, lens, dev)
        ids = np.arange(n, dtype=np.int64)
        best = math.inf
        rh = None
        try:
            rh = self._prep(twin.agent_name, remote, lens, twin.table.dev)
            for rep in range(CALIBRATION_REPS):
                t0 = time.perf_counter()
                handle = self._agent.make_prepped_xfer("READ", lh, ids, rh, ids)
                try:
                    state = self._agent.transfer(handle)
                    while state == PROC:
                        state = self._agent.check_xfer_state(handle)
                    best = min(best, time.perf_counter() - t0)
                finally:
                    self._agent.release_xfer_handle(handle)
                with self._lock:
                    self.stats.calibration_bytes += n * length
                if state != DONE:
                    raise RuntimeError(f"calibration READ ended {state}")
                if rep and best > SLOW_READ_S:   # slow transport: small noise, dear time
                    break                            # (the first READ warms the memory)
        finally:
            self._agent.release_dlist_handle(lh)
            if rh is not None:
                self._agent.release_dlist_handle(rh)
        return n, n * length, best

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

    def _span_lists(self, twin: _Sorted, job: _Job) -> tuple[Any, Any]:
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


def address_order(position: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``np.argsort(position, kind="stable")``, cheaper for the requests vLLM builds.

    Why: sorting a request's 10^4-10^5 rows costs more host time than NIXL spends on the
    descriptors staging saves (6 ms for 65 536 rows on an H200 host).  vLLM's ids are
    region-major -- every layer's K (and V) region asks for the same blocks -- so the rows
    come in chunks that are translates of the first one.  Sorting the first chunk once and
    applying that order to every chunk leaves sorted runs, which a stable sort (timsort)
    merges in O(n log chunks).  The chunking is only a hint: the final sort is exact for any
    input."""
    n = ids.size
    chunk = _period(ids)
    if chunk >= n:
        return np.argsort(position, kind="stable")
    first = np.argsort(position[:chunk], kind="stable")
    hint = (np.arange(0, n, chunk, dtype=np.int64)[:, None] + first[None, :]).reshape(-1)
    return hint[np.argsort(position[hint], kind="stable")]


def _period(ids: np.ndarray) -> int:
    """The shortest chunk length whose chunks are the first chunk shifted by a constant
    (``ids.size`` when there is none)."""
    n = ids.size
    for chunk in _divisors(n):
        if chunk == n:
            break
        step = ids[chunk] - ids[0]
        if ids[n - 1] - ids[n - 1 - chunk] != step:       # cheap test before the full one
            continue
        if bool(np.all(ids[chunk:] - ids[:-chunk] == step)):
            return chunk
    return n


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _as_rows(rows: Any) -> np.ndarray:
    """vLLM's list of ``(addr, len, dev)`` tuples, or an Nx3 array, as an Nx3+ int64 array."""
    arr = np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), dtype=np.int64)
    return arr.reshape(-1, arr.shape[-1]) if arr.size else np.zeros((0, 3), np.int64)


def _longest_run(twin: _Sorted) -> tuple[int, int]:
    """``(first row, rows)`` of the twin's longest run of back-to-back rows in one read
    range: memory a single READ of the peer may cover."""
    rng = twin.range_id
    if rng is None or rng.size == 0:
        return 0, 0
    joins = twin.table.contiguous_next[:-1] & (rng[1:] == rng[:-1]) & (rng[1:] >= 0)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.diff(np.append(starts, rng.size))
    lengths[rng[starts] < 0] = 0
    best = int(np.argmax(lengths))
    return int(starts[best]), int(lengths[best])


def _posted(lid: np.ndarray, rid: np.ndarray, ltab: _Table, rtab: _Table) -> int:
    """NIXL's ``descCount`` for ids into two lists: a pair joins the previous one when both
    ids follow the previous ones and both rows continue them in memory."""
    joins = ((lid[1:] == lid[:-1] + 1) & (rid[1:] == rid[:-1] + 1)
             & ltab.contiguous_next[lid[:-1]] & rtab.contiguous_next[rid[:-1]])
    return int(lid.size - np.count_nonzero(joins))
