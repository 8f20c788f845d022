"""Descriptor planning between KV geometries: byte-exact by simulation against an
independent oracle (numpy views of the same strided tensors), coalescing, strided rows,
vLLM desc-id tables, and loud mismatches."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_helpers import LAYOUTS, LayoutSpec, build_side, expected_copy, simulate

from lab.kv_reference import (
    coalesce,
    expand_strided,
    plan_from_nx3,
    strided_pair_rows,
    vllm_local_descs,
    vllm_remote_descs,
)
from pdpatch.kv import (
    BlockIdError,
    GeometryMismatch,
    HeadOrderMismatch,
    HeadSlice,
    PairPlan,
    as_tuples,
    infer_geometry,
    plan_transfer,
)


def _geo(side, num_blocks):
    return infer_geometry(side.infos, num_blocks=num_blocks, kv_dim=side.kv_dim,
                          label=side.spec.kind)


def _fill(side, rng, zero: bool) -> None:
    if zero:
        side.buf[:] = 0
    else:
        side.buf[:] = rng.integers(1, 256, side.buf.size, dtype=np.uint8)


# ----------------------------------------------------------------------------- examples
def test_split_to_fused_one_descriptor_per_segment_into_each_half() -> None:
    L, N, bs, H, D, es = 2, 8, 4, 2, 4, 2
    seg = bs * H * D * es
    local = build_side(LayoutSpec("fused"), L, N, bs, H, D, es)
    remote = build_side(LayoutSpec("fa_split"), L, N, bs, H, D, es)
    lg, rg = _geo(local, N), _geo(remote, N)
    pair = PairPlan(lg, rg)
    assert pair.converts and pair.num_regions == 2 * L
    plan = pair.descs([5, 1], [2, 7])
    assert len(plan) == 2 * L * 2
    assert set(plan.length.tolist()) == {seg}
    # region-major: L0.K (blocks 5, 1), L0.V, L1.K, L1.V
    lb0, rb0 = lg.layers[0].base, rg.layers[0].base
    assert plan.local_addr[:4].tolist() == [
        lb0 + 5 * 2 * seg, lb0 + 1 * 2 * seg, lb0 + 5 * 2 * seg + seg, lb0 + 1 * 2 * seg + seg]
    assert plan.remote_addr[:4].tolist() == [
        rb0 + 2 * seg, rb0 + 7 * seg, rb0 + N * seg + 2 * seg, rb0 + N * seg + 7 * seg]
    # and the reverse direction pairs the same bytes the other way round
    back = PairPlan(rg, lg).descs([2, 7], [5, 1])
    assert back.local_addr.tolist() == plan.remote_addr.tolist()
    assert back.remote_addr.tolist() == plan.local_addr.tolist()


def test_equal_layouts_are_a_pass_through() -> None:
    L, N, bs, H, D, es = 3, 10, 4, 2, 4, 2
    for kind in LAYOUTS:
        a = build_side(LayoutSpec(kind), L, N, bs, H, D, es)
        b = build_side(LayoutSpec(kind, block_pad=4, layer_gap=8), L, N, bs, H, D, es)
        pair = PairPlan(_geo(a, N), _geo(b, N))
        assert not pair.converts, kind
        # stock vLLM's remote descriptors for an equal layout: per region base + b * stride
        rows = pair.remote_rows()
        assert rows.shape == (L * _geo(a, N).segments_per_layer, 5)
        assert (rows[:, 4] == N).all()
        assert np.array_equal(expand_strided(rows), pair.remote_table())


def test_fused_runs_coalesce_to_one_descriptor_per_run() -> None:
    L, N, bs, H, D, es = 2, 32, 4, 2, 4, 2
    a = build_side(LayoutSpec("fused"), L, N, bs, H, D, es)
    b = build_side(LayoutSpec("fused"), L, N, bs, H, D, es)
    plan = plan_transfer(_geo(a, N), _geo(b, N), [*range(4, 12), 20], [*range(10, 18), 0])
    assert len(plan) == L * 2 * 9
    c = coalesce(plan)
    assert len(c) == L * 2  # one run of 8 blocks ([K|V] merged) + one single block, per layer
    assert c.total_bytes == plan.total_bytes
    # split -> fused: K and V stay apart on the split side, so nothing merges...
    s = build_side(LayoutSpec("fa_split"), L, N, bs, H, D, es)
    conv = plan_transfer(_geo(a, N), _geo(s, N), list(range(4, 12)), list(range(10, 18)))
    assert len(coalesce(conv)) == len(conv) == L * 2 * 8
    # ...but the run compresses into one strided row per region on each side
    lr, rr = strided_pair_rows(conv)
    assert lr.shape == rr.shape == (L * 2, 5)
    assert (lr[:, 4] == 8).all() and (lr[:, 3] == 2 * bs * H * D * es).all()
    assert (rr[:, 3] == bs * H * D * es).all()


def test_head_sliced_tp_reads_the_rank_slice() -> None:
    # D_TP = 2 * P_TP: the remote block holds 4 heads, local rank 1 reads heads 2..3
    L, N, bs, D, es = 1, 4, 2, 4, 2
    local = build_side(LayoutSpec("fused"), L, N, bs, 2, D, es)
    remote = build_side(LayoutSpec("fa_split"), L, N, bs, 4, D, es)
    pair = PairPlan(_geo(local, N), _geo(remote, N), remote_slice=HeadSlice(2, 1))
    plan = pair.descs([0], [3])
    half = bs * 2 * D * es
    rg = _geo(remote, N)
    assert plan.length.tolist() == [half, half]
    assert plan.remote_addr[0] == rg.layers[0].segment_addr(0, 3) + half


def test_vllm_remote_descs_forms_keep_stock_count_and_order() -> None:
    L, N, bs, H, D, es = 2, 5, 4, 2, 4, 1
    local = build_side(LayoutSpec("fused"), L, 7, bs, H, D, es)
    remote = build_side(LayoutSpec("split_half", overalloc=3), L, N, bs, H, D, es)
    lg, rg = _geo(local, 7), _geo(remote, N)
    nx3 = vllm_remote_descs(lg, rg)
    assert nx3.shape == (2 * L * N, 3)  # 2·L logical regions x remote num_blocks
    tuples = vllm_remote_descs(lg, rg, form="tuples")
    assert tuples == as_tuples(nx3) and isinstance(tuples[0][0], int)
    nx5 = vllm_remote_descs(lg, rg, form="nx5")
    assert np.array_equal(expand_strided(nx5), nx3)
    # desc id = region * num_blocks + block
    seg = bs * H * D * es
    for region in range(2 * L):
        layer, kv = divmod(region, 2)
        for blk in range(N):
            assert nx3[region * N + blk, 0] == rg.layers[layer].segment_addr(kv, blk)
            assert nx3[region * N + blk, 1] == seg
    with pytest.raises(ValueError, match="form"):
        vllm_remote_descs(lg, rg, form="bogus")
    # a kvcached split-half LOCAL side (vLLM 0.23-0.25 would describe it as [K|V] blocks)
    loc = vllm_local_descs(rg, form="tuples")
    assert len(loc) == 2 * L * N
    assert loc[N] == (rg.layers[0].segment_addr(1, 0), seg, 0)  # region 1 = layer 0 V
    with pytest.raises(ValueError, match="form"):
        vllm_local_descs(rg, form="bogus")
    with pytest.raises(GeometryMismatch, match="not divisible by block-size ratio 3"):
        vllm_local_descs(rg, block_size_ratio=3)


def test_block_ids_are_checked() -> None:
    N = 4
    a = build_side(LayoutSpec("fused"), 1, N, 2, 1, 2, 1)
    b = build_side(LayoutSpec("fa_split", overalloc=4), 1, N, 2, 1, 2, 1)
    pair = PairPlan(_geo(a, N), _geo(b, N))
    with pytest.raises(BlockIdError, match=r"\[0, 4\)"):
        pair.descs([0], [N])  # past the plan, though inside the over-allocated tensor
    with pytest.raises(BlockIdError):
        pair.descs([-1], [0])
    with pytest.raises(BlockIdError, match="1 local blocks vs 2 remote"):
        pair.descs([0], [1, 2])
    r2 = build_side(LayoutSpec("fa_split"), 1, 8, 1, 1, 2, 1)
    pr = PairPlan(_geo(a, N), _geo(r2, 8), block_size_ratio=2)
    pr.descs([0, 1], [0, 1, 2])  # last local block half filled: fine
    with pytest.raises(BlockIdError, match="do not fill"):
        pr.descs([0, 1], [0, 1])


def test_mismatch_messages_name_both_geometries_and_numbers() -> None:
    a = build_side(LayoutSpec("fused"), 1, 4, 4, 2, 4, 2)
    b = build_side(LayoutSpec("fa_split"), 1, 4, 4, 3, 4, 2)  # 3 heads vs 2
    with pytest.raises(GeometryMismatch) as e:
        PairPlan(_geo(a, 4), _geo(b, 4))
    msg = str(e.value)
    assert "local = fused" in msg and "remote = fa_split: split" in msg
    assert "2 heads" in msg and "3 heads" in msg
    # the same pair without head counts (stock handshake) fails on the byte spans
    from pdpatch.kv import geometry_from_handshake
    rg = _geo(b, 4)
    bare = geometry_from_handshake(
        [rg.layers[0].segment_addr(0, 0), rg.layers[0].segment_addr(1, 0)], [96, 96], 4,
        num_layers=1)
    with pytest.raises(GeometryMismatch, match=r"spans differ -- local 64 B .* remote 96 B"):
        PairPlan(_geo(a, 4), bare)


@pytest.mark.parametrize(
    ("lspec", "rspec", "lh", "rh", "kw", "match"),
    [
        (LayoutSpec("packed"), LayoutSpec("fused"), 2, 2, {}, "packed per token"),
        (LayoutSpec("fused"), LayoutSpec("fa_split", head_major=False), 2, 2, {},
         "head-major, remote token-major"),
        (LayoutSpec("fused", head_major=False), LayoutSpec("fused", head_major=False), 2, 4,
         {"remote_slice": HeadSlice(2, 0)}, "not outermost"),
        (LayoutSpec("fused"), LayoutSpec("fa_split"), 3, 3, {"local_slice": HeadSlice(2, 1)},
         "not divisible into 2"),
        (LayoutSpec("fused"), LayoutSpec("fa_split"), 2, 2, {"block_size_ratio": 3},
         "not divisible by block-size ratio 3"),
        (LayoutSpec("fused"), LayoutSpec("fa_split"), 2, 6, {"remote_slice": HeadSlice(2, 0)},
         "6 heads / 2 remote slices"),
    ],
)
def test_mismatches_raise(lspec, rspec, lh, rh, kw, match) -> None:
    a = build_side(lspec, 1, 4, 4, lh, 4, 1)
    b = build_side(rspec, 1, 4, 4, rh, 4, 1)
    with pytest.raises(GeometryMismatch, match=match):
        PairPlan(_geo(a, 4), _geo(b, 4), **kw)


def test_head_order_passes_verbatim_only_where_the_receiver_reorders() -> None:
    """A token-major decode may take a head-major peer's segments byte for byte when it
    reorders them after receive (vLLM's enable_permute_local_kv, which reads each received
    block as head-major and permutes it whole): head slices of either side at their
    head-major offsets (unequal TP), equal block sizes only, never the other way round."""
    N, bs, H, D = 6, 4, 2, 4
    tok = build_side(LayoutSpec("fused", head_major=False), 2, N, bs, H, D, 2)
    head = build_side(LayoutSpec("fa_split"), 2, N, bs, H, D, 2)
    local, remote = _geo(tok, N), _geo(head, N)
    with pytest.raises(HeadOrderMismatch, match="nothing reorders them"):
        PairPlan(local, remote)
    plan = PairPlan(local, remote, receiver_reorders_heads=True)
    assert plan.converts
    descs = plan.descs([1, 2], [4, 5])
    assert set(descs.length.tolist()) == {bs * H * D * 2}          # whole segments
    head_bytes = bs * D * 2
    # P TP 2 -> D TP 1: P rank 1's one head lands in the second head of D's received block
    one_head = _geo(build_side(LayoutSpec("fa_split"), 2, N, bs, 1, D, 2), N)
    down = PairPlan(local, one_head, receiver_reorders_heads=True,
                    local_slice=HeadSlice(2, 1)).descs([1], [4])
    assert down.length.tolist() == [head_bytes] * 4
    assert down.local_addr[0] == local.layers[0].segment_addr(0, 1) + head_bytes
    with pytest.raises(GeometryMismatch, match="token-major"):    # no reorder: not contiguous
        PairPlan(local, one_head, local_slice=HeadSlice(2, 1))
    with pytest.raises(HeadOrderMismatch, match="only with equal block sizes"):
        PairPlan(local, remote, receiver_reorders_heads=True, block_size_ratio=2)
    with pytest.raises(HeadOrderMismatch, match="nothing reorders them"):
        PairPlan(remote, local, receiver_reorders_heads=True)     # head-major receiver


def test_layer_count_mismatch() -> None:
    a = build_side(LayoutSpec("fused"), 2, 4, 4, 2, 4, 1)
    b = build_side(LayoutSpec("fused"), 3, 4, 4, 2, 4, 1)
    with pytest.raises(GeometryMismatch, match="local has 2 layers, remote 3"):
        PairPlan(_geo(a, 4), _geo(b, 4))


def test_bad_head_slice() -> None:
    with pytest.raises(GeometryMismatch, match="slice 2 of 2"):
        HeadSlice(2, 2)


# ----------------------------------------------------------------------------- properties
@st.composite
def scenarios(draw):
    layers = draw(st.integers(1, 3))
    es = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.integers(1, 3))
    remote_bs = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([1, 1, 2, 3]))
    p = draw(st.sampled_from([1, 1, 2]))  # P_TP > D_TP: local reads p remotes
    q = draw(st.sampled_from([1, 1, 2, 4]))  # D_TP > P_TP: remote holds q local slices
    unit_heads = draw(st.integers(1, 2))
    lkind = draw(st.sampled_from(LAYOUTS))
    rkind = "packed" if lkind == "packed" else draw(
        st.sampled_from([k for k in LAYOUTS if k != "packed"]))
    head_major = True if (p > 1 or q > 1) else draw(st.booleans())

    def spec(kind):
        return LayoutSpec(
            kind, head_major=head_major,
            cross_layer=draw(st.booleans()) if kind in ("fused", "packed") else False,
            block_pad=draw(st.integers(0, 3)), kv_gap=draw(st.integers(0, 5)),
            overalloc=draw(st.integers(0, 3)), layer_gap=draw(st.integers(0, 3)),
        )

    n_local = draw(st.integers(1, 5))
    k = draw(st.integers(1, n_local))
    lids = draw(st.permutations(range(n_local)))[:k]
    m = k if ratio == 1 else draw(st.integers((k - 1) * ratio + 1, k * ratio))
    n_remote = m + draw(st.integers(0, 3))
    rids = draw(st.permutations(range(n_remote)))[:m]
    return dict(
        layers=layers, es=es, head_dim=head_dim, remote_bs=remote_bs, ratio=ratio, p=p, q=q,
        pi=draw(st.integers(0, p - 1)), qi=draw(st.integers(0, q - 1)),
        unit_heads=unit_heads, lspec=spec(lkind), rspec=spec(rkind), n_local=n_local,
        n_remote=n_remote, lids=lids, rids=rids, op=draw(st.sampled_from(["READ", "WRITE"])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _sides(sc):
    lh, rh = sc["unit_heads"] * sc["p"], sc["unit_heads"] * sc["q"]
    local = build_side(sc["lspec"], sc["layers"], sc["n_local"], sc["remote_bs"] * sc["ratio"],
                       lh, sc["head_dim"], sc["es"])
    remote = build_side(sc["rspec"], sc["layers"], sc["n_remote"], sc["remote_bs"], rh,
                        sc["head_dim"], sc["es"])
    return local, remote


def _check_plan_effect(sc, local, remote, plan) -> None:
    """Simulate ``plan`` on copies and compare whole buffers with the oracle's."""
    exp_l, exp_r = local.buf.copy(), remote.buf.copy()
    el = build_side(sc["lspec"], sc["layers"], sc["n_local"], sc["remote_bs"] * sc["ratio"],
                    sc["unit_heads"] * sc["p"], sc["head_dim"], sc["es"], buf=exp_l)
    er = build_side(sc["rspec"], sc["layers"], sc["n_remote"], sc["remote_bs"],
                    sc["unit_heads"] * sc["q"], sc["head_dim"], sc["es"], buf=exp_r)
    ls, rs = (sc["p"], sc["pi"]), (sc["q"], sc["qi"])
    if sc["op"] == "READ":
        expected_copy(el, remote, sc["lids"], sc["rids"], ratio=sc["ratio"], dst_slice=ls,
                      src_slice=rs, dst_is_local=True)
    else:
        expected_copy(er, local, sc["rids"], sc["lids"], ratio=sc["ratio"], dst_slice=rs,
                      src_slice=ls, dst_is_local=False)
    act_l, act_r = local.buf.copy(), remote.buf.copy()
    simulate(act_l, 0, act_r, 0, plan.local_addr, plan.remote_addr, plan.length, sc["op"])
    assert np.array_equal(act_l, exp_l), "local bytes differ from the oracle"
    assert np.array_equal(act_r, exp_r), "remote bytes differ from the oracle"
    moved = exp_l if sc["op"] == "READ" else exp_r
    assert moved.any(), "oracle moved nothing: the test would be vacuous"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_every_requested_byte_lands_and_nothing_else_moves(sc) -> None:
    local, remote = _sides(sc)
    rng = np.random.default_rng(sc["seed"])
    # destination starts all-zero, source is nonzero everywhere: any wrong byte shows
    _fill(local, rng, zero=sc["op"] == "READ")
    _fill(remote, rng, zero=sc["op"] == "WRITE")
    lg, rg = _geo(local, sc["n_local"]), _geo(remote, sc["n_remote"])
    pair = PairPlan(lg, rg, local_slice=HeadSlice(sc["p"], sc["pi"]),
                    remote_slice=HeadSlice(sc["q"], sc["qi"]), block_size_ratio=sc["ratio"])
    plan = pair.descs(sc["lids"], sc["rids"])
    _check_plan_effect(sc, local, remote, plan)

    # coalesced: same bytes, never more descriptors
    merged = coalesce(plan)
    assert len(merged) <= len(plan) and merged.total_bytes == plan.total_bytes
    _check_plan_effect(sc, local, remote, merged)

    # strided rows expand back to the very same pairs, in order
    lrows, rrows = strided_pair_rows(plan)
    again = plan_from_nx3(expand_strided(lrows), expand_strided(rrows))
    assert np.array_equal(again.local_addr, plan.local_addr)
    assert np.array_equal(again.remote_addr, plan.remote_addr)
    assert np.array_equal(again.length, plan.length)
    # NIXL 1.5 refuses rows with stride < len or leaving one registered region
    assert (lrows[:, 3] >= lrows[:, 1]).all() and (rrows[:, 3] >= rrows[:, 1]).all()
    row_of = np.repeat(np.arange(lrows.shape[0]), lrows[:, 4].astype(np.int64))
    for row in np.unique(row_of):
        assert np.unique(plan.region[row_of == row]).size == 1

    # desc ids into vLLM-ordered tables select the same pairs
    lid, rid = pair.desc_ids(sc["lids"], sc["rids"])
    ltab, rtab = pair.local_table(), pair.remote_table()
    assert np.array_equal(ltab[lid, 0], plan.local_addr)
    assert np.array_equal(rtab[rid, 0], plan.remote_addr)
    assert np.array_equal(rtab[rid, 1], plan.length)
    assert np.array_equal(expand_strided(pair.local_rows()), ltab)
    kw = dict(block_size_ratio=sc["ratio"], local_slice=HeadSlice(sc["p"], sc["pi"]))
    assert np.array_equal(vllm_local_descs(lg, **kw), ltab)
    assert np.array_equal(vllm_local_descs(lg, form="nx5", **kw), pair.local_rows())
    assert np.array_equal(expand_strided(pair.remote_rows()), rtab)
    assert rtab.shape[0] == pair.num_regions * sc["n_remote"]


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.sampled_from(["remote_heads", "ratio", "local_heads"]),
       st.integers(1, 3))
def test_mismatched_spans_raise(sc, what, delta) -> None:
    """Perturb one side so segments no longer span the peer's slice: always an error."""
    lh, rh = sc["unit_heads"] * sc["p"], sc["unit_heads"] * sc["q"]
    rbs, ratio = sc["remote_bs"], sc["ratio"]
    p, q = sc["p"], sc["q"]
    if what == "remote_heads":
        rh += delta
    elif what == "ratio":
        ratio += delta  # the local block no longer holds `ratio` remote blocks
    else:
        lh += delta  # may also stop dividing into p head slices
    local = build_side(sc["lspec"], sc["layers"], sc["n_local"], rbs * sc["ratio"], lh,
                       sc["head_dim"], sc["es"])
    remote = build_side(sc["rspec"], sc["layers"], sc["n_remote"], rbs, rh, sc["head_dim"],
                        sc["es"])
    lg, rg = _geo(local, sc["n_local"]), _geo(remote, sc["n_remote"])
    with pytest.raises(GeometryMismatch) as e:
        PairPlan(lg, rg, local_slice=HeadSlice(p, sc["pi"]),
                 remote_slice=HeadSlice(q, sc["qi"]), block_size_ratio=ratio)
    assert "local = " in str(e.value) and "remote = " in str(e.value)
