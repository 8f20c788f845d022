"""Real NIXL (UCX, host DRAM, two processes on loopback): pdpatch-planned descriptors move KV
between split and fused layouts byte-exactly, in both directions, with head-sliced TP and
block-size ratios; a span mismatch fails before any byte moves.

One peer process (tests/kv_helpers.py::peer_main) serves every case; this process is the
initiator.  Bytes are compared as uint8 against the oracle in kv_helpers (logical views).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from kv_helpers import LayoutSpec, Side, build_side, expected_copy, peer_main, side_nbytes

from lab.kv_reference import coalesce, strided_pair_rows
from pdpatch.kv import BlockIdError, GeometryMismatch, HeadSlice, PairPlan, infer_geometry
from pdpatch.kv.staging import ByteCopier, StagingAgent, StagingStats
from pdpatch.kv.staging import copier as copier_module
from pdpatch.kv.staging import reads as staging_reads
from pdpatch.kv.staging.buffer import StagingBuffer

# a staging agent's chunk driver thread must never die of an exception
pytestmark = [pytest.mark.nixl,
              pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")]
nixl_api = pytest.importorskip("nixl._api")

PEER = "pdpatch-peer"


class NixlPair:
    """The initiator agent here, the target agent in a spawned process."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, PEER), daemon=True)
        self.proc.start()
        self.agent = nixl_api.nixl_agent(
            "pdpatch-init", nixl_api.nixl_agent_config(backends=["UCX"], capture_telemetry=True))
        self.known = False
        self.local_reg = None

    def call(self, *msg):
        self.conn.send(msg)
        if not self.conn.poll(60):
            raise TimeoutError(f"NIXL peer did not answer {msg[0]!r}")
        status, value = self.conn.recv()
        assert status == "ok", value
        return value

    def remote_side(self, spec, layers, blocks, bs, heads, head_dim, es, seed) -> Side:
        n = side_nbytes(spec, layers, blocks, bs, heads, head_dim, es)
        base = self.call("alloc", n)
        content = np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8)
        self.call("set", content.tobytes())
        # a mirror of the peer's buffer, at the peer's addresses, for planning and the oracle
        return build_side(spec, layers, blocks, bs, heads, head_dim, es, buf=content, base=base)

    def register_remote(self, ranges) -> None:
        md = self.call("register", [(int(s), int(e)) for s, e in ranges])
        if self.known:
            self.agent.remove_remote_agent(PEER)
        self.agent.add_remote_agent(md)
        self.known = True

    def register_local(self, ranges) -> None:
        if self.local_reg is not None:
            self.agent.deregister_memory(self.local_reg)
        self.local_reg = self.agent.register_memory(
            [(int(s), int(e - s), 0, "") for s, e in ranges], "DRAM")

    def remote_bytes(self) -> np.ndarray:
        return np.frombuffer(self.call("get"), dtype=np.uint8)

    def xfer(self, op: str, local_list, remote_list, lidx=None, ridx=None) -> int:
        """Prep both lists (Nx3 or Nx5), transfer, wait; returns NIXL's descriptor count."""
        lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_list, "DRAM")
        rh = self.agent.prep_xfer_dlist(PEER, remote_list, "DRAM")
        try:
            if lidx is None:
                n = int(local_list[:, 4].sum()) if local_list.shape[1] == 5 else len(local_list)
                lidx = ridx = np.arange(n)
            h = self.agent.make_prepped_xfer(op, lh, lidx, rh, ridx)
            state = self.agent.transfer(h)
            deadline = time.monotonic() + 30
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(h)
            assert state == "DONE", state
            count = self.agent.get_xfer_telemetry(h).descCount
            self.agent.release_xfer_handle(h)
            return count
        finally:
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)

    def close(self) -> None:
        try:
            self.call("quit")
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def pair():
    p = NixlPair()
    yield p
    p.close()


@dataclass(frozen=True)
class Case:
    local: LayoutSpec
    remote: LayoutSpec
    local_heads: int = 2
    remote_heads: int = 2
    local_slice: HeadSlice = HeadSlice(1, 0)  # noqa: RUF009 (frozen, immutable)
    remote_slice: HeadSlice = HeadSlice(1, 0)  # noqa: RUF009
    ratio: int = 1
    op: str = "READ"


SPLIT = LayoutSpec("fa_split", overalloc=3)
FUSED = LayoutSpec("fused")
KVCACHED = LayoutSpec("split_half", overalloc=5, kv_gap=16)
CASES = {
    "split->fused": Case(FUSED, SPLIT),
    "fused->split": Case(SPLIT, FUSED),
    "fused->kvcached-split-half": Case(KVCACHED, LayoutSpec("fused", cross_layer=True)),
    "split->fused tp2 slice1": Case(FUSED, SPLIT, 2, 4, remote_slice=HeadSlice(2, 1)),
    "fused->split tp4 slice2": Case(SPLIT, FUSED, 1, 4, remote_slice=HeadSlice(4, 2)),
    "split->fused P_TP>D_TP slot1": Case(FUSED, SPLIT, 4, 2, local_slice=HeadSlice(2, 1)),
    "split->fused block ratio 2": Case(FUSED, SPLIT, ratio=2),
    "WRITE fused->split": Case(FUSED, SPLIT, op="WRITE"),
    "WRITE split->fused tp2": Case(SPLIT, FUSED, 2, 4, remote_slice=HeadSlice(2, 0),
                                   op="WRITE"),
}
L, N_LOCAL, N_REMOTE, BS, D, ES = 2, 12, 16, 4, 8, 2


@dataclass
class Setup:
    """Both sides of one case, registered: the local buffer, its mirror of the peer, the plan."""

    case: Case
    remote: Side
    local: Side
    lbuf: np.ndarray
    plan: PairPlan


def set_up(pair: NixlPair, name: str, case: Case | None = None,
           separate_registrations: bool = False) -> Setup:
    """``separate_registrations``: the peer registers each read range on its own, as vLLM
    < 0.26 registers a split layer's adjacent K and V pools."""
    case = case or CASES[name]
    remote = pair.remote_side(case.remote, L, N_REMOTE, BS, case.remote_heads, D, ES,
                              seed=zlib.crc32(name.encode()))
    rgeo = infer_geometry(remote.infos, num_blocks=N_REMOTE, kv_dim=remote.kv_dim)
    pair.register_remote(rgeo.read_ranges() if separate_registrations
                         else rgeo.registration_ranges())

    lbuf = np.zeros(side_nbytes(case.local, L, N_LOCAL, BS * case.ratio, case.local_heads, D,
                                ES), dtype=np.uint8)
    local = build_side(case.local, L, N_LOCAL, BS * case.ratio, case.local_heads, D, ES,
                       buf=lbuf, base=int(lbuf.ctypes.data))
    lgeo = infer_geometry(local.infos, num_blocks=N_LOCAL, kv_dim=local.kv_dim)
    pair.register_local(lgeo.registration_ranges())
    plan_pair = PairPlan(lgeo, rgeo, local_slice=case.local_slice,
                         remote_slice=case.remote_slice, block_size_ratio=case.ratio)
    assert plan_pair.converts == (case.local.kind != case.remote.kind)
    return Setup(case, remote, local, lbuf, plan_pair)


def expected_read(s: Setup, lids: list[int], rids: list[int]) -> np.ndarray:
    case = s.case
    exp = np.zeros_like(s.lbuf)
    el = build_side(case.local, L, N_LOCAL, BS * case.ratio, case.local_heads, D, ES,
                    buf=exp, base=s.local.base)
    expected_copy(el, s.remote, lids, rids, ratio=case.ratio,
                  dst_slice=(case.local_slice.parts, case.local_slice.index),
                  src_slice=(case.remote_slice.parts, case.remote_slice.index))
    assert exp.any()
    return exp


