"""Staged READs larger than the free staging: one vLLM READ read as a pipeline of chunks.

Why: a request whose rows do not fit the staging buffer used to go the per-segment way (one
NIXL descriptor per block segment), slower than the stock pair exactly where transfers are
long (issue 24: 1,500 tokens at 8B geometry, 188 MiB, 106 ms against 85 ms stock).  Here its
rows (in the peer's address order) are cut into chunks (:func:`~.plans.chunk_rows`); the
first :data:`LANES` chunks are read into one lane of the staging buffer each, and each chunk
is gathered from its lane into the KV cache once it has landed; the next chunk not yet posted
goes into the lane whose gather finished (chunks land in any order).
So NIXL reads chunk ``c + 1`` while chunk ``c`` is gathered, and no lane is written while a
gather still reads it.

What drives the pipeline: a small thread per agent (:class:`ChunkedReads`), awake only while
chunked READs are in flight.  vLLM polls a READ once per engine step (``get_finished``), tens
of milliseconds under decode load; a pipeline advanced only by that poll would take one step
per chunk, slower than the per-segment READ it replaces.  NIXL's Python API gives the
initiator no completion callback (its notifications go to the peer), so the thread polls the
chunks' NIXL states, sleeping :data:`POLL_S` when nothing moved; vLLM's own polls advance the
pipeline too.  On a GPU the driver's own host work sets the pace, not NIXL: a 32 MiB chunk's
READ lands in 0.04-0.14 ms on an H200, while posting it, launching its gather and preparing
the next took the driver 0.3-0.5 ms a chunk (``scripts/bench_chunk_pace.py``).  So the
READ's whole gather is prepared once, at its first post (:meth:`ChunkedReads._gather_ops`),
and a chunk's gather is a slice of it: 2 GiB through the default 128 MiB buffer in 9 ms
instead of 29 (the bench), 12.6 ms against stock's 905 in vLLM 0.25.1's engines (run cz).

What vLLM sees: one handle, the first chunk's own NIXL handle (so any call pdpatch does not
know about still reaches a real READ), answering ``PROC`` until every chunk is gathered, then
``DONE``; ``ERR`` when a chunk READ or gather failed (vLLM fails that request and recomputes
its blocks).  The READ's notification (vLLM's ``notif_msg``, on which P frees the blocks) is
sent once every chunk has landed, never with a chunk: a chunk READ that completes first must
not let P free blocks another chunk still reads.  The lanes go back to the allocator only
when vLLM releases the handle and every chunk posted is released (NIXL cancels it) or ended.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import numpy as np

from pdpatch.kv.staging.lists import prep_rows
from pdpatch.kv.staging.nixl_states import DONE, ERR, INIT_AGENT, PROC
from pdpatch.kv.staging.plans import CopyPlan, read_spans
from pdpatch.log import logger

if TYPE_CHECKING:
    from pdpatch.kv.staging.buffer import StagingBuffer
    from pdpatch.kv.staging.reads import StagingStats

LANES = 2
"""Chunks in flight at once: one read by NIXL while the one before it is gathered."""
POLL_S = 20e-6
"""The driver's sleep when no chunk moved (the OS makes it ~60-80 us)."""
END_WAIT_S = 30.0
"""How long a release waits for a chunk READ NIXL would not cancel to end by itself."""


class SerialAgent:
    """A NIXL agent whose calls take one lock, for the staging agent and its chunk driver.

    Why: vLLM makes its agent without NIXL's own locking (``nixl_agent_config`` without a
    listener thread: sync mode NONE), and chunked READs call it from a second thread, the
    driver, while vLLM's thread posts and polls other READs through the staging agent.  The
    lock is held only for the call into NIXL, never while it waits for a READ.  (Calls the
    staging agent merely passes on, e.g. vLLM's own ``send_notif``, are not serialized: the
    layer hands vLLM the agent's own attributes, as before.)"""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.RLock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attr(*args, **kwargs)
        return call


