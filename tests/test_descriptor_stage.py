"""Staged K/V conversion (lab/kv_reference.py over pdpatch.kv.staging.plans): byte-exact against
the independent logical oracle of kv_helpers, in both directions and both forms (address plans,
vLLM tables + ids), with the descriptor counts that make it fast: one per remote-contiguous
run."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_helpers import LayoutSpec, build_side, expected_copy, simulate

from lab.kv_reference import (
    coalesce,
    merge_copies,
    nixl_merged_count,
    split_staged,
    stage,
    stage_ids,
    whole_blocks,
)
from pdpatch.kv import HeadSlice, KVPlanError, PairPlan, infer_geometry
from pdpatch.kv.staging.plans import CopyPlan, TransportCost, staging_table

L, N, BS, H, D, ES = 2, 24, 4, 2, 4, 2
SEG = BS * H * D * ES


def _geo(side):
    return infer_geometry(side.infos, num_blocks=N, kv_dim=side.kv_dim, label=side.spec.kind)


def _copy(buf: np.ndarray, base: int, cp: CopyPlan) -> None:
    """Apply local copies inside one address space (staging lives in the same buffer)."""
    for s, d, n in zip(cp.src.tolist(), cp.dst.tolist(), cp.length.tolist(), strict=True):
        buf[d - base:d - base + n] = buf[s - base:s - base + n].copy()


def _sides(lkind: str, rkind: str, seed: int, staging: int):
    """Local side with ``staging`` spare bytes at the end of its buffer (the staging area)."""
    rng = np.random.default_rng(seed)
    local = build_side(LayoutSpec(lkind), L, N, BS, H, D, ES)
    lbuf = np.zeros(local.buf.size + staging, dtype=np.uint8)
    local = build_side(LayoutSpec(lkind), L, N, BS, H, D, ES, buf=lbuf, base=0)
    remote = build_side(LayoutSpec(rkind, overalloc=2), L, N, BS, H, D, ES, base=1 << 20)
    remote.buf[:] = rng.integers(1, 256, remote.buf.size, dtype=np.uint8)
    local.buf[:] = rng.integers(1, 256, local.buf.size, dtype=np.uint8)
    return local, remote, local.buf.size - staging


RUNS = ([*range(3, 11), 15, 0], [*range(12, 20), 2, 21])  # a run of 8 plus two singles
PAIRS = [("fused", "fa_split"), ("fa_split", "fused"), ("fused", "fused"),
         ("split_half", "fused"), ("fused", "split_half")]


@pytest.mark.parametrize(("lkind", "rkind"), PAIRS)
@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_staged_address_plan_is_byte_exact(lkind: str, rkind: str, op: str) -> None:
    staging = 4 * L * 2 * len(RUNS[0]) * SEG
    local, remote, st_base = _sides(lkind, rkind, 1, staging)
    plan = PairPlan(_geo(local), _geo(remote)).descs(*RUNS)
    staged = stage(plan, st_base, op=op, staging_bytes=staging)
    assert staged.staging_bytes == plan.total_bytes
    assert staged.transfer.total_bytes == staged.copies.total_bytes == plan.total_bytes
    lexp, rexp = local.buf.copy(), remote.buf.copy()
    el = build_side(local.spec, L, N, BS, H, D, ES, buf=lexp, base=0)
    er = build_side(remote.spec, L, N, BS, H, D, ES, buf=rexp, base=remote.base)
    if op == "READ":
        expected_copy(el, remote, *RUNS)
        simulate(local.buf, 0, remote.buf, remote.base, staged.transfer.local_addr,
                 staged.transfer.remote_addr, staged.transfer.length, "READ")
        _copy(local.buf, 0, staged.copies)
    else:
        expected_copy(er, local, RUNS[1], RUNS[0], dst_is_local=False)
        _copy(local.buf, 0, staged.copies)
        simulate(local.buf, 0, remote.buf, remote.base, staged.transfer.local_addr,
                 staged.transfer.remote_addr, staged.transfer.length, "WRITE")
    # the staging area is scratch; everything else must equal the oracle
    assert np.array_equal(local.buf[:st_base], lexp[:st_base])
    assert np.array_equal(remote.buf, rexp)


def test_descriptor_counts_follow_remote_contiguity() -> None:
    """Staged: one descriptor per remote-contiguous run; per-segment conversions never merge."""
    staging = L * 2 * len(RUNS[0]) * SEG
    runs = 3  # 8-block run + 2 singles, per layer
    for lkind, rkind, per_layer in (("fa_split", "fused", runs),  # fused remote: [K|V] merges
                                    ("fused", "fa_split", 2 * runs)):  # split remote: K, V pools
        local, remote, st_base = _sides(lkind, rkind, 2, staging)
        plan = PairPlan(_geo(local), _geo(remote)).descs(*RUNS)
        assert len(coalesce(plan)) == len(plan) == L * 2 * len(RUNS[0])
        assert len(stage(plan, st_base).transfer) == L * per_layer, (lkind, rkind)
    # same-layout fused path for reference: the staged count equals it for a fused remote
    local, remote, st_base = _sides("fused", "fused", 3, staging)
    plan = PairPlan(_geo(local), _geo(remote)).descs(*RUNS)
    assert len(coalesce(plan)) == L * runs


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_staged_ids_equal_the_address_form_for_a_split_remote(op: str) -> None:
    """vLLM form: the stock per-segment remote table + a staging table prepared once, per
    request only ids.  NIXL merges consecutive ids over contiguous memory, which a split
    remote's table has for runs, so the ids form posts what the address form posts."""
    local, remote, st_base = _sides("fused", "fa_split", 4, 4 * L * 2 * len(RUNS[0]) * SEG)
    pair = PairPlan(_geo(local), _geo(remote))
    lt, rt = pair.local_table(), pair.remote_table()
    lid, rid = pair.desc_ids(*RUNS)
    slots = L * 2 * len(RUNS[0])
    sids = stage_ids(lt, rt, lid, rid, st_base, SEG, slots, op=op)
    stt = staging_table(st_base, SEG, slots)
    addr = stage(pair.descs(*RUNS), st_base, op=op)
    assert nixl_merged_count(stt, rt, sids.staging_ids, sids.remote_ids) == len(addr.transfer)
    merged = merge_copies(stt[sids.staging_ids, 0], rt[sids.remote_ids, 0],
                          rt[sids.remote_ids, 1])
    assert np.array_equal(merged.src, addr.transfer.local_addr)
    assert np.array_equal(merged.dst, addr.transfer.remote_addr)
    assert np.array_equal(sids.copies.src, addr.copies.src)
    assert np.array_equal(sids.copies.dst, addr.copies.dst)
    assert np.array_equal(sids.copies.length, addr.copies.length)