LIDS = [9, 3, 4, 5, 0]  # a run of three plus scattered blocks


def remote_ids(case: Case) -> list[int]:
    # 9 remote blocks for 5 local at block-size ratio 2
    return [2, 10, 11, 12, 15] if case.ratio == 1 else [0, 1, 6, 7, 8, 9, 10, 11, 14]


@pytest.mark.parametrize("name", list(CASES))
def test_converted_transfer_is_byte_exact(pair: NixlPair, name: str) -> None:
    s = set_up(pair, name)
    case, lbuf, plan_pair = s.case, s.lbuf, s.plan
    lids, rids = LIDS, remote_ids(case)
    if case.op == "WRITE":
        lbuf[:] = np.random.default_rng(7).integers(1, 256, lbuf.size, dtype=np.uint8)
        remote_start = s.remote.buf.copy()

    plan = plan_pair.descs(lids, rids)
    lid, rid = plan_pair.desc_ids(lids, rids)
    lrows, rrows = strided_pair_rows(plan)
    merged = coalesce(plan)
    modes = {
        # vLLM-style: whole tables prepared once, requests select by desc id
        "tables+ids": (plan_pair.local_table(), plan_pair.remote_table(), lid, rid),
        "tables nx5+ids": (plan_pair.local_rows(), plan_pair.remote_rows(), lid, rid),
        "per-request nx3": (plan.local_nx3(), plan.remote_nx3(), None, None),
        "per-request nx5 strided": (lrows, rrows, None, None),
        "coalesced": (merged.local_nx3(), merged.remote_nx3(), None, None),
    }
    for mode, (llist, rlist, li, ri) in modes.items():
        if case.op == "READ":
            lbuf[:] = 0
        else:
            pair.call("set", remote_start.tobytes())
        pair.xfer(case.op, llist, rlist, li, ri)
        if case.op == "READ":
            assert np.array_equal(lbuf, expected_read(s, lids, rids)), \
                f"{name} / {mode}: local bytes differ"
        else:
            exp = remote_start.copy()
            er = build_side(case.remote, L, N_REMOTE, BS, case.remote_heads, D, ES, buf=exp,
                            base=s.remote.base)
            expected_copy(er, s.local, rids, lids, ratio=case.ratio,
                          dst_slice=(case.remote_slice.parts, case.remote_slice.index),
                          src_slice=(case.local_slice.parts, case.local_slice.index),
                          dst_is_local=False)
            assert not np.array_equal(exp, remote_start)
            assert np.array_equal(pair.remote_bytes(), exp), f"{name} / {mode}: remote differs"


def test_span_mismatch_errors_and_destination_stays_untouched(pair: NixlPair) -> None:
    remote = pair.remote_side(SPLIT, L, N_REMOTE, BS, 3, D, ES, seed=3)  # 3 heads vs 2
    rgeo = infer_geometry(remote.infos, num_blocks=N_REMOTE, kv_dim=0)
    pair.register_remote(rgeo.registration_ranges())
    lbuf = np.zeros(side_nbytes(FUSED, L, N_LOCAL, BS, 2, D, ES), dtype=np.uint8)
    local = build_side(FUSED, L, N_LOCAL, BS, 2, D, ES, buf=lbuf, base=int(lbuf.ctypes.data))
    lgeo = infer_geometry(local.infos, kv_dim=1)
    pair.register_local(lgeo.registration_ranges())
    before = lbuf.copy()
    with pytest.raises(GeometryMismatch, match=r"spans differ|heads") as e:
        PairPlan(lgeo, rgeo).descs([0, 1], [0, 1])
    assert "local = " in str(e.value) and "remote = " in str(e.value)
    assert np.array_equal(lbuf, before)
    # a stock-style "just read local-sized pieces" list would have moved bytes: prove the
    # pair is live by reading the first K block with a hand-sized descriptor
    seg = BS * 2 * D * ES
    probe = np.array([[lgeo.layers[0].base, seg, 0]], dtype=np.uint64)
    rprobe = np.array([[rgeo.layers[0].base, seg, 0]], dtype=np.uint64)
    pair.xfer("READ", probe, rprobe)
    assert not np.array_equal(lbuf, before)


def test_blocks_past_the_plan_fail_cleanly(pair: NixlPair) -> None:
    """Over-allocated remote: pdpatch refuses ids past the plan, and because only the planned
    blocks are registered NIXL itself refuses a raw descriptor there; the peer survives."""
    remote = pair.remote_side(KVCACHED, L, N_REMOTE, BS, 2, D, ES, seed=5)
    rgeo = infer_geometry(remote.infos, num_blocks=N_REMOTE, kv_dim=1)
    pair.register_remote(rgeo.registration_ranges())
    lbuf = np.zeros(side_nbytes(FUSED, L, N_LOCAL, BS, 2, D, ES), dtype=np.uint8)
    local = build_side(FUSED, L, N_LOCAL, BS, 2, D, ES, buf=lbuf, base=int(lbuf.ctypes.data))
    lgeo = infer_geometry(local.infos, kv_dim=1)
    pair.register_local(lgeo.registration_ranges())
    pp = PairPlan(lgeo, rgeo)
    with pytest.raises(BlockIdError):
        pp.descs([0], [N_REMOTE])
    past = rgeo.layers[0].segment_addr(0, N_REMOTE + 1)  # inside the tensor, past the plan
    seg = BS * 2 * D * ES
    with pytest.raises(nixl_api.nixlBind.nixlNotFoundError):
        pair.xfer("READ", np.array([[lgeo.layers[0].base, seg, 0]], dtype=np.uint64),
                  np.array([[past, seg, 0]], dtype=np.uint64))
    assert pair.proc.is_alive()
    plan = pp.descs([1], [N_REMOTE - 1])
    pair.xfer("READ", plan.local_nx3(), plan.remote_nx3())
    assert lbuf.any()


# ------------------------------------------------------------------ staged READs (the agent)
READS = [n for n, c in CASES.items() if c.op == "READ"]
STAGING = 1 << 20