@dataclass(eq=False)
class Chunk:
    """Rows ``[first, end)`` of a chunked READ, read into lane ``lane``."""

    first: int
    end: int
    lane: int
    handle: Any = None         # its NIXL READ, once posted
    dlist: Any = None          # its lane's list of the READ's runs (a READ of runs)
    landed: bool = False
    ops: list = field(default_factory=list)     # its gather, prepared while NIXL reads
    event: Any = None
    gathered: bool = False
    # perf_counter() at each stage, for the READ's DEBUG line (:func:`describe`)
    made_ms: float = 0.0       # making its NIXL READ (its lane's list, ``make_prepped_xfer``)
    t_posted: float = 0.0      # ``transfer`` returned
    t_landed: float = 0.0      # the poll that saw it DONE
    t_gathered: float = 0.0    # its gather seen finished


@dataclass(eq=False)
class ChunkRuns:
    """A chunked READ's runs of the peer, cut at its chunk edges: one list of the peer's side
    for the whole READ (``handle``, prepared before it is posted); each chunk prepares a list
    of its lane of the same lengths when it is posted.  A gap READ's runs
    (:func:`~.plans.pack_spans`) also read the bytes between their rows."""

    first: np.ndarray          # each run's first row (rows in the peer's address order)
    start: np.ndarray          # the peer's address of each run
    length: np.ndarray         # bytes
    lane_off: np.ndarray       # each run's offset in its chunk's lane
    handle: Any = None

    @classmethod
    def of(cls, start: np.ndarray, slot: int, joins: np.ndarray, bounds: np.ndarray
           ) -> ChunkRuns:
        """``joins[i]``: row ``i + 1`` continues row ``i``'s run (rows at ``start``,
        address-sorted, ``slot`` bytes each); chunk ``c`` is rows ``[bounds[c],
        bounds[c + 1])``."""
        cut = joins.copy()
        cut[bounds[1:-1] - 1] = False
        first, last, _ = read_spans(start, start + slot, cut, 0, None)
        chunk_first = bounds[np.searchsorted(bounds, first, side="right") - 1]
        return cls(first, start[first], start[last] + slot - start[first],
                   (first - chunk_first) * slot)

    def of_chunk(self, chunk: Chunk) -> tuple[int, int]:
        """The runs ``[lo, hi)`` of one chunk."""
        return (int(np.searchsorted(self.first, chunk.first)),
                int(np.searchsorted(self.first, chunk.end)))


@dataclass(eq=False)      # identity: its arrays have no truth value to compare by
class ChunkedRead:
    """One vLLM READ staged in chunks (planned by :meth:`ReadPlanner.plan`): its chunks read
    lists of their runs (``runs``), or ids into the peer's twin (``twin_ids``)."""

    peer: str
    agent_name: Any            # the peer's NIXL agent (the notification goes there)
    slot: int
    dev: int
    stock: int                 # descriptors vLLM's own READ would have posted
    staged: int                # descriptors of all chunks together
    local_addr: np.ndarray     # where each row (the peer's address order) goes in the KV cache
    lanes: list[int]           # staging offset of each lane
    lane_bytes: int
    bounds: np.ndarray         # chunk c = rows [bounds[c], bounds[c + 1])
    runs: ChunkRuns | None = None
    twin_ids: tuple | None = None    # (staging slot list, the peer's twin, rows in the twin)
    row_off: np.ndarray | None = None   # each row's offset in its chunk's lane (a gap READ)
    scatter: Any = None        # its whole gather, prepared at its first post (RowScatter)
    scatter_tried: bool = False
    notif: bytes = b""
    xfer_kwargs: dict = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    failure: str | None = None
    notified: bool = False
    released: bool = False
    t_start: float = 0.0
    t_post: float = 0.0
    t_end: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return self.slot * self.local_addr.size

    @property
    def gap_bytes(self) -> int:
        """The unrequested bytes it reads between requested rows (a gap READ's runs)."""
        return 0 if self.row_off is None else int(self.runs.length.sum()) - self.nbytes

    @property
    def done(self) -> bool:
        return len(self.chunks) == self.bounds.size - 1 and all(c.gathered for c in self.chunks)

    def chunk(self, c: int, lane: int) -> Chunk:
        return Chunk(int(self.bounds[c]), int(self.bounds[c + 1]), lane)

    def gather(self, chunk: Chunk, base: int) -> CopyPlan:
        """Lane -> KV cache for one chunk's rows."""
        n = chunk.end - chunk.first
        off = (np.arange(n, dtype=np.int64) * self.slot if self.row_off is None
               else self.row_off[chunk.first:chunk.end])
        src = base + self.lanes[chunk.lane] + off
        return CopyPlan(src, self.local_addr[chunk.first:chunk.end],
                        np.full(n, self.slot, dtype=np.int64))