def test_vllm_tables_merge_only_whole_blocks_or_split_runs() -> None:
    """NIXL's merge needs consecutive table entries: per-segment fused tables never merge,
    whole-block tables merge [K|V] and runs, split tables merge runs within each pool."""
    runs = 3  # the 8-block run + 2 singles
    local, remote, _ = _sides("fused", "fused", 5, 0)
    pair = PairPlan(_geo(local), _geo(remote))
    lt, rt = pair.local_table(), pair.remote_table()
    lid, rid = pair.desc_ids(*RUNS)
    assert nixl_merged_count(lt, rt, lid, rid) == len(lid) == L * 2 * len(RUNS[0])
    whole = PairPlan(whole_blocks(_geo(local)), whole_blocks(_geo(remote)))
    wl, wr = whole.desc_ids(*RUNS)
    assert len(wl) == L * len(RUNS[0])
    assert nixl_merged_count(whole.local_table(), whole.remote_table(), wl, wr) == L * runs
    assert whole.descs(*RUNS).total_bytes == pair.descs(*RUNS).total_bytes
    ls, rs_, _ = _sides("fa_split", "fa_split", 6, 0)
    sp = PairPlan(_geo(ls), _geo(rs_))
    sl, sr = sp.desc_ids(*RUNS)
    assert nixl_merged_count(sp.local_table(), sp.remote_table(), sl, sr) == L * 2 * runs
    with pytest.raises(KVPlanError, match="split"):
        whole_blocks(_geo(ls))


def test_whole_blocks_move_the_same_bytes() -> None:
    local, remote, _ = _sides("fused", "fused", 8, 0)
    lexp = local.buf.copy()
    expected_copy(build_side(local.spec, L, N, BS, H, D, ES, buf=lexp, base=0), remote, *RUNS)
    plan = PairPlan(whole_blocks(_geo(local)), whole_blocks(_geo(remote))).descs(*RUNS)
    simulate(local.buf, 0, remote.buf, remote.base, plan.local_addr, plan.remote_addr,
             plan.length)
    assert np.array_equal(local.buf, lexp)