class Ledger:
    """The agent below a staging agent, keeping account of the lists prepared through it:
    those still held, and the rows of each one prepared for the peer (vLLM's own first)."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self.held: dict = {}
        self.peer_rows: list[int] = []
        self.registered: list = []        # memory registered through it

    def register_memory(self, descs, *args, **kwargs):
        self.registered.append(descs)
        return self._agent.register_memory(descs, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def prep_xfer_dlist(self, agent_name, descs, *args, **kwargs):
        handle = self._agent.prep_xfer_dlist(agent_name, descs, *args, **kwargs)
        self.held[handle] = agent_name
        if agent_name == PEER:
            self.peer_rows.append(descs.descCount() if hasattr(descs, "descCount")
                                  else len(descs))
        return handle

    def release_dlist_handle(self, handle, *args, **kwargs):
        self.held.pop(handle)
        return self._agent.release_dlist_handle(handle, *args, **kwargs)


@dataclass
class StagedRun:
    state: str
    desc_count: int | None
    stats: StagingStats
    free_after: int
    peer_rows: list[int]       # rows of each list prepared for the peer, vLLM's own first
    # staging made and registered once the worker's own list was prepared, before any READ
    staging_at_start: tuple[int, int] = (0, 0)
    registrations: int = 0     # memory registrations made through the agent, in all


def staged_read(pair: NixlPair, s: Setup, lids: list[int], rids: list[int], *,
                capacity: int = STAGING, memory: list | None = None, gap: int | None = 0,
                read_ranges: list | None = None, buffer_at_start: bool = False) -> StagedRun:
    """One READ the way vLLM posts it (tables prepared once, ids per request), through a
    :class:`StagingAgent` around the real agent with the remote list marked converted
    (with the peer's ``read_ranges``, gap reads of up to ``gap`` bytes; None measures it;
    ``buffer_at_start``: an eager agent that makes its buffer when vLLM prepares its list).
    Every list prepared on the way is released by the end."""
    lid, rid = s.plan.desc_ids(lids, rids)
    tensors = memory if memory is not None else [torch.from_numpy(s.lbuf)]
    drain_notifs(pair)
    ledger = Ledger(pair.agent)
    agent = StagingAgent(ledger, mem_type="DRAM", capacity=capacity, memory=lambda: tensors,
                         gap=gap, eager=buffer_at_start, buffer_at_start=buffer_at_start)
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", s.plan.local_table(), "DRAM")
    at_start = (agent.staging_allocated, len(ledger.registered))
    rh = agent.prep_xfer_dlist(PEER, s.plan.remote_table(), "DRAM")
    try:
        assert agent.mark_converted(rh, PEER, read_ranges)
        h = agent.make_prepped_xfer("READ", lh, lid, rh, rid, notif_msg=b"staged")
        state = agent.transfer(h)
        if agent.stats.staged_reads:
            assert state in ("PROC", "ERR")   # never DONE before the copy has been polled
        deadline = time.monotonic() + 30
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(h)
        count = agent.get_xfer_telemetry(h).descCount if state == "DONE" else None
        agent.release_xfer_handle(h)
        if state == "DONE":     # the peer hears of it: not later, in another test's READ
            assert drain_notifs(pair, 1) == [b"staged"]
        run = StagedRun(state, count, agent.stats, agent.staging_free, ledger.peer_rows,
                        at_start, len(ledger.registered))
    finally:
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
        agent.close()
    assert not ledger.held
    return run


def test_nixl_merges_only_neighbours_in_its_list(pair: NixlPair) -> None:
    """Why staging prepares an address-ordered twin of a peer's list (and pays for it at
    first contact: ~145 ms per 524k rows on the CI machine): NIXL joins two descriptors of a
    READ only when they follow each other in the prepared list, not when their addresses do.
    64 back-to-back blocks into back-to-back slots: one descriptor from a list in address
    order, 64 from the same rows listed in another order and requested in address order."""
    blocks, size = 64, 4096
    base = pair.call("alloc", blocks * size)
    pair.register_remote([(base, base + blocks * size)])
    local = np.zeros(blocks * size, dtype=np.uint8)
    pair.register_local([(local.ctypes.data, local.ctypes.data + local.size)])
    slots = np.array([[local.ctypes.data + i * size, size, 0] for i in range(blocks)],
                     dtype=np.uint64)
    listed = np.r_[np.arange(0, blocks, 2), np.arange(1, blocks, 2)]     # evens, then odds
    shuffled = np.array([[base + b * size, size, 0] for b in listed], dtype=np.uint64)
    position = np.empty(blocks, dtype=np.int64)
    position[listed] = np.arange(blocks)
    ids = np.arange(blocks)
    assert pair.xfer("READ", slots, shuffled, ids, position) == blocks
    assert pair.xfer("READ", slots, shuffled[position], ids, ids) == 1


@pytest.mark.parametrize("ranges", [True, False], ids=["runs", "twin"])
@pytest.mark.parametrize("name", READS)
def test_staged_read_is_byte_exact_with_the_predicted_descriptors(pair: NixlPair, name: str,
                                                                 ranges: bool) -> None:
    """With the peer's read ranges (how kv_segments marks a peer) a READ posts lists of its
    own runs: no list of the peer's whole memory is prepared, at first contact or after.
    Without them, ids into the peer's twin, prepared at the first READ."""
    s = set_up(pair, name)
    lids, rids = LIDS, remote_ids(s.case)
    lid, rid = s.plan.desc_ids(lids, rids)
    stock = pair.xfer("READ", s.plan.local_table(), s.plan.remote_table(), lid, rid)
    s.lbuf[:] = 0
    run = staged_read(pair, s, lids, rids,
                      read_ranges=s.plan.remote.read_ranges() if ranges else None)
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids)), name
    if s.case.remote_slice.parts == 1:
        # the peer's whole segments: a run of its blocks is one descriptor per layer/pool
        assert run.stats.staged_reads == 1 and not run.stats.not_staged
        assert run.stats.descriptors_stock == stock
        assert run.desc_count <= run.stats.descriptors_staged < stock
        whole = len(s.plan.remote_table())
        if ranges:
            assert run.peer_rows[0] == whole
            assert run.peer_rows[1:] == [run.stats.descriptors_staged]
        else:
            assert run.peer_rows == [whole, whole]
            assert run.desc_count == run.stats.descriptors_staged
    else:
        # head slices of the peer's K and V are apart: nothing to merge, no staging, and no
        # list prepared for it (the twin neither: it would merge no more than addresses do)
        assert run.stats.staged_reads == 0
        assert [r for r in run.stats.not_staged if "under a quarter" in r]
        assert run.desc_count == stock
        assert run.peer_rows == [len(s.plan.remote_table())]
    assert run.free_after == STAGING


