"""Staged READs inside a worker's NIXL agent, for peers whose K/V placement was converted.

Why: a converted peer pairs a contiguous run on one side with a strided run on the other, so
NIXL cannot merge anything and a READ costs one descriptor per block segment -- 0.04-1.1x of
the fused path on an H100/H200 (docs/gpu_results.md).  :func:`pdpatch.kv.stage.stage_ids`
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

The staging buffer (``capacity`` bytes on the KV cache's device) is allocated and registered
with NIXL on the first converted peer only.  Needs torch (not vLLM).
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdpatch.kv.stage import CopyPlan, merged_count, stage_ids, staging_table
from pdpatch.log import logger

DONE, PROC, ERR = "DONE", "PROC", "ERR"
INIT_AGENT = "NIXL_INIT_AGENT"


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


class ByteCopier:
    """Runs a :class:`CopyPlan` between the storages of torch tensors, as row gathers.

    Why rows: the copies of a staged READ are thousands of equal segments; one
    ``index_copy_`` per destination storage moves them all (two kernels per KV layer) where a
    loop would launch one copy each.  The row length is the largest one that divides every
    length and every offset inside its storage, so no byte outside a copy is written.
    """

    def __init__(self, tensors: Iterable[Any]) -> None:
        import torch

        regions: dict[int, tuple[int, Any]] = {}
        for t in tensors:
            storage = t.untyped_storage()
            base = int(storage.data_ptr())
            if base not in regions:
                flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                regions[base] = (int(storage.nbytes()), flat)
        self._bases = sorted(regions)
        self._regions = [regions[b] for b in self._bases]
        devices = {flat.device for _, flat in self._regions}
        if len(devices) > 1:
            raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _region_of(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        bases = np.asarray(self._bases, dtype=np.int64)
        ri = np.searchsorted(bases, addr, side="right") - 1
        ends = bases + np.asarray([n for n, _ in self._regions], dtype=np.int64)
        ok = (ri >= 0) & (addr + length <= ends[np.maximum(ri, 0)])
        if not bool(np.all(ok)):
            bad = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"copy of {int(length[bad])} B at {int(addr[bad]):#x} is outside "
                             "the tensors this copier was given")
        return ri

    def launch(self, plan: CopyPlan) -> Any:
        """Start the copies; returns a CUDA event to poll, or None when they are done."""
        import torch

        if len(plan) == 0:
            return None
        src = plan.src.astype(np.int64)
        dst = plan.dst.astype(np.int64)
        ln = plan.length.astype(np.int64)
        rs, rd = self._region_of(src, ln), self._region_of(dst, ln)
        bases = np.asarray(self._bases, dtype=np.int64)
        so, do = src - bases[rs], dst - bases[rd]
        row = int(np.gcd.reduce(np.concatenate((ln, so, do))))
        counts = ln // row
        rep = np.repeat(np.arange(ln.size), counts)
        within = np.arange(rep.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts,
                                                                 counts)
        src_rows, dst_rows = so[rep] // row + within, do[rep] // row + within
        pair = rs[rep] * len(self._bases) + rd[rep]
        stream = torch.cuda.stream(self._stream) if self._stream is not None else None
        if stream is not None:
            stream.__enter__()
        try:
            for key in np.unique(pair).tolist():
                sel = pair == key
                s_reg, d_reg = divmod(key, len(self._bases))
                s_view = self._rows(s_reg, row)
                d_view = self._rows(d_reg, row)
                s_idx = torch.from_numpy(src_rows[sel]).to(self.device)
                d_idx = torch.from_numpy(dst_rows[sel]).to(self.device)
                d_view.index_copy_(0, d_idx, s_view.index_select(0, s_idx))
            if self._stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self._stream)
            return event
        finally:
            if stream is not None:
                stream.__exit__(None, None, None)

    def _rows(self, region: int, row: int) -> Any:
        nbytes, flat = self._regions[region]
        return flat[: nbytes // row * row].view(-1, row)


@dataclass
class _Job:
    """One staged READ: its staging range and the gather that follows it."""

    start: int
    nbytes: int
    copies: CopyPlan
    peer: str
    event: Any = None
    landed: bool = False


@dataclass(frozen=True)
class _Sorted:
    """A converted peer's rows prepared once more in address order."""

    peer: str
    handle: Any
    position: np.ndarray       # row id in vLLM's list -> row id in the sorted twin