def test_chunks_cover_the_same_bytes() -> None:
    cp = merge_copies([0, 100, 1000], [5000, 5100, 9000], [100, 50, 300])
    assert len(cp) == 2 and cp.length.tolist() == [150, 300]
    ch = cp.chunks(64)
    assert ch.length.max() <= 64 and ch.total_bytes == cp.total_bytes
    got = sorted(zip(ch.src.tolist(), ch.dst.tolist(), ch.length.tolist(), strict=True))
    covered = {(s + i, d + i) for s, d, n in got for i in range(n)}
    want = {(s + i, d + i) for s, d, n in zip(cp.src.tolist(), cp.dst.tolist(),
                                               cp.length.tolist(), strict=True)
            for i in range(n)}
    assert covered == want
    with pytest.raises(ValueError):
        cp.chunks(0)


def test_refusals() -> None:
    local, remote, st_base = _sides("fused", "fa_split", 6, 2 * L * 2 * SEG)
    pair = PairPlan(_geo(local), _geo(remote))
    plan = pair.descs([1, 2], [3, 4])
    with pytest.raises(KVPlanError, match="staging"):
        stage(plan, st_base, staging_bytes=plan.total_bytes - 1)
    with pytest.raises(ValueError, match="op"):
        stage(plan, st_base, op="PUSH")
    twice = pair.descs([1, 2], [3, 3])  # a WRITE would land twice on remote block 3
    with pytest.raises(KVPlanError, match="overlap"):
        stage(twice, st_base)
    lt, rt = pair.local_table(), pair.remote_table()
    lid, rid = pair.desc_ids([1, 2], [3, 4])
    with pytest.raises(KVPlanError, match="slots"):
        stage_ids(lt, rt, lid, rid, st_base, SEG, len(lid) - 1)
    with pytest.raises(KVPlanError, match="B but"):
        stage_ids(lt, rt, lid, rid, st_base, SEG // 2, len(lid))
    # head-sliced TP (remote has twice the heads): slots are the slice, one local segment
    wide = build_side(LayoutSpec("fa_split"), L, N, BS, 2 * H, D, ES, base=1 << 20)
    sl = PairPlan(_geo(local), _geo(wide), remote_slice=HeadSlice(2, 1))
    lid, rid = sl.desc_ids([1], [3])
    out = stage_ids(sl.local_table(), sl.remote_table(), lid, rid, st_base, SEG, len(lid))
    assert out.copies.total_bytes == len(lid) * SEG


@pytest.mark.parametrize(("lkind", "rkind"), PAIRS)
def test_gap_reads_are_byte_exact_and_use_fewer_descriptors(lkind: str, rkind: str) -> None:
    """READ across small unrequested gaps: fewer descriptors, the gap bytes stay in staging."""
    lids, rids = [1, 2, 3, 4, 5, 6], [0, 2, 4, 6, 9, 20]  # every other remote block, then far
    local, remote, st_base = _sides(lkind, rkind, 9, 8 * L * 2 * 24 * SEG)
    rgeo = _geo(remote)
    plan = PairPlan(_geo(local), rgeo).descs(lids, rids)
    exact = stage(plan, st_base)
    gap = stage(plan, st_base, max_gap=2 * SEG, remote_ranges=rgeo.registration_ranges())
    assert len(gap.transfer) < len(exact.transfer)
    assert gap.staging_bytes > plan.total_bytes == exact.staging_bytes
    assert gap.copies.total_bytes == plan.total_bytes
    lexp = local.buf.copy()
    expected_copy(build_side(local.spec, L, N, BS, H, D, ES, buf=lexp, base=0), remote,
                  lids, rids)
    simulate(local.buf, 0, remote.buf, remote.base, gap.transfer.local_addr,
             gap.transfer.remote_addr, gap.transfer.length, "READ")
    _copy(local.buf, 0, gap.copies)
    assert np.array_equal(local.buf[:st_base], lexp[:st_base])
    # descriptors stay inside one registered range each
    spans = rgeo.registration_ranges()
    for a, n in zip(gap.transfer.remote_addr.tolist(), gap.transfer.length.tolist(),
                    strict=True):
        assert any(s <= a and a + n <= e for s, e in spans)


def test_gap_limits() -> None:
    local, remote, st_base = _sides("fused", "fa_split", 10, 8 * L * 2 * 24 * SEG)
    rgeo = _geo(remote)
    plan = PairPlan(_geo(local), rgeo).descs([1, 2, 3], [0, 2, 4])
    ranges = rgeo.registration_ranges()
    with pytest.raises(KVPlanError, match="READ only"):
        stage(plan, st_base, op="WRITE", max_gap=SEG, remote_ranges=ranges)
    with pytest.raises(KVPlanError, match="remote_ranges"):
        stage(plan, st_base, max_gap=SEG)
    # staging with room for the request only: the gap shrinks until it fits (here: to none)
    tight = stage(plan, st_base, max_gap=4 * SEG, remote_ranges=ranges,
                  staging_bytes=plan.total_bytes)
    assert tight.staging_bytes == plan.total_bytes
    assert len(tight.transfer) == len(stage(plan, st_base).transfer)
    # one registered range per block pool: no gap read crosses into another range
    split = [(s, e) for s, e in ranges]
    cut = [(s, s + SEG) for s, _ in split] + [(s + SEG, e) for s, e in split]
    by_block = stage(plan, st_base, max_gap=64 * SEG, remote_ranges=cut)
    for a, n in zip(by_block.transfer.remote_addr.tolist(), by_block.transfer.length.tolist(),
                    strict=True):
        assert any(s <= a and a + n <= e for s, e in cut)


@given(cost_us=st.floats(0.05, 50), gbps=st.floats(0.1, 2000),
       many=st.integers(100, 100_000), seg=st.integers(512, 1 << 20))
def test_transport_cost_recovers_the_model(cost_us: float, gbps: float, many: int,
                                           seg: int) -> None:
    """Two READs timed by the model itself give the model back, and its gap budget is the
    gap whose wire time equals one descriptor's cost."""
    truth = TransportCost(cost_us * 1e-6, gbps * 1e9)

    def seconds(descs: int, nbytes: int) -> float:
        return descs * truth.desc_cost_s + nbytes / truth.bandwidth_bps

    small = (many, many * seg, seconds(many, many * seg))
    big = (4, many * seg, seconds(4, many * seg))
    got = TransportCost.from_timings(small, big)
    assert got.desc_cost_s == pytest.approx(truth.desc_cost_s, rel=1e-6)
    assert got.bandwidth_bps == pytest.approx(truth.bandwidth_bps, rel=1e-6)
    budget = got.gap_budget()
    assert seconds(0, budget) <= truth.desc_cost_s * (1 + 1e-9)
    assert seconds(0, budget + 2) > truth.desc_cost_s


def test_transport_cost_refuses_what_it_cannot_solve() -> None:
    with pytest.raises(ValueError, match="independent"):
        TransportCost.from_timings((10, 100, 1.0), (20, 200, 2.0))
    with pytest.raises(ValueError, match="positive"):
        TransportCost.from_timings((10, 100, 0.0), (1, 1000, 1.0))
    # the big READ slower per byte than the small one's whole time allows: no bandwidth fits
    with pytest.raises(ValueError, match="no positive bandwidth"):
        TransportCost.from_timings((1000, 1000, 1.0), (1, 10**6, 1e-6))
    # a per-descriptor cost below zero (noise) is clipped, not returned negative
    assert TransportCost.from_timings((100, 100, 1e-8), (1, 10**6, 1e-3)).desc_cost_s == 0.0


@given(cost_us=st.floats(0.05, 50), gbps=st.floats(0.1, 2000), fixed_us=st.floats(0, 500),
       descs=st.integers(2, 4096), seg=st.integers(512, 1 << 20), big=st.integers(1, 1 << 12))
def test_transport_cost_from_reads_errs_small(cost_us: float, gbps: float, fixed_us: float,
                                              descs: int, seg: int, big: int) -> None:
    """The staging agent's three calibration READs, timed by a model with a fixed cost per
    READ: the per-descriptor cost comes back exactly, the bandwidth never above the truth
    (and within 1% once the big READ's wire time is 100x that fixed cost), so the gap budget
    never exceeds the true one."""
    truth = TransportCost(cost_us * 1e-6, gbps * 1e9)

    def read(n: int, nbytes: int) -> tuple[int, int, float]:
        return n, nbytes, fixed_us * 1e-6 + n * truth.desc_cost_s + nbytes / truth.bandwidth_bps

    big_bytes = big * descs * seg
    got = TransportCost.from_reads(read(descs, descs * seg), read(1, descs * seg),
                                   read(1, big_bytes))
    assert got.desc_cost_s == pytest.approx(truth.desc_cost_s, rel=1e-6)
    assert got.bandwidth_bps <= truth.bandwidth_bps * (1 + 1e-9)
    if big_bytes / truth.bandwidth_bps >= 100 * (fixed_us * 1e-6 + truth.desc_cost_s):
        assert got.bandwidth_bps == pytest.approx(truth.bandwidth_bps, rel=1e-2)
    assert got.gap_budget() <= truth.gap_budget() + 1


def test_transport_cost_from_reads_refuses_what_it_cannot_solve() -> None:
    with pytest.raises(ValueError, match="same bytes"):
        TransportCost.from_reads((8, 100, 1.0), (1, 200, 1.0), (1, 400, 1.0))
    with pytest.raises(ValueError, match="same bytes"):
        TransportCost.from_reads((1, 100, 1.0), (8, 100, 1.0), (1, 400, 1.0))
    with pytest.raises(ValueError, match="positive"):
        TransportCost.from_reads((8, 100, 1.0), (1, 100, 0.0), (1, 400, 1.0))
    # noise: the many descriptors timed faster than the one -- no cost, not a negative one
    assert TransportCost.from_reads((8, 100, 1.0), (1, 100, 2.0), (1, 400, 1.0)
                                    ).desc_cost_s == 0.0


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("parts", [1, 2, 3, 7, 100])
def test_split_staged_pieces_cover_the_plan(op: str, parts: int) -> None:
    """Pieces: the transfer descriptors in order, each piece's copies exactly its staging
    range; applied piece by piece (copy after / before each transfer) they give the oracle."""
    local, remote, st_base = _sides("fused", "fa_split", 11, 8 * L * 2 * 24 * SEG)
    rgeo = _geo(remote)
    plan = PairPlan(_geo(local), rgeo).descs(*RUNS)
    kw = {"max_gap": 2 * SEG, "remote_ranges": rgeo.registration_ranges()} if op == "READ" \
        else {}
    whole = stage(plan, st_base, op=op, **kw)
    pieces = split_staged(whole, parts)
    assert 1 <= len(pieces) <= min(parts, len(whole.transfer))
    assert np.array_equal(np.concatenate([p.transfer.local_addr for p in pieces]),
                          whole.transfer.local_addr)
    assert sum(p.copies.total_bytes for p in pieces) == whole.copies.total_bytes
    lexp, rexp = local.buf.copy(), remote.buf.copy()
    if op == "READ":
        expected_copy(build_side(local.spec, L, N, BS, H, D, ES, buf=lexp, base=0), remote,
                      *RUNS)
    else:
        expected_copy(build_side(remote.spec, L, N, BS, H, D, ES, buf=rexp, base=remote.base),
                      local, RUNS[1], RUNS[0], dst_is_local=False)
    for p in pieces:
        t = p.transfer
        if op == "WRITE":
            _copy(local.buf, 0, p.copies)
        simulate(local.buf, 0, remote.buf, remote.base, t.local_addr, t.remote_addr, t.length,
                 op)
        if op == "READ":
            _copy(local.buf, 0, p.copies)
    assert np.array_equal(local.buf[:st_base], lexp[:st_base])
    assert np.array_equal(remote.buf, rexp)
    with pytest.raises(ValueError):
        split_staged(whole, 0)


@st.composite
def requests(draw):
    lkind, rkind = draw(st.sampled_from(PAIRS))
    n = draw(st.integers(1, 12))
    lids = draw(st.permutations(range(N)))[:n]
    rids = draw(st.permutations(range(N)))[:n]
    if draw(st.booleans()):  # runs on both sides
        s_l, s_r = draw(st.integers(0, N - n)), draw(st.integers(0, N - n))
        lids, rids = list(range(s_l, s_l + n)), list(range(s_r, s_r + n))
    return lkind, rkind, lids, rids, draw(st.sampled_from(["READ", "WRITE"]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_staged_equals_direct_plan(req) -> None:
    """Property: staging + copies leave both sides exactly as the direct plan does."""
    lkind, rkind, lids, rids, op = req
    staging = 4 * L * N * SEG  # room for gap reads over the whole remote pool
    local, remote, st_base = _sides(lkind, rkind, 7, staging)
    plan = PairPlan(_geo(local), _geo(remote)).descs(lids, rids)
    lref, rref = local.buf.copy(), remote.buf.copy()
    simulate(lref, 0, rref, remote.base, plan.local_addr, plan.remote_addr, plan.length, op)
    gap = SEG * (len(lids) % 3) if op == "READ" else 0
    staged = stage(plan, st_base, op=op, max_gap=gap,
                   remote_ranges=_geo(remote).registration_ranges() if gap else None,
                   staging_bytes=staging)
    if op == "WRITE":
        _copy(local.buf, 0, staged.copies.chunks(3 * SEG // 2))
    simulate(local.buf, 0, remote.buf, remote.base, staged.transfer.local_addr,
             staged.transfer.remote_addr, staged.transfer.length, op)
    if op == "READ":
        _copy(local.buf, 0, staged.copies.chunks(3 * SEG // 2))
    assert np.array_equal(local.buf[:st_base], lref[:st_base])
    assert np.array_equal(remote.buf, rref)
    assert len(staged.transfer) <= len(coalesce(plan))
    if gap:
        assert staged.staging_bytes >= plan.total_bytes