class LateEvent:
    """A gather that has not finished when it is first polled (a CUDA kernel just launched):
    ``query()`` is False until ``synchronize()`` waits for it."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_a_small_gather_ends_in_the_poll_that_sees_its_read_land(pair: NixlPair,
                                                                 monkeypatch) -> None:
    """vLLM polls a READ once per engine step.  A staged READ whose gather is still running
    when its bytes land in staging would end one step after vLLM's own READ (one block at 8B
    geometry: 4.06 vs 1.00 ms on an H200); a gather of up to GATHER_WAIT_BYTES is waited for
    in that poll instead."""
    launch = ByteCopier.launch
    monkeypatch.setattr(ByteCopier, "launch",
                        lambda self, ops, sync=True: launch(self, ops) or LateEvent())
    s = set_up(pair, "fused->split")
    run = staged_read(pair, s, LIDS, remote_ids(s.case),
                      read_ranges=s.plan.remote.read_ranges())
    assert run.state == "DONE" and run.stats.staged_reads == 1
    assert np.array_equal(s.lbuf, expected_read(s, LIDS, remote_ids(s.case)))


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "vllm"])
def test_every_read_logs_its_polls_at_debug(pair: NixlPair, caplog, staged: bool) -> None:
    """vLLM's transfer time is NIXL's post-to-done span, which for a small READ is the
    engine's poll cadence: at DEBUG each READ says when it was polled and what NIXL answered
    (a staged one also when it landed and was gathered), so a GPU run can tell a slow
    transfer from a slow step.  Silent above DEBUG."""
    # head slices are not staged (they merge nothing): vLLM's own READ, through the agent
    s = set_up(pair, "fused->split" if staged else "split->fused tp2 slice1")
    kwargs = {"read_ranges": s.plan.remote.read_ranges()}
    with caplog.at_level(logging.INFO, logger="pdpatch"):
        staged_read(pair, s, LIDS, remote_ids(s.case), **kwargs)
    assert "poll(s)" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="pdpatch"):
        run = staged_read(pair, s, LIDS, remote_ids(s.case), **kwargs)
    assert run.state == "DONE" and run.stats.staged_reads == int(staged)
    lines = [r.getMessage() for r in caplog.records if "poll(s)" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    kind = "staged" if staged else "vLLM's"
    assert f"{kind} READ DONE after" in lines[0], lines[0]
    if staged:      # never done in the post: its gather runs in a poll
        assert "DONE" in lines[0].split("polls at")[1], lines[0]
    assert ("NIXL done at +" in lines[0]) == staged
    assert ("gathered by +" in lines[0]) == ("gather planned by +" in lines[0]) == staged


def gather_preparations(monkeypatch, span: bool) -> dict[str, int]:
    """Counts of the staging buffer's gather preparations, per chunk (``prepare``) and per
    READ (``row_scatter``), from now on.  ``span``: the copier's span takes rows down to 16 B
    (host memory starts at 16-64 B multiples; the default :data:`SPAN_MIN_ROW`, 4 KiB, is
    met or not by where the allocations fall); else the copier has none (as one whose probe
    failed), and every chunk is prepared on its own."""
    if span:
        monkeypatch.setattr(copier_module, "SPAN_MIN_ROW", 16)
    else:
        monkeypatch.setattr(copier_module._Span, "over", classmethod(lambda cls, *a: None))
    calls = {"prepare": 0, "row_scatter": 0}
    for name in calls:
        real = getattr(StagingBuffer, name)
        monkeypatch.setattr(StagingBuffer, name, lambda self, *a, _n=name, _f=real: (
            calls.__setitem__(_n, calls[_n] + 1), _f(self, *a))[1])
    return calls


WHOLE_OR_PER_CHUNK = pytest.mark.parametrize("span", [True, False],
                                             ids=["whole-read", "per-chunk"])


@WHOLE_OR_PER_CHUNK
@pytest.mark.parametrize("name", [n for n in READS if CASES[n].remote_slice.parts > 1])
def test_head_slices_larger_than_staging_are_read_across_their_gaps_in_chunks(
        pair: NixlPair, monkeypatch, name: str, span: bool) -> None:
    """Head slices (one run per row) of a request larger than the staging buffer: read in
    chunks across the other ranks' heads between them -- far fewer descriptors than rows,
    byte-exact, the unrequested bytes counted, all staging back.  Before, such a request
    was read row by row (runs ay, ba on two H200s: descriptor-bound).  Each chunk's gather
    picks its rows out of its lane from the READ's gather prepared once, where the span
    takes the rows; else it is prepared per chunk."""
    calls = gather_preparations(monkeypatch, span)
    s = set_up(pair, name)
    lids, rids = list(range(N_LOCAL)), list(range(2, 2 + N_LOCAL))   # a run of the peer's
    lid, rid = s.plan.desc_ids(lids, rids)
    slot = int(s.plan.local_table()[0, 1])
    stock = pair.xfer("READ", s.plan.local_table(), s.plan.remote_table(), lid, rid)
    capacity = len(lid) * slot // 2 // slot * slot
    s.lbuf[:] = 0
    run = staged_read(pair, s, lids, rids, capacity=capacity, gap=1 << 20,
                      read_ranges=s.plan.remote.read_ranges())
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids)), name
    st = run.stats
    assert st.staged_reads == st.chunked_reads == st.gap_reads == 1 and not st.not_staged
    assert st.chunks >= 2 and st.gap_bytes > 0
    assert st.descriptors_stock == stock == len(lid)          # a descriptor per row
    assert run.desc_count <= st.descriptors_staged <= stock // 2
    assert run.free_after == capacity
    assert calls == {"prepare": 0 if span else st.chunks, "row_scatter": 1}


def test_descriptor_larger_than_half_the_staging_goes_per_segment(pair: NixlPair) -> None:
    """Two lanes of one row each is the least a chunked READ needs: a smaller buffer leaves
    the request to vLLM's own READ."""
    s = set_up(pair, "fused->split")
    slot = int(s.plan.local_table()[0, 1])
    run = staged_read(pair, s, LIDS, remote_ids(s.case), capacity=2 * slot - 1)
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, LIDS, remote_ids(s.case)))
    assert run.stats.staged_reads == 0
    assert [r for r in run.stats.not_staged if "does not fit 2 times" in r]


def test_gather_outside_known_memory_goes_per_segment(pair: NixlPair) -> None:
    s = set_up(pair, "split->fused")
    elsewhere = torch.zeros(64, dtype=torch.uint8)    # not the memory the local list points at
    run = staged_read(pair, s, LIDS, remote_ids(s.case), memory=[elsewhere])
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, LIDS, remote_ids(s.case)))
    assert run.stats.staged_reads == 0
    assert [r for r in run.stats.not_staged if "points outside the KV memory" in r]
    assert run.free_after == STAGING


@pytest.mark.parametrize("step", ["prepare", "launch"])
def test_failed_gather_fails_the_request_and_frees_staging(pair: NixlPair, monkeypatch,
                                                          step: str) -> None:
    """Planning the gather (while NIXL moves the bytes) or launching it fails: the request
    ends ERR once NIXL is done with the staging slots, and the slots come back."""
    s = set_up(pair, "fused->split")

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(ByteCopier, step, broken)
    run = staged_read(pair, s, LIDS, remote_ids(s.case))
    assert run.state == "ERR"                          # vLLM fails this request only
    assert run.stats.staged_reads == 1 and run.stats.gather_failures == 1
    assert run.free_after == STAGING
    assert not s.lbuf.any()                            # nothing half-copied


def test_no_buffer_until_a_read_is_staged(pair: NixlPair) -> None:
    """A worker that marks a converted peer but never READs from it (a push-mode prefill)
    allocates no staging."""
    s = set_up(pair, "split->fused")
    agent = StagingAgent(pair.agent, mem_type="DRAM", capacity=STAGING,
                         memory=lambda: [torch.from_numpy(s.lbuf)])
    rh = agent.prep_xfer_dlist(PEER, s.plan.remote_table(), "DRAM")
    try:
        assert agent.mark_converted(rh, PEER)
        assert agent.staging_allocated == 0
    finally:
        agent.release_dlist_handle(rh)
        agent.close()


@pytest.mark.parametrize("at_start", [True, False])
def test_a_coalescing_worker_makes_its_buffer_when_vllm_prepares_its_list(
        pair: NixlPair, at_start: bool) -> None:
    """Coalescing on (``buffer_at_start``): the staging buffer is made and registered with
    NIXL when vLLM prepares the worker's own list at start-up, not in the first READ, where
    it took 31-45 ms of a first request on an H200 (runs cl, cu); that READ then stages
    through it byte-exactly, registering nothing more.  Otherwise it waits for that READ."""
    s = set_up(pair, "split->fused")
    lids, rids = LIDS, remote_ids(s.case)
    s.lbuf[:] = 0
    run = staged_read(pair, s, lids, rids, buffer_at_start=at_start)
    assert run.state == "DONE" and run.stats.staged_reads == 1
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids))
    assert run.staging_at_start == ((STAGING, 1) if at_start else (0, 0))
    assert run.registrations == 1


def spans_expected(s: Setup, rids: list[int], lids: list[int], ranges: list) -> int:
    """A gap READ with an unbounded gap: one descriptor per read range it touches."""
    _, rid = s.plan.desc_ids(lids, rids)
    addr = s.plan.remote_table()[rid, 0].astype(np.int64)
    inside = [next(i for i, (a, b) in enumerate(ranges) if a <= x < b) for x in addr.tolist()]
    return len(set(inside))


@pytest.mark.parametrize("name", READS)
def test_gap_read_is_byte_exact_in_one_descriptor_per_range(pair: NixlPair, name: str) -> None:
    """With the peer's read ranges and a gap of 1 MiB, every requested row of one range is
    one span: the unrequested bytes between them land in staging only (the local blocks not
    asked for keep their zeros), head slices included."""
    s = set_up(pair, name)
    lids, rids = LIDS, remote_ids(s.case)
    ranges = s.plan.remote.read_ranges()
    run = staged_read(pair, s, lids, rids, gap=1 << 20, read_ranges=ranges)
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids)), name
    expect = spans_expected(s, rids, lids, ranges)
    assert run.stats.staged_reads == run.stats.gap_reads == 1, run.stats
    assert run.desc_count == run.stats.descriptors_staged == expect
    assert run.stats.gap_bytes > 0
    assert run.free_after == STAGING


