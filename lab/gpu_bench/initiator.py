"""The initiating side of every transfer (vLLM's decode worker, for READ)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from lab.kv_reference import nixl_merged_count
from pdpatch.kv import PairPlan
from pdpatch.kv.staging import ByteCopier, StagingAgent
from pdpatch.kv.staging.plans import CopyPlan
from pdpatch.transport import cuda_context_current

from .agents import Clock, new_agent, poll, wait
from .copier import CupyCopier
from .peer import Peer
from .pools import Pool, lazy_torch


@dataclass
class AgentRun:
    """The repetitions of one READ through the staging agent (see ``Bench.timed_agent``)."""

    times: list[float]
    count: int                 # NIXL's descCount of the last repetition
    copy_times: list[float]
    err: str | None
    expect: int                # the descCount the agent predicted
    plan_s: float              # best time to plan and post
    staged: bool
    wire: int                  # bytes read per READ, gaps included
    gap: int                   # the gap budget the agent measured (0: none)
    phases_ms: list[float] | None = None   # of the best repetition, see timed_agent


class Bench:
    """The initiator: its NIXL agent, the peer processes, the copy executors, and one transfer
    timed in each form (vLLM's prepared tables, per-request lists, pieces, the staging
    agent); what is measured is in :mod:`.cases` and :mod:`.checks`."""

    def __init__(self, args) -> None:
        self.args = args
        self.device = args.device
        self.ctx_at_agent = cuda_context_current()
        self.agent = new_agent("pdpatch-bench-init")
        self.results: list[dict] = []
        self.peers: dict[str, Peer] = {}
        self.known: dict[str, bool] = {}
        self.copiers: dict[str, Any] = {}
        self.notes: list[str] = []
        self.copy_tuning: dict = {}

    def sync(self) -> None:
        if self.device == "cuda":
            lazy_torch().cuda.synchronize()

    def peer(self, name: str, env: dict | None = None) -> Peer:
        if name not in self.peers:
            self.peers[name] = Peer(name, self.device, env)
        return self.peers[name]

    def add_remote(self, peer: Peer, md: bytes) -> None:
        if self.known.get(peer.name):
            self.agent.remove_remote_agent(peer.name)
        self.agent.add_remote_agent(md)
        self.known[peer.name] = True

    def copier(self, arenas: list, kind: str):
        if kind == "cupy":
            if "cupy" not in self.copiers:
                try:
                    self.copiers["cupy"] = CupyCopier()
                    self.copy_tuning = self.copiers["cupy"].tune()
                    print(f"   copy kernel tuning (GB/s): {self.copy_tuning}", flush=True)
                except Exception as e:  # fall back, and say so
                    self.notes.append(f"cupy copy kernel unavailable ({e!r}); torch-index used")
                    self.copiers["cupy"] = None
            if self.copiers["cupy"] is not None:
                return self.copiers["cupy"]
        return ByteCopier(arenas)

    def timed(self, op: str, dlists, lidx, ridx, copies: CopyPlan | None, copier,
              before, after) -> tuple[list[float], int, list[float], str | None]:
        """Repetitions of one transfer.  ``dlists()`` gives the local and remote dlist handles
        of a repetition and a function that releases them: tables prepared once (vLLM's form)
        or per-request lists, whose preparation is then inside the timing."""
        times, copy_times, count, err = [], [], 0, None
        for _ in range(self.args.reps):
            before()
            self.sync()
            t0 = time.perf_counter()
            if copies is not None and op == "WRITE":
                copier.run(copies)
            tc = time.perf_counter()
            lh, rh, release = dlists()
            h = self.agent.make_prepped_xfer(op, lh, lidx, rh, ridx)
            state, pending = self._read_then_copy(h, op, copies, copier)
            tx = time.perf_counter()
            if pending is not None:
                copier.launch(pending)
            tcopy = time.perf_counter()
            count = int(self.agent.get_xfer_telemetry(h).descCount)
            self.agent.release_xfer_handle(h)
            release()
            t1 = time.perf_counter()
            if state != "DONE":
                err = f"transfer state {state}"
            times.append(t1 - t0)
            copy_times.append((tc - t0) + (tcopy - tx))
            err = err or after()
            if err:
                break
        return times, count, copy_times, err

    def timed_agent(self, lp: Pool, peer_name: str, pair: PairPlan, li, ri, before, after,
                    read_ranges=None, capacity=None):
        """Repetitions of one READ posted the way vLLM's worker posts it (tables prepared once,
        ``make_prepped_xfer`` with its desc ids, ``transfer``, then ``check_xfer_state`` until
        DONE) through :class:`pdpatch.kv.staging.StagingAgent` -- the object the kv_segments
        patch puts in front of the worker's agent -- with the peer marked converted.  The
        timing includes the agent's planning and its gather into the local pool.

        With ``read_ranges`` the agent also reads gaps, with the budget it measures itself at
        the first READ (as inside vLLM unless PDPATCH_KV_GAP_KIB is set); that first
        repetition's time includes the measurement, the best repetition does not."""
        wire = len(li) * int(pair.local_table()[0, 1])
        clock = Clock(self.agent)
        agent = StagingAgent(clock, mem_type=lp.mem,
                             capacity=capacity or wire + (1 << 20), memory=lambda: lp.tensors)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", pair.local_table(), lp.mem)
        rh = agent.prep_xfer_dlist(peer_name, pair.remote_table(), lp.mem)
        times, copy_times, plan_times, count, err = [], [], [], 0, None
        phases = []
        try:
            if not agent.mark_converted(rh, peer_name, read_ranges):
                return AgentRun([float("inf")], 0, [0.0], "staging agent refused the peer", 0,
                                0.0, False, wire, 0)
            for _ in range(self.args.reps):
                before()
                self.sync()
                t0 = time.perf_counter()
                h = agent.make_prepped_xfer("READ", lh, li, rh, ri)
                tp = time.perf_counter()
                posted = agent.transfer(h)
                tg = time.perf_counter()
                state = poll(agent, h, posted)
                t1 = time.perf_counter()
                plan_times.append(tp - t0)
                landed = clock.landed.get(h, t1)
                # ms: planning, NIXL's transfer(), the gather's planning (overlaps the wire),
                # posting to NIXL's DONE, and DONE to the gather's end
                phases.append((t1 - t0, [round(1e3 * x, 3) for x in (
                    tp - t0, clock.posted.get(h, tp) - tp, tg - clock.posted.get(h, tp),
                    landed - clock.posted.get(h, tp), t1 - landed)]))
                count = int(agent.get_xfer_telemetry(h).descCount)
                agent.release_xfer_handle(h)
                if state != "DONE":
                    err = f"transfer state {state}"
                times.append(t1 - t0)
                copy_times.append(0.0)
                err = err or after()
                if err:
                    break
            st = agent.stats
            if st.staged_reads and st.not_staged:
                err = err or f"staged only sometimes: {dict(st.not_staged)}"
            if st.not_staged:   # the agent judged staging not worth it: vLLM's own READ ran
                self.notes.append(f"{lp.geometry.label} vllm-agent not staged: "
                                  f"{sorted(st.not_staged)}")
                expect = nixl_merged_count(pair.local_table(), pair.remote_table(), li, ri)
            else:
                expect = st.descriptors_staged // max(st.staged_reads, 1)
            if st.gap_reads not in (0, st.staged_reads):
                err = err or f"gap reads only sometimes: {st.gap_reads} of {st.staged_reads}"
            if read_ranges is not None and peer_name not in st.gap_budgets:
                self.notes.append(f"{lp.geometry.label} vllm-agent+gap: the agent measured "
                                  "no gap budget (see its log line); no gap reads")
            wire += st.gap_bytes // max(st.staged_reads, 1)
            return AgentRun(times, count, copy_times, err, expect, min(plan_times),
                            st.staged_reads > 0, wire, st.gap_budgets.get(peer_name, 0),
                            min(phases)[1] if phases else None)
        finally:
            agent.release_dlist_handle(lh)
            agent.release_dlist_handle(rh)
            agent.close()

    def _read_then_copy(self, h, op: str, copies: CopyPlan | None, copier):
        """Run transfer ``h``; for a staged READ, build the copy table while NIXL moves the
        bytes and return it for launching once they have landed."""
        if copies is None or op != "READ":
            return wait(self.agent, h), None
        posted = self.agent.transfer(h)
        pending = copier.prepare(copies)  # host work that needs no bytes yet
        return poll(self.agent, h, posted), pending

    def timed_pipe(self, op: str, mem: str, peer_name: str, lists, pieces, copier, before,
                   after):
        """Staged transfer in pieces: all pieces posted at once (READ), each piece's copy
        launched as soon as it lands, so copying overlaps the rest of the transfer; WRITE
        copies piece i in, posts it, copies piece i+1 while i moves."""
        times, count, err = [], 0, None
        llist, rlist = lists
        sizes = [len(p.transfer) for p in pieces]
        starts = np.concatenate(([0], np.cumsum(sizes)))
        for _ in range(self.args.reps):
            before()
            self.sync()
            t0 = time.perf_counter()
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", llist, mem)
            rh = self.agent.prep_xfer_dlist(peer_name, rlist, mem)
            handles, states = [], []
            for i, p in enumerate(pieces):
                if op == "WRITE":
                    copier.run(p.copies, sync=True)
                idx = np.arange(starts[i], starts[i + 1])
                h = self.agent.make_prepped_xfer(op, lh, idx, rh, idx)
                states.append(self.agent.transfer(h))
                handles.append(h)
            deadline = time.monotonic() + 120
            for i, h in enumerate(handles):
                state = states[i]
                while state == "PROC" and time.monotonic() < deadline:
                    state = self.agent.check_xfer_state(h)
                if state != "DONE":
                    err = f"piece {i} transfer state {state}"
                if op == "READ":
                    copier.run(pieces[i].copies, sync=False)
            self.sync()
            t1 = time.perf_counter()
            count = sum(int(self.agent.get_xfer_telemetry(h).descCount) for h in handles)
            for h in handles:
                self.agent.release_xfer_handle(h)
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)
            times.append(t1 - t0)
            err = err or after()
            if err:
                break
        return times, count, [0.0] * len(times), err

    def timed_lists(self, op: str, mem: str, peer_name: str, lists, copies, copier, before,
                    after):
        """Per-request descriptor lists: prep_xfer_dlist + release are inside the timing."""
        llist, rlist = lists
        idx = np.arange(len(llist))

        def dlists():
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", llist, mem)
            rh = self.agent.prep_xfer_dlist(peer_name, rlist, mem)
            return lh, rh, lambda: (self.agent.release_dlist_handle(lh),
                                    self.agent.release_dlist_handle(rh))

        return self.timed(op, dlists, idx, idx, copies, copier, before, after)

    def close(self) -> None:
        for p in self.peers.values():
            p.close()
