"""Staged READs inside a worker's NIXL agent, for peers whose K/V placement was converted.

Why: a converted peer pairs a contiguous run on one side with a strided run on the other, so
NIXL cannot merge anything and a READ costs one descriptor per block segment -- 0.04-1.1x of
the fused path on an H100/H200 (docs/gpu_results.md).  Staging (:mod:`.plans`) turns the
same request into a READ into a staging buffer laid out in the peer's address order
(remote-contiguous runs merge into one descriptor) plus one local gather.

:class:`StagingAgent` does that without touching vLLM's read path: it stands in for the
worker's ``nixl_wrapper`` and

* remembers the descriptor rows behind every prepared list (``get_xfer_descs`` ->
  ``prep_xfer_dlist``; :mod:`.lists`), so a request's ids can be turned back into addresses;
* posts a READ whose remote list was marked converted (:meth:`StagingAgent.mark_converted`)
  into staging instead of the local list, the peer's rows in address order, each run of them
  one descriptor (:mod:`.reads`: one such READ);
* when NIXL reports that READ ``DONE``, launches the gather staging -> KV cache (a side CUDA
  stream on GPU) and keeps answering ``PROC`` until it has finished: vLLM counts a request's
  blocks as received on ``DONE``, so they are complete by then.  A failed gather answers
  ``ERR``, which vLLM turns into a per-request failure (its blocks are recomputed);
* reads a request larger than the free staging in chunks, pipelined through two lanes of
  the buffer, behind one handle (:mod:`.chunked`).

Everything else goes to the real agent unchanged.  A request that cannot be staged (staging
full with other READs, a descriptor larger than half of it, descriptors of unequal lengths, a
local list not seen being prepared) is posted exactly as vLLM built it, and the reason is
counted and logged once.

The staging buffer (``capacity`` bytes on the KV cache's device; :mod:`.buffer`) is allocated
at the first READ to stage and registered with NIXL per slot length.  Needs torch (not vLLM).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pdpatch.agent_proxy import AgentProxy
from pdpatch.kv.staging.buffer import StagingBuffer
from pdpatch.kv.staging.chunked import LANES, ChunkedRead, ChunkedReads, SerialAgent
from pdpatch.kv.staging.lists import PreparedLists
from pdpatch.kv.staging.nixl_states import DONE, ERR, INIT_AGENT, PROC
from pdpatch.kv.staging.reads import NotStaged, ReadPlanner, StagedRead, StagingStats
from pdpatch.kv.staging.rows import StagedPeer
from pdpatch.kv.staging.timeline import ReadTimelines
from pdpatch.log import logger

GATHER_WAIT_BYTES = 128 << 20
"""A staged READ's gather of at most this many bytes is waited for in the poll that sees the
READ land (~0.1 ms at the copier's ~1 TB/s): answered ``PROC`` instead, the READ would end
one engine step later than vLLM's own, since vLLM polls once per step (a one-block READ at
8B geometry: 4.06 ms staged vs 1.00 ms stock, 2026-11-29).  Larger ones (a staging buffer
set above the default) are left to run while vLLM steps."""


class StagingAgent(AgentProxy):
    """A worker's NIXL agent with staged READs for converted peers (see the module doc): a
    proxy in front of it (:class:`pdpatch.agent_proxy.AgentProxy`) of kind ``staging``.

    ``memory`` gives, at the first READ to stage, the tensors whose memory the
    local descriptor lists point into (the KV caches, or vLLM's host buffers); the staging
    buffer is allocated on their device.  ``capacity`` bytes: 0 turns staging off.

    ``gap``: how many unrequested bytes a READ may read between two requested rows of a peer
    marked with its read ranges, so that nearby blocks share one descriptor (the bytes
    between them stay in staging).  ``None`` measures it per peer at its first staged READ
    (:mod:`.calibration`); 0 turns gap reads off.

    ``capacity_setting`` / ``gap_setting``: what the operator sets to change ``capacity`` /
    ``gap``, named in the messages (the patch knows its settings; this core does not).

    ``stats``: where to count (the patch passes its process state's; default: a fresh one).

    ``eager``: the worker will stage READs (coalescing on, or a kvcached pool): the table of
    each of its own lists is built when the list is prepared -- at start-up, for the list
    vLLM registers with its KV caches -- not in a peer's first READ (~35 ms per 500k rows);
    the gather's copy kernels are loaded then too.

    ``buffer_at_start``: with ``eager``, the staging buffer is made and registered then as
    well (coalescing on: every READ will be staged), not in the first READ: 31-45 ms of a
    first request on an H200 (runs cl, cu: "made in" 45 ms for 1 GiB, 31 ms for 128 MiB).

    ``on_posted(bytes)`` is called for every staged READ handed to NIXL, with the bytes it
    requested: how whoever made the agent counts them (the ``kv_segments`` patch, for
    ``/metrics``), without this core knowing how.
    """

    kind = "staging"

    def __init__(self, agent: Any, *, mem_type: str, capacity: int,
                 memory: Callable[[], Sequence[Any]], gap: int | None = None,
                 capacity_setting: str = "the staging capacity",
                 gap_setting: str = "the gap budget",
                 stats: StagingStats | None = None, eager: bool = False,
                 buffer_at_start: bool = False,
                 on_posted: Callable[[int], None] | None = None) -> None:
        AgentProxy.__init__(self, agent)
        self._eager = eager
        self._buffer_at_start = buffer_at_start
        # The calls this agent, its parts and the chunk driver thread make to the agent below
        # take one lock (:class:`SerialAgent`); the calls it only passes on (AgentProxy) reach
        # the agent as they are, as before.  Its parts hold that view of ``agent`` itself: a
        # staging proxy stands right in front of the real agent (whoever stacks proxies keeps
        # it innermost), so the agent below it never changes.
        self._nixl = SerialAgent(agent)
        self._capacity_setting = capacity_setting
        self._gap_setting = gap_setting
        self._mem_type = mem_type
        self._staging = StagingBuffer(self._nixl, mem_type=mem_type, capacity=capacity,
                                      memory=memory, setting=capacity_setting)
        self._lists = PreparedLists()
        self._lock = threading.Lock()
        self._converted: dict[Any, StagedPeer] = {}      # remote dlist handle -> its peer
        self._reads: dict[Any, StagedRead] = {}         # xfer handle -> staged READ
        self._timelines = ReadTimelines()               # at DEBUG: every READ's polls
        self.stats = StagingStats() if stats is None else stats
        self._on_posted = on_posted or (lambda nbytes: None)
        self._chunked = ChunkedReads(self._nixl, self._staging, self._lock, self.stats,
                                     mem_type)
        self._planner = ReadPlanner(self._nixl, mem_type=mem_type, staging=self._staging,
                                    lists=self._lists, lock=self._lock, stats=self.stats,
                                    gap=gap, capacity_setting=capacity_setting,
                                    gap_setting=gap_setting)

    @property
    def agent(self) -> Any:
        return self._agent

    @property
    def staging_allocated(self) -> int:
        """Bytes of staging memory this agent holds (0 until the first READ it stages)."""
        return self._staging.allocated

    @property
    def staging_free(self) -> int:
        """Bytes of staging not held by a READ in flight."""
        return self._staging.free_bytes

    # ------------------------------------------------------------ descriptor-list bookkeeping
    def get_xfer_descs(self, descs: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._nixl.get_xfer_descs(descs, *args, **kwargs)
        self._lists.built(out, descs)
        return out

    def prep_xfer_dlist(self, agent_name: Any, descs: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._nixl.prep_xfer_dlist(agent_name, descs, *args, **kwargs)
        self._lists.prepared(handle, agent_name, descs)
        if self._eager and agent_name == INIT_AGENT:
            table = self._lists.table(handle)
            self._staging.warm()
            if self._buffer_at_start and table is not None:
                self._make_buffer(table.dev)
        return handle

    def _make_buffer(self, dev: int) -> None:
        """The staging buffer made and registered under the local lists' device id now, at
        start-up; where that fails the first READ tries again (a start-up must not fail for
        a speed-up)."""
        try:
            self._staging.ensure()
        except NotStaged:           # logged there; staging is off
            return
        try:
            self._staging.register(dev)
        except Exception as exc:
            logger.warning("pdpatch kv_segments: the staging buffer could not be registered "
                           "with NIXL at start-up (%s: %s); the first staged READ tries again",
                           type(exc).__name__, exc)

    def release_dlist_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        self._lists.released(handle)
        with self._lock:
            peer = self._converted.pop(handle, None)
        if peer is not None and peer.twin is not None:
            self._nixl.release_dlist_handle(peer.twin.handle)
        return self._nixl.release_dlist_handle(handle, *args, **kwargs)

    def mark_converted(self, remote_handle: Any, peer: str,
                       read_ranges: Sequence[tuple[int, int]] | None = None) -> bool:
        """READs against ``remote_handle`` (a converted peer's prepared list) are staged from
        now on.  False (and a log line) when staging is off or cannot be set up.

        ``read_ranges``: the peer's memory one descriptor may cover, unrequested bytes
        included (:meth:`pdpatch.kv.geometry.KVGeometry.read_ranges`).  With them a READ
        posts lists of its own runs of the peer's rows, and gap reads; without them, ids into
        the peer's twin (:class:`~.rows.SortedTwin`), where NIXL merges what it may.

        Nothing is prepared here: this runs in the peer's first request."""
        if self._staging.capacity <= 0:
            return False
        entry = self._lists.entry(remote_handle)
        if entry is None:
            logger.warning("pdpatch kv_segments: peer %s's descriptor list was prepared "
                           "before staging was set up; its READs go per segment", peer)
            return False
        table = self._lists.table(remote_handle)
        if table is None or table.length is None:
            logger.info("pdpatch kv_segments: peer %s's descriptors differ in length; its "
                        "READs go per segment", peer)
            return False
        ranges = sorted((int(s), int(e)) for s, e in read_ranges) if read_ranges else None
        with self._lock:
            self._converted[remote_handle] = StagedPeer(peer, entry[0], table, ranges)
        return True

    # -------------------------------------------------------------------------- transfers
    def make_prepped_xfer(self, op: str, local_handle: Any, local_ids: Any, remote_handle: Any,
                          remote_ids: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            peer = self._converted.get(remote_handle) if op == "READ" else None
        if peer is None:
            return self._nixl.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                                 remote_ids, *args, **kwargs)
        t0 = time.perf_counter()
        try:
            planned = self._planner.plan(local_handle, local_ids, peer, remote_ids)
        except NotStaged as why:
            self._not_staged(str(why))
            return self._nixl.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                                 remote_ids, *args, **kwargs)
        try:
            self._planner.own_lists(peer, planned)
        except Exception as exc:     # a span NIXL refused: plan this READ again without
            self._refused(peer, planned, exc)
            return self.make_prepped_xfer(op, local_handle, local_ids, remote_handle,
                                          remote_ids, *args, **kwargs)
        planning_ms = (time.perf_counter() - t0) * 1e3    # the first one sets staging up
        if isinstance(planned, ChunkedRead):
            return self._post_chunked(planned, args, kwargs, planning_ms)
        read = planned
        try:
            if read.ids is not None:
                handle = self._nixl.make_prepped_xfer("READ", *read.ids, *args, **kwargs)
            else:
                local, remote = read.dlists
                ids = np.arange(read.spans.start.size, dtype=np.int64)
                handle = self._nixl.make_prepped_xfer("READ", local, ids, remote, ids,
                                                       *args, **kwargs)
        except BaseException:
            self._release(read)
            raise
        with self._lock:
            self._reads[handle] = read
            first = self.stats.posted(read)
        self._on_posted(read.requested)
        (logger.info if first else logger.debug)(
            "pdpatch kv_segments: staged READ from %s: %d KiB in %d descriptors instead of "
            "%d%s (planned in %.1f ms)", read.peer, read.requested >> 10, read.staged,
            read.stock, _gap_words(read), planning_ms)
        return handle

    def _refused(self, peer: StagedPeer, read: StagedRead | ChunkedRead,
                 exc: Exception) -> None:
        """NIXL refused a span of the peer's memory (one that crosses a registration: the
        peer's read ranges were wrong).  Gap reads from the peer stop; if the span was a run
        of requested rows, its READs go through its twin from now on, where NIXL merges."""
        if isinstance(read, ChunkedRead):
            self._chunked.discard(read)
        else:
            self._release(read)
        if read.gap_bytes:
            peer.gap = 0
            logger.warning("pdpatch kv_segments: no gap reads from %s: NIXL refused a span "
                           "of its memory (%s: %s); its READs are staged without them",
                           peer.name, type(exc).__name__, exc)
            return
        peer.ranges = None
        logger.warning("pdpatch kv_segments: NIXL refused a run of %s's memory (%s: %s); its "
                       "READs are staged through a copy of its list in address order",
                       peer.name, type(exc).__name__, exc)

    def _post_chunked(self, read: ChunkedRead, args: tuple, kwargs: dict,
                      planning_ms: float) -> Any:
        """A READ larger than the free staging: its first chunk's NIXL READ is vLLM's handle
        (:mod:`.chunked`).  The notification vLLM asks for is sent once every chunk has
        landed, not with any chunk."""
        kwargs = dict(kwargs)
        notif = kwargs.pop("notif_msg", args[0] if args else b"")
        if len(args) > 1:
            kwargs["backends"] = args[1]
        read.notif = notif.encode() if isinstance(notif, str) else bytes(notif)
        read.xfer_kwargs = {k: v for k, v in kwargs.items() if k != "skip_desc_merge"}
        handle = self._chunked.make(read)
        with self._lock:
            first = self.stats.posted(read)
        self._on_posted(read.nbytes)
        (logger.info if first else logger.debug)(
            "pdpatch kv_segments: staged READ from %s in %d chunks of up to %d KiB, %d in "
            "flight: %d KiB in %d descriptors instead of %d%s (planned in %.1f ms)", read.peer,
            read.bounds.size - 1, read.lane_bytes >> 10, LANES, read.nbytes >> 10, read.staged,
            read.stock, _gap_words(read), planning_ms)
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if self._chunked.owns(handle):
            return self._chunked.transfer(handle)
        began = time.perf_counter()
        state = self._nixl.transfer(handle, *args, **kwargs)
        with self._lock:
            read = self._reads.get(handle)
        if self._timelines.wanted():
            self._timelines.posted(handle, "vLLM's" if read is None else "staged", began)
        if read is None:
            if state != PROC:        # done (or failed) in the post itself
                self._timelines.ended(handle, state)
            return state
        try:
            # host work while NIXL moves the bytes
            read.ops = self._staging.prepare(read.gather(self._staging.base))
        except Exception as exc:     # fail the request once NIXL is done with the staging slots
            read.failure = exc
        self._timelines.mark(handle, "gather planned")
        # Landed in staging is not landed in the KV cache: the caller must poll, which copies.
        return PROC if state == DONE else state

    def check_xfer_state(self, handle: Any) -> Any:
        with self._lock:
            read = self._reads.get(handle)
        if read is None:
            if self._chunked.owns(handle):
                return self._chunked.state(handle)
            state = self._nixl.check_xfer_state(handle)
            self._timelines.polled(handle, state)
            if state != PROC:
                self._timelines.ended(handle, state)
            return state
        if not read.landed:
            state = self._nixl.check_xfer_state(handle)
            self._timelines.polled(handle, state)
            if state != DONE:
                if state != PROC:
                    self._timelines.ended(handle, state)
                    self._finish(handle)
                return state
            read.landed = True
            self._timelines.landed(handle)
            try:
                if read.failure is not None:
                    raise read.failure
                if not read.ops:      # posted without our transfer(): plan the gather now
                    read.ops = self._staging.prepare(read.gather(self._staging.base))
                read.event = self._staging.launch(read.ops)
                if read.event is not None and read.nbytes <= GATHER_WAIT_BYTES:
                    read.event.synchronize()
            except Exception as exc:
                return self._gather_failed(handle, exc)
        if read.event is not None and not read.event.query():
            self._timelines.polled(handle, "PROC (gather)")
            return PROC
        self._timelines.ended(handle, DONE)
        self._finish(handle)
        return DONE

    def _gather_failed(self, handle: Any, exc: Exception) -> str:
        with self._lock:
            self.stats.gather_failures += 1
        logger.error("pdpatch kv_segments: copying a staged READ into the KV cache failed "
                     "(%s: %s); the request fails and its blocks are recomputed",
                     type(exc).__name__, exc)
        self._timelines.ended(handle, ERR)
        self._finish(handle)
        return ERR

    def get_xfer_telemetry(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if self._chunked.owns(handle):
            return self._chunked.telemetry(handle)
        return self._nixl.get_xfer_telemetry(handle, *args, **kwargs)

    def release_xfer_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        if self._chunked.owns(handle):
            return self._chunked.release(handle)
        # NIXL first: should it refuse to let go of a READ in flight, the staging slots stay
        # reserved rather than be handed to another READ while this one still writes them.
        result = self._nixl.release_xfer_handle(handle, *args, **kwargs)
        self._timelines.ended(handle, "released")       # one vLLM let go of before its end
        self._finish(handle)
        return result

    def _finish(self, handle: Any) -> None:
        with self._lock:
            read = self._reads.pop(handle, None)
        if read is None:
            return
        if read.event is not None:
            read.event.synchronize()   # a gather still reading the slots (request aborted)
        self._release(read)

    def _release(self, read: StagedRead) -> None:
        for dlist in read.dlists:
            self._nixl.release_dlist_handle(dlist)
        self._staging.free(read.start, read.nbytes)

    def close(self) -> None:
        """Release the staging lists and registration (the worker's shutdown, or a test's)."""
        with self._lock:
            twins = [p.twin.handle for p in self._converted.values() if p.twin is not None]
            self._converted.clear()
        self._staging.turn_off()
        self._chunked.close()
        for handle in twins:
            self._nixl.release_dlist_handle(handle)
        self._staging.close()

    def _not_staged(self, reason: str) -> None:
        with self._lock:
            self.stats.not_staged[reason] += 1
            first = self.stats.not_staged[reason] == 1
        (logger.info if first else logger.debug)(
            "pdpatch kv_segments: READ posted as vLLM built it: %s", reason)


def _gap_words(read: StagedRead | ChunkedRead) -> str:
    """A READ's log words for the bytes it reads between requested blocks ("" for none)."""
    return (f", reading {read.gap_bytes >> 10} KiB between requested blocks"
            if read.gap_bytes else "")