def test_gap_reads_never_cross_a_registration(pair: NixlPair, caplog) -> None:
    """A split peer whose K and V pools touch and are registered apart (vLLM < 0.26): a gap
    READ stops at the pool's end.  Spanning both pools -- what the merged
    ``registration_ranges`` would allow -- NIXL refuses; the agent then drops gap reads for
    that peer and stages the READ without them, loudly."""
    case = Case(FUSED, LayoutSpec("fa_split"))
    s = set_up(pair, "split->fused adjacent pools", case, separate_registrations=True)
    lids, rids = LIDS, remote_ids(case)
    ranges = s.plan.remote.read_ranges()
    assert len(s.plan.remote.registration_ranges()) < len(ranges)   # the pools touch
    run = staged_read(pair, s, lids, rids, gap=1 << 20, read_ranges=ranges)
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids))
    assert run.desc_count == spans_expected(s, rids, lids, ranges) == 2 * L
    # every pool read whole: the spans touch end to end, and NIXL keeps one per registration
    s.lbuf[:] = 0
    whole = [0, 10, 11, 12, 15]
    run = staged_read(pair, s, lids, whole, gap=1 << 20, read_ranges=ranges)
    assert np.array_equal(s.lbuf, expected_read(s, lids, whole))
    assert run.desc_count == run.stats.descriptors_staged == 2 * L
    s.lbuf[:] = 0
    with caplog.at_level(logging.WARNING, logger="pdpatch"):
        run = staged_read(pair, s, lids, rids, gap=1 << 20,
                          read_ranges=s.plan.remote.registration_ranges())
    assert "NIXL refused a span" in caplog.text and "NotFound" in caplog.text
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids))
    assert run.stats.staged_reads == 1 and run.stats.gap_reads == 0
    assert run.free_after == STAGING


def test_a_run_nixl_refuses_is_read_through_the_twin(pair: NixlPair, caplog) -> None:
    """Read ranges that lie (one range over two registrations that touch, vLLM < 0.26's
    split K and V pools): the run over the pools' seam is refused by NIXL when its list is
    prepared; the agent drops the ranges for that peer, loudly, and the READ goes through
    the peer's twin, where NIXL merges only inside a registration -- byte-exact."""
    case = Case(FUSED, LayoutSpec("fa_split"))
    s = set_up(pair, "split->fused adjacent pools", case, separate_registrations=True)
    whole = [0, 10, 11, 12, 15]           # every block: each K pool's end touches its V pool
    with caplog.at_level(logging.WARNING, logger="pdpatch"):
        run = staged_read(pair, s, LIDS, whole, gap=0,
                          read_ranges=s.plan.remote.registration_ranges())
    assert "NIXL refused a run" in caplog.text and "NotFound" in caplog.text
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, LIDS, whole))
    assert run.stats.staged_reads == 1 and not run.stats.not_staged
    whole_list = len(s.plan.remote_table())
    assert run.peer_rows == [whole_list, whole_list]      # vLLM's list, and the twin
    assert run.free_after == STAGING


def test_reads_of_many_runs_go_through_the_twin(pair: NixlPair, monkeypatch, caplog) -> None:
    """A READ of more runs than :data:`RUN_LIST_MAX` (head slices: one run per row) would
    prepare as many rows as it posts, per READ: it takes ids into the peer's twin instead,
    prepared once, at the first such READ, and used by the next ones too."""
    monkeypatch.setattr(staging_reads, "RUN_LIST_MAX", 4)
    s = set_up(pair, "fused->split")
    lids, rids = LIDS, remote_ids(s.case)
    ranges = s.plan.remote.read_ranges()
    lid, rid = s.plan.desc_ids(lids, rids)
    ledger = Ledger(pair.agent)
    agent = StagingAgent(ledger, mem_type="DRAM", capacity=STAGING,
                         memory=lambda: [torch.from_numpy(s.lbuf)], gap=0)
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", s.plan.local_table(), "DRAM")
    rh = agent.prep_xfer_dlist(PEER, s.plan.remote_table(), "DRAM")
    try:
        assert agent.mark_converted(rh, PEER, ranges)
        assert ledger.peer_rows == [len(s.plan.remote_table())]    # nothing at marking
        with caplog.at_level(logging.INFO, logger="pdpatch"):
            for _ in range(2):
                s.lbuf[:] = 0
                state, _ = read_through(agent, lh, rh, lid, rid)
                assert state == "DONE"
                assert np.array_equal(s.lbuf, expected_read(s, lids, rids))
        assert ledger.peer_rows == [len(s.plan.remote_table())] * 2
        assert caplog.text.count("prepared in address order") == 1
        assert agent.stats.staged_reads == 2
    finally:
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
        agent.close()
    assert not ledger.held
    drain_notifs(pair, 2)


HEAD_SLICES = [n for n in READS if CASES[n].remote_slice.parts > 1]


@pytest.mark.parametrize(("name", "capacity"), [
    *((n, STAGING) for n in HEAD_SLICES),
    ("fused->split tp4 slice2", 3000)])         # the request fits, its gaps do not: chunks
def test_head_slices_of_many_runs_are_gap_read(pair: NixlPair, monkeypatch, name: str,
                                              capacity: int) -> None:
    """Head slices (one run per row) of more runs than :data:`RUN_LIST_MAX` that fit the
    staging buffer: a gap READ, in one piece where its gaps fit the buffer, else in chunks --
    not vLLM's own READ, which is what the twin path (it merges nothing here) left them to.
    On GPU engines (run ck: Llama-3-70B's KV at TP 1 -> 2, vLLM 0.33, 1 GiB of staging)
    1,500- and 4,000-token requests, 7,520 and 20,000 rows a rank, went vLLM's way with
    15,040 and 40,000 descriptors (1.00-1.06x of stock), while 8,000 tokens, larger than the
    buffer, were gap-read in chunks: 0.032x."""
    monkeypatch.setattr(staging_reads, "RUN_LIST_MAX", 8)
    s = set_up(pair, name)
    lids, rids = LIDS, remote_ids(s.case)
    ranges = s.plan.remote.read_ranges()
    lid, _ = s.plan.desc_ids(lids, rids)
    need = len(lid) * int(s.plan.local_table()[0, 1])
    assert len(lid) > staging_reads.RUN_LIST_MAX and need <= capacity
    run = staged_read(pair, s, lids, rids, capacity=capacity, gap=1 << 20, read_ranges=ranges)
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids)), name
    assert run.stats.staged_reads == run.stats.gap_reads == 1 and not run.stats.not_staged
    assert run.stats.chunked_reads == (capacity < STAGING)
    assert run.stats.descriptors_staged <= staging_reads.RUN_LIST_MAX
    assert run.stats.descriptors_stock == len(lid)
    if capacity == STAGING:
        assert run.desc_count == spans_expected(s, rids, lids, ranges)
    assert run.free_after == capacity


def test_gap_shrinks_to_fit_staging(pair: NixlPair) -> None:
    """Staging too small for the gaps: the gap is halved until the READ fits, or left out."""
    s = set_up(pair, "fused->split")
    lids, rids = LIDS, remote_ids(s.case)
    ranges = s.plan.remote.read_ranges()
    lid, _ = s.plan.desc_ids(lids, rids)
    need = len(lid) * int(s.plan.local_table()[0, 1])
    run = staged_read(pair, s, lids, rids, capacity=need + 64, gap=1 << 20,
                      read_ranges=ranges)
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids))
    assert run.stats.staged_reads == 1
    assert run.stats.gap_bytes <= 64
    assert run.free_after == need + 64