class _NotStaged(Exception):
    """Why one request goes the per-segment way (counted, logged once per reason)."""


@dataclass
class StagingStats:
    staged_reads: int = 0
    staged_bytes: int = 0
    descriptors_stock: int = 0      # what the same READs would have posted unstaged
    descriptors_staged: int = 0
    gather_failures: int = 0
    not_staged: Counter = field(default_factory=Counter)   # reason -> requests


class StagingAgent:
    """A worker's NIXL agent with staged READs for converted peers (see the module doc).

    ``memory`` gives, when the first converted peer is marked, the tensors whose memory the
    local descriptor lists point into (the KV caches, or vLLM's host buffers); the staging
    buffer is allocated on their device.  ``capacity`` bytes: 0 turns staging off.
    """

    def __init__(self, agent: Any, *, mem_type: str, capacity: int,
                 memory: Callable[[], Sequence[Any]]) -> None:
        self._agent = agent
        self._mem_type = mem_type
        self._capacity = capacity
        self._memory = memory
        self._lock = threading.Lock()
        self._tables: dict[Any, tuple[Any, Any]] = {}   # dlist handle -> (agent, its rows)
        self._unprepped: dict[int, tuple[Any, Any]] = {}   # id(xfer dlist) -> (dlist, rows)
        self._converted: dict[Any, _Sorted] = {}      # remote dlist handle -> sorted twin
        self._jobs: dict[Any, _Job] = {}              # xfer handle -> staged READ
        self._slot_handles: dict[tuple[int, int], Any] = {}   # (slot len, dev) -> dlist
        self._registered: dict[int, Any] = {}         # dev -> NIXL registration
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
            twin = self._converted.pop(handle, None)
        if twin is not None:
            self._agent.release_dlist_handle(twin.handle)
        return self._agent.release_dlist_handle(handle, *args, **kwargs)

    def mark_converted(self, remote_handle: Any, peer: str) -> bool:
        """READs against ``remote_handle`` (a converted peer's prepared list) are staged from
        now on.  False (and a log line) when staging is off or cannot be set up.

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
        try:
            if self._buffer is None:
                self._setup_buffer()
            twin = self._sorted_twin(peer, *entry)
        except Exception as exc:
            logger.warning("pdpatch kv_segments: no staging for peer %s (%s: %s); converted "
                           "READs go per segment (PDPATCH_KV_STAGING_MIB=0 silences this)",
                           peer, type(exc).__name__, exc)
            return False
        with self._lock:
            self._converted[remote_handle] = twin
        return True

    def _sorted_twin(self, peer: str, agent_name: Any, rows: Any) -> _Sorted:
        table = _rows(rows, np.arange(len(rows)))
        order = np.argsort(table[:, 0], kind="stable")
        position = np.empty_like(order)
        position[order] = np.arange(order.size)
        descs = self._agent.get_xfer_descs(table[order].astype(np.uint64), self._mem_type)
        handle = self._agent.prep_xfer_dlist(agent_name, descs)
        return _Sorted(peer, handle, position)

    def _setup_buffer(self) -> None:
        import torch

        memory = list(self._memory())
        device = ByteCopier(memory).device
        buffer = torch.empty(self._capacity, dtype=torch.uint8, device=device)
        self._copier = ByteCopier([*memory, buffer])
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
            job, slot_handle, slot_ids, r_ids, stock, staged = self._plan(
                local_handle, local_ids, remote_handle, remote_ids, twin)
        except _NotStaged as why:
            self._not_staged(str(why))
            return self._agent.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                                 remote_ids, *args, **kwargs)
        try:
            handle = self._agent.make_prepped_xfer("READ", slot_handle, slot_ids, twin.handle,
                                                   r_ids, *args, **kwargs)
        except BaseException:
            self._release(job)
            raise
        with self._lock:
            self._jobs[handle] = job
            first = self.stats.staged_reads == 0
            self.stats.staged_reads += 1
            self.stats.staged_bytes += job.nbytes
            self.stats.descriptors_stock += stock
            self.stats.descriptors_staged += staged
        (logger.info if first else logger.debug)(
            "pdpatch kv_segments: staged READ from %s: %d KiB in %d descriptors instead of %d",
            job.peer, job.nbytes >> 10, staged, stock)
        return handle

    def _plan(self, lh: Any, local_ids: Any, rh: Any, remote_ids: Any, twin: _Sorted
              ) -> tuple[_Job, Any, np.ndarray, np.ndarray, int, int]:
        with self._lock:
            ltab, rtab = self._tables.get(lh), self._tables.get(rh)
        if ltab is None or rtab is None:
            raise _NotStaged("the local descriptor list was prepared before staging was set up")
        lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
        rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
        if lid.size == 0 or lid.size != rid.size:
            raise _NotStaged(f"{lid.size} local vs {rid.size} remote descriptors")
        lrows, rrows = _rows(ltab[1], lid), _rows(rtab[1], rid)
        lens = np.unique(np.concatenate((lrows[:, 1], rrows[:, 1])))
        if lens.size != 1:
            raise _NotStaged("descriptors of unequal lengths")
        slot = int(lens[0])
        need = slot * lid.size
        if need > self._capacity:
            raise _NotStaged(f"a request of {need >> 20} MiB exceeds the staging buffer "
                             f"({self._capacity >> 20} MiB; PDPATCH_KV_STAGING_MIB)")
        slot_handle = self._slot_handle(slot, int(lrows[0, 2]))
        with self._lock:
            start = self._alloc.alloc(need, slot)
        if start is None:
            raise _NotStaged("the staging buffer is full with other requests' READs")
        staged = stage_ids(lrows, rrows, np.arange(lid.size), np.arange(rid.size),
                           self._base + start, slot, lid.size)
        slot_ids = start // slot + staged.staging_ids
        r_order = staged.remote_ids
        stock = merged_count(lid, rid, lrows[:, 0], rrows[:, 0], lrows[:, 1])
        count = merged_count(slot_ids, twin.position[rid[r_order]],
                             self._base + slot * slot_ids, rrows[r_order, 0], rrows[r_order, 1])
        job = _Job(start, need, staged.copies, twin.peer)
        return job, slot_handle, slot_ids, twin.position[rid[r_order]], stock, count

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
            descs = self._agent.get_reg_descs([(self._base, self._capacity, dev, "")],
                                              self._mem_type)
            reg = self._agent.register_memory(descs)
            with self._lock:
                self._registered[dev] = reg if reg is not None else descs
        table = staging_table(self._base, slot, self._capacity // slot, dev)
        handle = self.prep_xfer_dlist(INIT_AGENT, self.get_xfer_descs(table, self._mem_type))
        with self._lock:
            self._slot_handles[key] = handle
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        state = self._agent.transfer(handle, *args, **kwargs)
        with self._lock:
            staged = handle in self._jobs
        # Landed in staging is not landed in the KV cache: the caller must poll, which copies.
        return PROC if staged and state == DONE else state

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
                job.event = self._copier.launch(job.copies)
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
        self._finish(handle)
        return self._agent.release_xfer_handle(handle, *args, **kwargs)

    def _finish(self, handle: Any) -> None:
        with self._lock:
            job = self._jobs.pop(handle, None)
        if job is not None:
            self._release(job)

    def _release(self, job: _Job) -> None:
        with self._lock:
            self._alloc.free(job.start, job.nbytes)

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


def _rows(table: Any, ids: np.ndarray) -> np.ndarray:
    """``(addr, len, dev)`` of ``ids`` in a prepared list (vLLM's list of tuples or Nx3)."""
    if isinstance(table, np.ndarray):
        return table[ids, :3].astype(np.int64)
    return np.asarray([table[i][:3] for i in ids.tolist()], dtype=np.int64).reshape(-1, 3)