def describe(read: ChunkedRead) -> str:
    """The DEBUG line of a chunked READ that is done: where its time went, chunk by chunk.

    Why: vLLM's ``nixl_xfer_time`` of a chunked READ is one span from the first post to the
    last gather; a slow one (a first chunked READ from a TP-1 peer into a TP-2 kvcached D
    took 1.0-1.5 s where later ones of more bytes took 0.3 s, GPU run ay) does not say
    whether NIXL moved the chunks slowly, a gather waited, or the pipeline stood idle."""
    cs = read.chunks
    ms = lambda a, b: (b - a) * 1e3  # noqa: E731
    flight = [ms(c.t_posted, c.t_landed) for c in cs]
    gather = [ms(c.t_landed, c.t_gathered) for c in cs]
    slowest = int(np.argmax(flight))
    # per lane, in post order: how long after a chunk's gather the next chunk was posted
    waits = [ms(a.t_gathered, b.t_posted)
             for lane in range(LANES) for a, b in pairwise([c for c in cs if c.lane == lane])]
    lane_waits = (f"median {float(np.median(waits)):.2f}, slowest {max(waits):.2f} ms"
                  if waits else "none")
    return (f"chunked READ from {read.peer} DONE: {len(cs)} chunks, {read.staged} "
            f"descriptors, {read.nbytes >> 10} KiB in {ms(read.t_start, read.t_end):.2f} ms "
            f"from the first post; making each chunk's READ median "
            f"{float(np.median([c.made_ms for c in cs])):.2f}, first {cs[0].made_ms:.2f} ms; "
            f"in NIXL median {float(np.median(flight)):.2f}, slowest {flight[slowest]:.2f} ms "
            f"(chunk {slowest + 1}, posted at +{ms(read.t_start, cs[slowest].t_posted):.2f}); "
            f"gathers median {float(np.median(gather)):.2f}, slowest {max(gather):.2f} ms; "
            f"a lane's next post after its gather: {lane_waits}")


@dataclass(frozen=True)
class ChunkedTelemetry:
    """What vLLM records of a finished READ (``NixlKVConnectorStats.record_transfer``), for
    the whole chunked READ: from its first post to its last gather, every chunk's bytes and
    descriptors.  Times in microseconds, as NIXL's ``nixlXferTelemetry``."""

    startTime: int
    postDuration: int
    xferDuration: int
    totalBytes: int
    descCount: int