def test_gap_budget_is_measured_on_the_peer(pair: NixlPair, caplog) -> None:
    """``gap=None`` (what vLLM gets unless PDPATCH_KV_GAP_KIB is set): the first staged READ
    from a peer first times three READs of its memory and fits the transport's cost; the
    budget is recorded and logged, the calibration's staging comes back, and the READ that
    follows is byte-exact.  Pools of 1024 blocks of 8 KiB segments, large enough to time."""
    layers, blocks, bs, heads, hd, es = 1, 1024, 16, 4, 64, 2
    spec_r, spec_l = LayoutSpec("fused"), LayoutSpec("fa_split")
    remote = pair.remote_side(spec_r, layers, blocks, bs, heads, hd, es, seed=11)
    rgeo = infer_geometry(remote.infos, num_blocks=blocks, kv_dim=remote.kv_dim)
    pair.register_remote(rgeo.registration_ranges())
    lbuf = np.zeros(side_nbytes(spec_l, layers, blocks, bs, heads, hd, es), dtype=np.uint8)
    local = build_side(spec_l, layers, blocks, bs, heads, hd, es, buf=lbuf,
                       base=int(lbuf.ctypes.data))
    lgeo = infer_geometry(local.infos, num_blocks=blocks, kv_dim=local.kv_dim)
    pair.register_local(lgeo.registration_ranges())
    s = Setup(Case(spec_l, spec_r), remote, local, lbuf, PairPlan(lgeo, rgeo))
    rids = list(range(0, blocks, 4))            # every 4th block: gaps of 48 KiB
    lids = list(range(len(rids)))
    capacity = 32 << 20
    with caplog.at_level(logging.INFO, logger="pdpatch"):
        run = staged_read(pair, s, lids, rids, capacity=capacity, gap=None,
                          read_ranges=rgeo.read_ranges())
    assert run.state == "DONE"
    assert PEER in run.stats.gap_budgets, caplog.text
    assert "us per descriptor" in caplog.text
    assert run.stats.staged_reads == 1
    assert run.stats.gap_reads == (run.stats.gap_budgets[PEER] >= 48 << 10)
    exp = np.zeros_like(lbuf)
    expected_copy(build_side(spec_l, layers, blocks, bs, heads, hd, es, buf=exp,
                             base=local.base), remote, lids, rids)
    assert np.array_equal(lbuf, exp)
    assert run.free_after == capacity


def test_peer_with_unequal_descriptors_is_not_staged(pair: NixlPair, caplog) -> None:
    """Staging slots are of one size: a peer list whose rows differ in length is refused at
    marking time, before its address-sorted twin is prepared, and says why."""
    s = set_up(pair, "split->fused")
    rows = s.plan.remote_table().copy()
    rows[0, 1] //= 2
    agent = StagingAgent(pair.agent, mem_type="DRAM", capacity=STAGING,
                         memory=lambda: [torch.from_numpy(s.lbuf)])
    rh = agent.prep_xfer_dlist(PEER, rows, "DRAM")
    try:
        with caplog.at_level(logging.INFO, logger="pdpatch"):
            assert not agent.mark_converted(rh, PEER, s.plan.remote.read_ranges())
        assert "differ in length" in caplog.text
    finally:
        agent.release_dlist_handle(rh)
        agent.close()


# ------------------------------------------------------- chunked READs (larger than staging)
BIG_LAYERS, BIG_LOCAL, BIG_REMOTE = 4, 64, 80
ALL_LOCAL = list(range(BIG_LOCAL))
ALL_REMOTE = [*range(4, 36), *range(44, 76)]          # two runs of 32 blocks


def big_setup(pair: NixlPair, name: str) -> Setup:
    """``name``'s layouts (a READ case without head slices) over 4 layers of 64 local and 80
    remote blocks: requests of 512 rows, enough for chunks of many rows in small staging."""
    case = CASES[name]
    remote = pair.remote_side(case.remote, BIG_LAYERS, BIG_REMOTE, BS, 2, D, ES,
                              seed=zlib.crc32(name.encode()) + 1)
    rgeo = infer_geometry(remote.infos, num_blocks=BIG_REMOTE, kv_dim=remote.kv_dim)
    pair.register_remote(rgeo.registration_ranges())
    lbuf = np.zeros(side_nbytes(case.local, BIG_LAYERS, BIG_LOCAL, BS, 2, D, ES),
                    dtype=np.uint8)
    local = build_side(case.local, BIG_LAYERS, BIG_LOCAL, BS, 2, D, ES, buf=lbuf,
                       base=int(lbuf.ctypes.data))
    lgeo = infer_geometry(local.infos, num_blocks=BIG_LOCAL, kv_dim=local.kv_dim)
    pair.register_local(lgeo.registration_ranges())
    return Setup(case, remote, local, lbuf, PairPlan(lgeo, rgeo))


def big_expected(s: Setup) -> np.ndarray:
    exp = np.zeros_like(s.lbuf)
    el = build_side(s.case.local, BIG_LAYERS, BIG_LOCAL, BS, 2, D, ES, buf=exp,
                    base=s.local.base)
    expected_copy(el, s.remote, ALL_LOCAL, ALL_REMOTE)
    return exp


class ScriptedAgent:
    """The real NIXL agent, except that the ``nth`` READ made through it (1-based) answers
    ``state`` to every poll (``ERR``: a chunk READ that fails; ``PROC``: one that never
    ends, so a test can abort mid-pipeline) -- until ``until`` READs have been made, if
    given (a READ that lands late)."""

    def __init__(self, agent, nth: int, state: str, until: int | None = None) -> None:
        self._agent, self._nth, self._state, self._until = agent, nth, state, until
        self.made: list = []

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def make_prepped_xfer(self, *args, **kwargs):
        handle = self._agent.make_prepped_xfer(*args, **kwargs)
        self.made.append(handle)
        return handle

    def check_xfer_state(self, handle):
        state = self._agent.check_xfer_state(handle)
        scripted = len(self.made) >= self._nth and handle == self.made[self._nth - 1] and (
            self._until is None or len(self.made) < self._until)
        return self._state if scripted and state != "ERR" else state


def drain_notifs(pair: NixlPair, want: int = 0, wait_s: float = 5.0) -> list[bytes]:
    """The notifications the peer received from this agent since the last ask; waits up to
    ``wait_s`` for ``want`` of them."""
    got: list[bytes] = []
    deadline = time.monotonic() + wait_s
    while True:
        got += pair.call("notifs").get("pdpatch-init", [])
        if len(got) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def read_through(agent: StagingAgent, lh, rh, lid, rid, *, poll: bool = True) -> tuple:
    """One READ posted and polled as vLLM does; ``(state, telemetry or None)``."""
    h = agent.make_prepped_xfer("READ", lh, lid, rh, rid, notif_msg=b"chunked")
    state = agent.transfer(h)
    deadline = time.monotonic() + 30
    while poll and state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(h)
    telemetry = agent.get_xfer_telemetry(h) if state == "DONE" else None
    agent.release_xfer_handle(h)
    return state, telemetry


@contextlib.contextmanager
def chunk_agent(pair: NixlPair, s: Setup, capacity: int, agent_below=None,
                ranges: bool = False) -> Iterator[tuple[StagingAgent, Any, Any]]:
    """A staging agent of ``capacity`` bytes over ``agent_below`` (the real NIXL agent by
    default) with ``s``'s local and remote lists prepared and the remote one marked
    converted (with the peer's read ranges: READs of lists of their own runs):
    ``(agent, local handle, remote handle)``, all released afterwards -- every list the
    agent prepared included."""
    drain_notifs(pair)
    ledger = Ledger(agent_below or pair.agent)
    agent = StagingAgent(ledger, mem_type="DRAM", capacity=capacity,
                         memory=lambda: [torch.from_numpy(s.lbuf)], gap=0)
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", s.plan.local_table(), "DRAM")
    rh = agent.prep_xfer_dlist(PEER, s.plan.remote_table(), "DRAM")
    try:
        assert agent.mark_converted(rh, PEER, s.plan.remote.read_ranges() if ranges else None)
        yield agent, lh, rh
    finally:
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
        agent.close()
    assert not ledger.held


RUNS_OR_TWIN = pytest.mark.parametrize("ranges", [True, False], ids=["runs", "twin"])


@RUNS_OR_TWIN
@pytest.mark.parametrize("name", ["fused->split", "split->fused"])
@pytest.mark.parametrize("factor", [1, 2.5, 10])
def test_read_larger_than_staging_is_chunked_and_byte_exact(pair: NixlPair, name: str,
                                                            factor: float,
                                                            ranges: bool) -> None:
    """Requests of 1x, 2.5x and 10x the staging buffer: 1x is one staged READ as before,
    larger ones are read in chunks through two lanes -- byte-exact, one notification to the
    peer once all chunks landed, vLLM's telemetry for the whole READ, staging all back."""
    s = big_setup(pair, name)
    lid, rid = s.plan.desc_ids(ALL_LOCAL, ALL_REMOTE)
    slot = int(s.plan.local_table()[0, 1])
    need = len(lid) * slot
    capacity = int(need / factor) // slot * slot
    with chunk_agent(pair, s, capacity, ranges=ranges) as (agent, lh, rh):
        state, tele = read_through(agent, lh, rh, lid, rid)
        assert state == "DONE"
        assert np.array_equal(s.lbuf, big_expected(s)), name
        st = agent.stats
        assert st.staged_reads == 1 and not st.not_staged
        assert st.chunked_reads == (factor > 1)
        if factor > 1:
            room = capacity // 2 if capacity // 4 >= slot else capacity   # CHUNKED_SHARE
            lane_rows = min(room // 2 // slot, -(-len(lid) // 2))
            assert st.chunks == -(-len(lid) // lane_rows) >= 2
            assert tele.totalBytes == need and tele.descCount == st.descriptors_staged
            assert tele.xferDuration > 0
        assert st.descriptors_staged < st.descriptors_stock
        assert drain_notifs(pair, 1) == [b"chunked"]
        assert agent.staging_free == capacity


@RUNS_OR_TWIN
def test_chunked_read_logs_where_its_time_went_at_debug(pair: NixlPair, caplog,
                                                        ranges: bool) -> None:
    """At DEBUG a chunked READ that is done logs one line: its chunks, descriptors and bytes,
    its time in NIXL, in gathers and between a lane's gather and its next post; at INFO none."""
    s = big_setup(pair, "fused->split")
    lid, rid = s.plan.desc_ids(ALL_LOCAL, ALL_REMOTE)
    slot = int(s.plan.local_table()[0, 1])
    capacity = len(lid) * slot // 10 // slot * slot
    with chunk_agent(pair, s, capacity, ranges=ranges) as (agent, lh, rh):
        with caplog.at_level(logging.INFO, logger="pdpatch"):
            assert read_through(agent, lh, rh, lid, rid)[0] == "DONE"
        assert "chunked READ from" not in caplog.text
        drain_notifs(pair, 1)
        with caplog.at_level(logging.DEBUG, logger="pdpatch"):
            assert read_through(agent, lh, rh, lid, rid)[0] == "DONE"
        st = agent.stats
        lines = [r.getMessage() for r in caplog.records if "chunked READ from" in r.getMessage()]
        assert len(lines) == 1, lines
        assert f"DONE: {st.chunks // 2} chunks, {st.descriptors_staged // 2} descriptors, " \
            f"{len(lid) * slot >> 10} KiB in " in lines[0], lines[0]
        assert "in NIXL median" in lines[0] and "next post after its gather: median" in lines[0]
        assert np.array_equal(s.lbuf, big_expected(s))
        drain_notifs(pair, 1)


@RUNS_OR_TWIN
@WHOLE_OR_PER_CHUNK
def test_a_chunked_reads_gather_is_prepared_once_where_the_span_allows(
        pair: NixlPair, monkeypatch, ranges: bool, span: bool) -> None:
    """Each chunk's gather is a slice of the READ's whole gather, prepared once at its first
    post -- not prepared chunk by chunk, 0.18-0.3 ms of the chunk driver's host work a chunk
    on an H200, where that work set the chunks' pace (``scripts/bench_chunk_pace.py``).
    Without a span of whole rows (:func:`gather_preparations`), each chunk is prepared on
    its own, as before.  Byte-exact either way."""
    calls = gather_preparations(monkeypatch, span)
    s = big_setup(pair, "fused->split")
    lid, rid = s.plan.desc_ids(ALL_LOCAL, ALL_REMOTE)
    slot = int(s.plan.local_table()[0, 1])
    with chunk_agent(pair, s, len(lid) * slot // 10 // slot * slot, ranges=ranges) as (
            agent, lh, rh):
        assert read_through(agent, lh, rh, lid, rid)[0] == "DONE"
        chunks = agent.stats.chunks
    assert np.array_equal(s.lbuf, big_expected(s))
    assert chunks >= 10 and calls["row_scatter"] == 1
    assert calls["prepare"] == (0 if span else chunks)
    drain_notifs(pair, 1)


def test_the_chunk_driver_takes_the_staging_device_before_its_first_gather(
        pair: NixlPair, monkeypatch) -> None:
    """The chunk driver is a thread of pdpatch's own: it makes the staging buffer's GPU its
    current device before it launches a gather (on a new thread, device 0 -- leaving the
    copier's stream context there made GPU 0's context in a TP-rank-1 worker: 0.2-1.2 s of
    its first chunked READ, GPU runs ba and bb)."""
    events: list[tuple[str, int]] = []
    enter, launch = StagingBuffer.enter_thread, StagingBuffer.launch
    monkeypatch.setattr(StagingBuffer, "enter_thread", lambda self: (
        events.append(("enter", threading.get_ident())), enter(self))[1])
    monkeypatch.setattr(StagingBuffer, "launch", lambda self, ops: (
        events.append(("launch", threading.get_ident())), launch(self, ops))[1])
    s = big_setup(pair, "fused->split")
    lid, rid = s.plan.desc_ids(ALL_LOCAL, ALL_REMOTE)
    slot = int(s.plan.local_table()[0, 1])
    with chunk_agent(pair, s, len(lid) * slot // 10 // slot * slot, ranges=True) as (
            agent, lh, rh):
        h = agent.make_prepped_xfer("READ", lh, lid, rh, rid, notif_msg=b"chunked")
        state = agent.transfer(h)
        deadline = time.monotonic() + 30
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.05)         # vLLM polls once per step: the driver moves the chunks
            state = agent.check_xfer_state(h)
        agent.release_xfer_handle(h)
        assert state == "DONE"
    assert np.array_equal(s.lbuf, big_expected(s))
    drain_notifs(pair, 1)
    others = [t for kind, t in events if kind == "launch" and t != threading.get_ident()]
    assert others, "no gather was launched by the driver"
    for t in set(others):
        first_launch = events.index(("launch", t))
        assert ("enter", t) in events[:first_launch], events


@RUNS_OR_TWIN
@pytest.mark.parametrize(("nth", "state"), [(3, "ERR"), (3, "PROC")])
def test_chunked_read_failed_or_aborted_mid_request(pair: NixlPair, nth: int,
                                                    state: str, ranges: bool) -> None:
    """The third chunk READ fails (``ERR``), or never ends and vLLM releases the READ
    mid-pipeline (an abort): the request ends ``ERR`` (vLLM recomputes it) or is let go, no
    notification tells the peer it may free its blocks, every chunk is released and all
    staging comes back, and the next request through the same agent is byte-exact."""
    s = big_setup(pair, "fused->split")
    lid, rid = s.plan.desc_ids(ALL_LOCAL, ALL_REMOTE)
    slot = int(s.plan.local_table()[0, 1])
    capacity = len(lid) * slot // 10 // slot * slot
    scripted = ScriptedAgent(pair.agent, nth, state)
    with chunk_agent(pair, s, capacity, scripted, ranges) as (agent, lh, rh):
        made = len(scripted.made)
        h = agent.make_prepped_xfer("READ", lh, lid, rh, rid, notif_msg=b"chunked")
        got = agent.transfer(h)
        deadline = time.monotonic() + 10
        while got == "PROC" and time.monotonic() < deadline and (
                state == "ERR" or len(scripted.made) < made + nth):
            got = agent.check_xfer_state(h)
        assert got == ("ERR" if state == "ERR" else "PROC")
        agent.release_xfer_handle(h)
        assert agent.stats.chunked_reads == 1
        assert agent.stats.chunk_failures == (state == "ERR")
        assert agent.staging_free == capacity
        assert drain_notifs(pair, 1, wait_s=0.5) == []
        s.lbuf[:] = 0
        scripted._nth = 10**6                     # the next request's READs are left alone
        state2, _ = read_through(agent, lh, rh, lid, rid)
        assert state2 == "DONE"
        assert np.array_equal(s.lbuf, big_expected(s))
        assert drain_notifs(pair, 1) == [b"chunked"]
        assert agent.staging_free == capacity


@RUNS_OR_TWIN
def test_chunks_landing_out_of_order_never_share_a_lane(pair: NixlPair, ranges: bool) -> None:
    """The first chunk READ lands only after the third and fourth were posted (NIXL ends
    READs in any order): the chunks after the second go into the lane the second one freed,
    never into the first's while it is still being read -- byte-exact, staging all back."""
    s = big_setup(pair, "fused->split")
    lid, rid = s.plan.desc_ids(ALL_LOCAL, ALL_REMOTE)
    slot = int(s.plan.local_table()[0, 1])
    capacity = len(lid) * slot // 10 // slot * slot
    scripted = ScriptedAgent(pair.agent, 1, "PROC", until=4)
    with chunk_agent(pair, s, capacity, scripted, ranges) as (agent, lh, rh):
        state, _ = read_through(agent, lh, rh, lid, rid)
        assert state == "DONE"
        assert agent.stats.chunks >= 4 and len(scripted.made) == agent.stats.chunks
        assert np.array_equal(s.lbuf, big_expected(s))
        assert agent.staging_free == capacity
        drain_notifs(pair, 1)


def test_chunks_too_small_for_the_runs_go_per_segment(pair: NixlPair) -> None:
    """Staging of four rows for a request of 48: lanes of one row would post one chunk READ
    per row, no descriptor saved -- the request runs vLLM's own READ, and says why."""
    s = set_up(pair, "fused->split")
    lids, rids = list(range(N_LOCAL)), [2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    slot = int(s.plan.local_table()[0, 1])
    run = staged_read(pair, s, lids, rids, capacity=4 * slot)
    assert run.state == "DONE"
    assert np.array_equal(s.lbuf, expected_read(s, lids, rids))
    assert run.stats.staged_reads == 0
    assert [r for r in run.stats.not_staged if "chunks of the staging buffer cut" in r]
    assert run.free_after == 4 * slot


def test_a_read_of_large_descriptors_goes_as_vllm_built_it(pair: NixlPair,
                                                            monkeypatch) -> None:
    """vLLM's READ whose descriptors average :data:`BYTE_BOUND` or more (a kvcached pool's
    2 MiB pages) moves bytes at NIXL's pace: staging would only add its gather and a NIXL
    round trip per chunk (GPU runs cu, cv: 2-6x of vLLM's READ).  It goes as built,
    byte-exact, and says why; one byte over its average, the same READ is staged."""
    s = set_up(pair, "fused->split")
    lids, rids = LIDS, remote_ids(s.case)
    lid, _ = s.plan.desc_ids(lids, rids)
    slot = int(s.plan.local_table()[0, 1])
    staged = staged_read(pair, s, lids, rids)
    assert staged.stats.staged_reads == 1
    average = slot * len(lid) // staged.stats.descriptors_stock
    for bound, is_staged in ((average, False), (average + 1, True)):
        monkeypatch.setattr(staging_reads, "BYTE_BOUND", bound)
        s.lbuf[:] = 0
        run = staged_read(pair, s, lids, rids)
        assert run.state == "DONE"
        assert np.array_equal(s.lbuf, expected_read(s, lids, rids))
        assert run.stats.staged_reads == is_staged
        assert bool(run.stats.not_staged) != is_staged
        if not is_staged:
            assert list(run.stats.not_staged) == [staging_reads.BYTES_BOUND]
            assert run.desc_count == staged.stats.descriptors_stock


def test_chunks_advance_between_vllm_polls(pair: NixlPair) -> None:
    """vLLM polls once per engine step; the chunks must not wait for it.  Posted and never
    polled, a READ of tens of chunks still lands whole (the peer hears so) and the first poll
    after that answers ``DONE``."""
    s = big_setup(pair, "fused->split")
    lid, rid = s.plan.desc_ids(ALL_LOCAL, ALL_REMOTE)
    slot = int(s.plan.local_table()[0, 1])
    capacity = len(lid) * slot // 10 // slot * slot
    with chunk_agent(pair, s, capacity) as (agent, lh, rh):
        h = agent.make_prepped_xfer("READ", lh, lid, rh, rid, notif_msg=b"chunked")
        assert agent.transfer(h) == "PROC"
        assert drain_notifs(pair, 1, wait_s=30) == [b"chunked"]    # no poll in between
        assert agent.stats.chunks >= 10
        deadline = time.monotonic() + 5
        while (state := agent.check_xfer_state(h)) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.05)            # the last gathers (on GPU, async) may still run
        assert state == "DONE"
        agent.release_xfer_handle(h)
        assert np.array_equal(s.lbuf, big_expected(s))
        assert agent.staging_free == capacity


def test_two_chunked_reads_at_once_each_in_its_own_lanes(pair: NixlPair) -> None:
    """vLLM posts every request of a step before it polls any: two READs larger than the
    staging run at once, each in lanes of its half of the buffer, both byte-exact, each
    notifying the peer once; all staging back."""
    s = big_setup(pair, "fused->split")
    halves = [(ALL_LOCAL[:32], ALL_REMOTE[:32]), (ALL_LOCAL[32:], ALL_REMOTE[32:])]
    ids = [s.plan.desc_ids(lo, re) for lo, re in halves]
    slot = int(s.plan.local_table()[0, 1])
    capacity = len(ids[0][0]) * slot // 3 // slot * slot
    with chunk_agent(pair, s, capacity) as (agent, lh, rh):
        handles = [agent.make_prepped_xfer("READ", lh, lid, rh, rid, notif_msg=f"r{i}".encode())
                   for i, (lid, rid) in enumerate(ids)]
        states = [agent.transfer(h) for h in handles]
        deadline = time.monotonic() + 30
        while "PROC" in states and time.monotonic() < deadline:
            states = [agent.check_xfer_state(h) for h in handles]
        assert states == ["DONE", "DONE"]
        for h in handles:
            agent.release_xfer_handle(h)
        assert agent.stats.chunked_reads == 2 and not agent.stats.not_staged
        assert np.array_equal(s.lbuf, big_expected(s))
        assert sorted(drain_notifs(pair, 2)) == [b"r0", b"r1"]
        assert agent.staging_free == capacity