class ChunkedReads:
    """A staging agent's chunked READs and the thread that drives them (see the module doc).
    ``agent``: the real NIXL agent; ``staging``: the buffer whose lanes the reads hold;
    ``lock``/``stats``: the agent's."""

    def __init__(self, agent: Any, staging: StagingBuffer, lock: Any,
                 stats: StagingStats, mem_type: str) -> None:
        self._agent = agent
        self._mem_type = mem_type
        self._staging = staging
        self._lock = lock
        self.stats = stats
        self._reads: dict[Any, ChunkedRead] = {}       # first chunk's handle -> read
        self._active: list[ChunkedRead] = []           # posted, not done or failed
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def owns(self, handle: Any) -> bool:
        with self._lock:
            return handle in self._reads

    # ------------------------------------------------------------------ vLLM's calls
    def make(self, read: ChunkedRead) -> Any:
        """The first chunk's NIXL READ, which is the handle vLLM gets."""
        first = read.chunk(0, 0)
        try:
            first.handle = self._xfer(read, first)
        except BaseException:
            self.discard(read)
            raise
        read.chunks.append(first)
        with self._lock:
            self._reads[first.handle] = read
        return first.handle

    def transfer(self, handle: Any) -> str:
        """Post the first chunk of every lane and hand the READ to the driver."""
        read = self._get(handle)
        with read.lock:
            read.t_start = time.perf_counter()
            try:
                self._post(read, read.chunks[0])
                for c in range(1, min(LANES, read.bounds.size - 1)):
                    self._post(read, read.chunk(c, c))
            except Exception as exc:
                self._fail(read, f"posting a chunk READ failed ({type(exc).__name__}: {exc})")
            read.t_post = time.perf_counter()
            if read.failure is not None:
                return ERR
        with self._wake:
            self._active.append(read)
            if self._thread is None:
                self._thread = threading.Thread(target=self._drive, daemon=True,
                                                name="pdpatch-staged-chunks")
                self._thread.start()
            self._wake.notify()
        return PROC

    def state(self, handle: Any) -> str:
        read = self._get(handle)
        with read.lock:
            if read.failure is None and not read.done:
                self._step(read)
            if read.failure is not None:
                return ERR
            return DONE if read.done else PROC

    def telemetry(self, handle: Any) -> ChunkedTelemetry:
        read = self._get(handle)
        end = read.t_end or time.perf_counter()
        return ChunkedTelemetry(int(read.t_start * 1e6), int((read.t_post - read.t_start) * 1e6),
                                int((end - read.t_start) * 1e6), read.nbytes, read.staged)

    def release(self, handle: Any) -> None:
        """vLLM lets the READ go (done, failed or aborted): every chunk posted is released --
        NIXL cancels one in flight, or it is waited for -- and then its lanes are free."""
        with self._lock:
            read = self._reads.pop(handle, None)
        if read is None:
            return
        with read.lock:
            read.released = True
            held = False
            for chunk in read.chunks:
                held |= not self._end(read, chunk)
            if not held:
                self.discard(read)
            else:
                logger.error("pdpatch kv_segments: a chunk READ from %s would not end; its "
                             "%d KiB of staging stay reserved", read.peer,
                             LANES * read.lane_bytes >> 10)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    # ------------------------------------------------------------------ the pipeline
    def _get(self, handle: Any) -> ChunkedRead:
        with self._lock:
            return self._reads[handle]

    def _post(self, read: ChunkedRead, chunk: Chunk) -> None:
        if chunk.handle is None:
            chunk.handle = self._xfer(read, chunk)
            read.chunks.append(chunk)
        state = self._agent.transfer(chunk.handle)
        chunk.t_posted = time.perf_counter()
        if state not in (PROC, DONE):
            raise RuntimeError(f"NIXL answered {state}")
        chunk.ops = self._gather_ops(read, chunk)

    def _gather_ops(self, read: ChunkedRead, chunk: Chunk) -> list:
        """The chunk's gather, prepared while NIXL reads it: a slice of the READ's whole
        gather, made once at its first post, or, where the copier cannot take it so, prepared
        for this chunk alone."""
        if not read.scatter_tried:
            read.scatter_tried = True
            read.scatter = self._staging.row_scatter(read.local_addr, read.slot, read.lanes,
                                                     read.lane_bytes, read.row_off)
        if read.scatter is not None:
            return read.scatter.ops(chunk.first, chunk.end,
                                    self._staging.base + read.lanes[chunk.lane])
        return self._staging.prepare(read.gather(chunk, self._staging.base))

    def _xfer(self, read: ChunkedRead, chunk: Chunk) -> Any:
        """The chunk's NIXL READ into its lane (rows back to back in the peer's order)."""
        t0 = time.perf_counter()
        n = chunk.end - chunk.first
        lane = self._staging.base + read.lanes[chunk.lane]
        if read.runs is None:
            slots, twin, r_ids = read.twin_ids
            ids = read.lanes[chunk.lane] // read.slot + np.arange(n, dtype=np.int64)
            handle = self._agent.make_prepped_xfer("READ", slots, ids, twin,
                                                   r_ids[chunk.first:chunk.end],
                                                   **read.xfer_kwargs)
            chunk.made_ms = (time.perf_counter() - t0) * 1e3
            return handle
        lo, hi = read.runs.of_chunk(chunk)
        chunk.dlist = prep_rows(self._agent, INIT_AGENT,
                                lane + read.runs.lane_off[lo:hi],
                                read.runs.length[lo:hi], read.dev, self._mem_type)
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", chunk.dlist, np.arange(hi - lo, dtype=np.int64), read.runs.handle,
                np.arange(lo, hi, dtype=np.int64), **read.xfer_kwargs)
            chunk.made_ms = (time.perf_counter() - t0) * 1e3
            return handle
        except BaseException:
            self._agent.release_dlist_handle(chunk.dlist)
            chunk.dlist = None
            raise

    def _step(self, read: ChunkedRead) -> bool:
        """Advance ``read`` as far as it goes without waiting (its lock held); True when
        something moved."""
        moved = False
        for chunk in list(read.chunks):
            if chunk.gathered:
                continue
            if not chunk.landed:
                state = self._agent.check_xfer_state(chunk.handle)
                if state == PROC:
                    continue
                if state != DONE:
                    self._fail(read, f"chunk READ {read.chunks.index(chunk) + 1} of "
                                     f"{read.bounds.size - 1} ended {state}")
                    return True
                chunk.landed = moved = True
                chunk.t_landed = time.perf_counter()
                try:
                    chunk.event = self._staging.launch(chunk.ops)
                except Exception as exc:
                    self._fail(read, f"gathering a chunk into the KV cache failed "
                                     f"({type(exc).__name__}: {exc})", gather=True)
                    return True
            if chunk.event is not None and not chunk.event.query():
                continue
            chunk.gathered, chunk.ops, moved = True, [], True
            chunk.t_gathered = time.perf_counter()
            c = len(read.chunks)
            if c < read.bounds.size - 1:
                # the lane is free (chunks may land out of order): the next chunk goes there
                nxt = read.chunk(c, chunk.lane)
                try:
                    self._post(read, nxt)
                except Exception as exc:
                    self._fail(read, f"posting a chunk READ failed ({type(exc).__name__}: "
                                     f"{exc})")
                    return True
        if not read.notified and len(read.chunks) == read.bounds.size - 1 and \
                all(c.landed for c in read.chunks):
            read.notified = True
            if read.notif:
                try:
                    self._agent.send_notif(read.agent_name, notif_msg=read.notif)
                except Exception as exc:
                    logger.warning("pdpatch kv_segments: notifying %s that a chunked READ is "
                                   "done failed (%s: %s); P frees those blocks after its "
                                   "timeout", read.peer, type(exc).__name__, exc)
        if read.done and not read.t_end:
            read.t_end = time.perf_counter()
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("pdpatch kv_segments: %s", describe(read))
        return moved

    def _fail(self, read: ChunkedRead, why: str, gather: bool = False) -> None:
        read.failure = why
        with self._lock:
            self.stats.chunk_failures += 1
            if gather:
                self.stats.gather_failures += 1
        logger.error("pdpatch kv_segments: chunked READ from %s failed: %s; the request fails "
                     "and its blocks are recomputed", read.peer, why)

    def _drive(self) -> None:
        self._staging.enter_thread()
        while True:
            with self._wake:
                while not self._active and not self._closed:
                    self._wake.wait()
                if self._closed:
                    self._thread = None
                    return
                reads = list(self._active)
            moved = False
            for read in reads:
                if not read.lock.acquire(blocking=False):   # vLLM's thread polls or releases it
                    continue
                try:
                    if not read.released and read.failure is None and not read.done:
                        moved |= self._step(read)
                except Exception as exc:     # a fault of this READ fails it, not the driver
                    self._fail(read, f"{type(exc).__name__}: {exc}")
                finally:
                    over = read.released or read.failure is not None or read.done
                    read.lock.release()
                if over:
                    with self._wake:
                        self._active.remove(read)
            if not moved:
                time.sleep(POLL_S)

    def _end(self, read: ChunkedRead, chunk: Chunk) -> bool:
        """Release a chunk's NIXL READ (and wait for its gather); False when NIXL would
        neither cancel it nor see it end."""
        if chunk.event is not None:
            chunk.event.synchronize()
        try:
            self._agent.release_xfer_handle(chunk.handle)
        except Exception:
            deadline = time.monotonic() + END_WAIT_S
            while time.monotonic() < deadline and \
                    self._agent.check_xfer_state(chunk.handle) == PROC:
                time.sleep(POLL_S)
            try:
                self._agent.release_xfer_handle(chunk.handle)
            except Exception:
                return False
        if chunk.dlist is not None:
            self._agent.release_dlist_handle(chunk.dlist)
            chunk.dlist = None
        return True

    def discard(self, read: ChunkedRead) -> None:
        """Give back what the READ holds beside its chunks: its lanes, and the list of the
        peer's runs."""
        if read.runs is not None and read.runs.handle is not None:
            self._agent.release_dlist_handle(read.runs.handle)
            read.runs.handle = None
        for start in read.lanes:
            self._staging.free(start, read.lane_bytes)
