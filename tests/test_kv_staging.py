"""The staging agent's parts on their own: the staging allocator, the torch gather and the
chunk schedule of READs larger than the staging buffer.

The agent itself runs against real NIXL in ``test_nixl_transfer.py`` and inside real vLLM
workers in ``test_kv_segments_workers.py``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpatch.kv.staging import ByteAllocator, ByteCopier, address_order, arenas_of
from pdpatch.kv.staging import copier as copier_module
from pdpatch.kv.staging.plans import (
    CopyPlan,
    chunk_bounds,
    chunk_descriptors,
    chunk_rows,
    lane_rows_to_try,
    pack_spans,
    read_spans,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.sampled_from([1, 4, 16])),
                max_size=60))
def test_allocator_never_overlaps_and_returns_everything(steps) -> None:
    size = 256
    alloc = ByteAllocator(size)
    held: list[tuple[int, int]] = []
    for do_alloc, n, align in steps:
        if do_alloc or not held:
            start = alloc.alloc(n, align)
            if start is None:
                # first fit found no aligned room: really none, in any free gap
                used = np.zeros(size, bool)
                for s, m in held:
                    used[s:s + m] = True
                assert not any(not used[a:a + n].any() and a + n <= size
                               for a in range(0, size, align))
                continue
            assert start % align == 0 and start + n <= size
            assert all(start + n <= s or s + m <= start for s, m in held)
            held.append((start, n))
        else:
            s, m = held.pop(len(held) // 2)
            alloc.free(s, m)
        assert alloc.free_bytes == size - sum(m for _, m in held)
    for s, m in held:
        alloc.free(s, m)
    assert alloc.alloc(size, 1) == 0          # freed ranges merged back into one


def test_allocator_refuses_a_double_free() -> None:
    alloc = ByteAllocator(64)
    start = alloc.alloc(16, 16)
    alloc.free(start, 16)
    with pytest.raises(ValueError, match="already free"):
        alloc.free(start, 16)


def _arena(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _limits(fused: bool):
    """Few copies (the fused copy of views) or, with a limit of 0 copies, index ops."""
    return mock.patch.object(copier_module, "FUSED_MAX_COPIES", 256 if fused else 0)


@settings(max_examples=150, deadline=None)
@given(seg=st.sampled_from([1, 3, 8, 24, 64]), n=st.integers(1, 20),
       shape=st.sampled_from(["scatter", "gather", "both", "runs"]), seed=st.integers(0, 2**16),
       path=st.sampled_from(["fused", "span", "pairs"]))
def test_copier_moves_exactly_the_planned_bytes(seg: int, n: int, shape: str, seed: int,
                                                path: str) -> None:
    """Every way a gather runs: few copies as one fused copy of views; many as one index op
    over the arenas' span, or (no span) one per arena pair."""
    rng = np.random.default_rng(seed)
    src, dst = _arena(64 * 64, seed), torch.zeros(64 * 64 + 8, dtype=torch.uint8)
    copier = ByteCopier(arenas_of([src, dst]))
    assert copier._span is not None
    if path != "span":        # the paths a copier takes where its arenas have no span
        copier._span = None
    slots = 64 * 64 // seg
    picks = rng.choice(slots, size=(2, min(n, slots)), replace=True)
    d_slots = rng.permutation(slots)[:picks.shape[1]]       # destinations never collide
    s_slots = np.arange(picks.shape[1]) if shape in ("scatter", "runs") else picks[0]
    if shape == "gather":
        d_slots = np.arange(picks.shape[1])
    if shape == "runs":          # back to back on both sides: merged into one copy
        d_slots = (slots - s_slots.size) // 2 + s_slots
    s_addr = src.data_ptr() + s_slots * seg
    d_addr = dst.data_ptr() + d_slots * seg
    plan = CopyPlan(s_addr.astype(np.uint64), d_addr.astype(np.uint64),
                    np.full(s_slots.size, seg, dtype=np.uint64))
    with _limits(path == "fused"):
        ops = copier.prepare(plan)
    if path == "fused":
        assert [op[0] for op in ops] == ["views"]
        if shape == "runs":
            assert len(ops[0][1]) == 1
    elif seg % 8 == 0 and s_slots.size > 1:
        assert {op[0] for op in ops} <= {"gather" if shape == "gather" else "scatter", "both"}
        assert len(ops) == 1             # src -> dst: one arena pair, or the span
    assert copier.launch(ops) is None
    expected = np.zeros(dst.numel(), dtype=np.uint8)
    s_np = src.numpy()
    for s_i, d_i in zip(s_slots.tolist(), d_slots.tolist(), strict=True):
        expected[d_i * seg:(d_i + 1) * seg] = s_np[s_i * seg:(s_i + 1) * seg]
    assert np.array_equal(dst.numpy(), expected)


@pytest.mark.parametrize("aligned", [True, False], ids=["span", "odd-arena"])
def test_a_gather_over_an_arena_per_layer_is_one_index_op(aligned: bool) -> None:
    """An index op per (source, destination) arena pair cost ~35 us of host work each: 1.3 ms
    for one block with an arena per layer at 32 layers (H200 host).  Over the arenas' span it
    is one op -- unless an arena starts off the plan's row (then its offsets in the span
    would not be whole rows): one op per pair, as before.  Bytes exact either way."""
    seg = 64
    layers = [torch.zeros(2, 4, seg, dtype=torch.uint8) for _ in range(8)]
    if not aligned:          # a KV tensor whose storage starts at an odd address
        layers[3] = torch.from_numpy(np.zeros(2 * 4 * seg + 1, np.uint8)[1:]).view(2, 4, seg)
    # (torch's allocations, as the KV caches' and staging's, start at multiples of 64 B)
    staging = torch.randint(0, 256, (2 * len(layers) * seg,), dtype=torch.uint8)
    copier = ByteCopier(arenas_of([*layers, staging]))
    dst = np.array([t.data_ptr() + side * 4 * seg + 2 * seg for t in layers for side in (0, 1)],
                   dtype=np.uint64)
    src = staging.data_ptr() + seg * np.arange(dst.size, dtype=np.uint64)
    with _limits(False):
        ops = copier.prepare(CopyPlan(src, dst, np.full(dst.size, seg, dtype=np.uint64)))
    assert len(ops) == (1 if aligned else len(layers))
    copier.launch(ops)
    for i, t in enumerate(layers):
        for side in (0, 1):
            k = 2 * i + side
            assert torch.equal(t[side, 2], staging[k * seg:(k + 1) * seg])
            assert not t[side, [0, 1, 3]].any()


@pytest.mark.parametrize("healthy", [True, False], ids=["kept", "dropped"])
def test_a_span_is_probed_with_a_copy_in_staging_before_any_gather(caplog, monkeypatch,
                                                                   healthy: bool) -> None:
    """The span views memory torch did not allocate, whole.  When staging is made, a copy of
    64 bytes inside it goes through the span and is read back; a span that copies wrong bytes
    there (here: its written side one row off) is dropped, loudly, and the gathers run per
    arena pair -- byte-exact."""
    layers = [torch.zeros(2, 4, 64, dtype=torch.uint8) for _ in range(3)]
    staging = torch.zeros(1024, dtype=torch.uint8)
    copier = ByteCopier(arenas_of([*layers, staging]))
    if not healthy:
        rows = copier._span.rows
        monkeypatch.setattr(copier._span, "rows",
                            lambda side, g, esz: rows(side, g, esz)[side:])
    with caplog.at_level(logging.WARNING, logger="pdpatch"):
        copier.check_span(staging)
    assert (copier._span is not None) == healthy
    assert ("gathers run one index op per arena pair" in caplog.text) != healthy
    staging[:128] = torch.arange(128, dtype=torch.uint8)
    dst = np.array([t.data_ptr() + 64 for t in layers], dtype=np.uint64)
    src = staging.data_ptr() + 32 * np.arange(3, dtype=np.uint64)
    with _limits(False):
        ops = copier.prepare(CopyPlan(src, dst, np.full(3, 32, dtype=np.uint64)))
    assert len(ops) == (1 if healthy else 3)
    copier.launch(ops)
    for i, t in enumerate(layers):
        assert torch.equal(t.flatten()[64:96], staging[32 * i: 32 * i + 32])
        assert int(t.count_nonzero()) == int(staging[32 * i: 32 * i + 32].count_nonzero())


def test_copier_sees_a_tensors_whole_storage() -> None:
    """KV tensors are strided views; the copier addresses their storage, not their shape."""
    store = torch.zeros(2, 8, 4, dtype=torch.float16)
    k_only = store[0]                                     # a view starting at the storage
    v_only = store[1]                                     # a view 64 B into the same storage
    src = _arena(64, 1)
    copier = ByteCopier(arenas_of([k_only, v_only, src]))
    assert len(copier.arenas) == 2                        # one storage, counted once
    plan = CopyPlan(np.array([src.data_ptr()], np.uint64),
                    np.array([v_only.data_ptr()], np.uint64), np.array([64], np.uint64))
    copier.run(plan)
    assert torch.equal(v_only.view(torch.uint8).flatten(), src)
    assert not k_only.any()


@pytest.mark.parametrize("path", ["views", "span", "pairs"])
def test_copier_writes_into_inference_tensors_from_any_thread(path: str) -> None:
    """vLLM's model-runner thread runs in ``torch.inference_mode()``: the KV caches, and the
    copies a staged READ prepares there, are inference tensors; the chunk driver launches them
    from its own thread, outside it (every chunked READ failed so on an H200)."""
    src = _arena(2 * 16, 3)
    with torch.inference_mode(), _limits(path == "views"):
        kv = torch.zeros(4 * 16, dtype=torch.uint8)
        copier = ByteCopier(arenas_of([kv, src]))
        if path != "span":
            copier._span = None
        # staging rows 0, 1 -> KV rows 3, 0: in-place copies (_foreach_copy_, index_copy_)
        ops = copier.prepare(CopyPlan(src.data_ptr() + np.array([0, 16], np.uint64),
                                      kv.data_ptr() + np.array([48, 0], np.uint64),
                                      np.array([16, 16], np.uint64)))
    assert {op[0] for op in ops} & ({"views"} if path == "views" else {"scatter", "both"})
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            copier.launch(ops)
        except BaseException as exc:      # surfaced below, with the thread's own error
            errors.append(exc)

    driver = threading.Thread(target=launch)
    driver.start()
    driver.join()
    assert not errors, errors
    assert torch.equal(kv[48:], src[:16]) and torch.equal(kv[:16], src[16:])
    assert not kv[16:48].any()


def test_copier_refuses_memory_it_was_not_given() -> None:
    src, dst = _arena(64, 2), torch.zeros(64, dtype=torch.uint8)
    copier = ByteCopier(arenas_of([src, dst]))
    past_the_end = CopyPlan(np.array([src.data_ptr()], np.uint64),
                            np.array([dst.data_ptr() + 32], np.uint64),
                            np.array([64], np.uint64))
    with pytest.raises(ValueError, match="lies outside the memory"):
        copier.prepare(past_the_end)
    assert not dst.any()


@settings(max_examples=100, deadline=None)
@given(slot=st.sampled_from([64, 192, 1024]), rows=st.integers(1, 48),
       lanes=st.integers(1, 3), gaps=st.booleans(), seed=st.integers(0, 2**16))
def test_a_chunked_reads_gather_prepared_once_moves_each_chunk_exactly(
        slot: int, rows: int, lanes: int, gaps: bool, seed: int) -> None:
    """A chunked READ's gather is prepared once, for all its rows (one index, uploaded once;
    a gap READ's rows, with unrequested bytes between them in the lane, a second one); each
    chunk's gather, from whichever lane it landed in, is a slice of it.  Every row lands
    where it was asked to, from its own place in its chunk's lane, and no other byte is
    written: rows of 192 B are three index rows of 64 each (the arenas' 64-byte alignment)."""
    rng = np.random.default_rng(seed)
    kv = torch.zeros(64 * slot, dtype=torch.uint8)
    per = max(rows // 3, 1)
    bounds = chunk_bounds(rows, per).tolist()
    step = slot + 64 * rng.integers(0, 3, rows) * gaps          # a row and the gap after it
    row_off = np.concatenate([np.cumsum(step[a:b]) - step[a:b]
                              for a, b in itertools.pairwise(bounds)])
    lane_bytes = per * (slot + 128)
    staging = torch.zeros(lanes * lane_bytes, dtype=torch.uint8)
    copier = ByteCopier(arenas_of([kv, staging]))
    d_slots = rng.permutation(64)[:rows]
    dst = kv.data_ptr() + d_slots.astype(np.int64) * slot
    lane_at = staging.data_ptr() + np.arange(lanes, dtype=np.int64) * lane_bytes
    with mock.patch.object(copier_module, "SPAN_MIN_ROW", 64):   # torch's CPU alignment
        scatter = copier.row_scatter(dst, slot, lane_at, lane_bytes,
                                     row_off if gaps else None)
    assert scatter is not None and scatter.per_row == slot // scatter.g
    expected = np.zeros(kv.numel(), dtype=np.uint8)
    for first, end in itertools.pairwise(bounds):
        lane = int(rng.integers(lanes))
        part = rng.integers(0, 256, lane_bytes, dtype=np.uint8)
        staging[lane * lane_bytes:(lane + 1) * lane_bytes] = torch.from_numpy(part)
        copier.launch(scatter.ops(first, end, int(lane_at[lane])))
        for r in range(first, end):
            at, d = int(row_off[r]), int(d_slots[r])
            expected[d * slot:(d + 1) * slot] = part[at: at + slot]
    assert np.array_equal(kv.numpy(), expected)


def test_a_gather_prepared_once_needs_a_span_of_whole_rows() -> None:
    """Without a span (one arena), or where the span's rows would be smaller than the
    arenas' own and than :data:`SPAN_MIN_ROW` (an arena starting at an odd address; torch's
    64-byte CPU alignment against the default 4 KiB), there is no whole-READ gather: each
    chunk is prepared on its own, as :meth:`prepare` would.  Memory the copier was not given
    is refused."""
    slot = 8192

    def arena(past: int) -> torch.Tensor:       # starting ``past`` bytes after 64 KiB
        raw = np.zeros(4 * slot + (2 << 16), np.uint8)
        at = (-raw.ctypes.data) % (1 << 16) + past
        return torch.from_numpy(raw[at: at + 4 * slot])

    staging, kv, odd = arena(0), arena(64), arena(1)
    lanes = staging.data_ptr() + np.array([0, 2 * slot], dtype=np.int64)
    alone = ByteCopier(arenas_of([staging]))
    assert alone.row_scatter(lanes + slot, slot, lanes[:1], slot) is None
    copier, off = (ByteCopier(arenas_of([t, staging])) for t in (kv, odd))
    aligned, unaligned = (t.data_ptr() + np.array([0, slot]) for t in (kv, odd))
    assert copier.row_scatter(aligned, slot, lanes, 2 * slot) is None       # 64 B rows
    with mock.patch.object(copier_module, "SPAN_MIN_ROW", 64):
        assert copier.row_scatter(aligned, slot, lanes, 2 * slot).g >= 64
        assert off.row_scatter(unaligned, slot, lanes, 2 * slot) is None
        with pytest.raises(ValueError, match="lies outside the memory"):
            copier.row_scatter(kv.data_ptr() + np.array([0, 4 * slot]), slot, lanes,
                               2 * slot)


@settings(max_examples=200, deadline=None)
@given(regions=st.integers(1, 6), blocks=st.lists(st.integers(0, 40), min_size=1, max_size=20,
                                                  unique=True),
       interleave=st.booleans(), noise=st.booleans(), seed=st.integers(0, 2**16))
def test_address_order_is_the_stable_argsort(regions: int, blocks: list[int], interleave: bool,
                                             noise: bool, seed: int) -> None:
    """vLLM-shaped requests (every region asks for the same blocks), with regions laid out
    apart or interleaved block by block (a fused peer's K and V), and arbitrary ones."""
    n_table = 41
    ids = np.concatenate([r * n_table + np.asarray(blocks) for r in range(regions)])
    if noise:
        ids = np.random.default_rng(seed).permutation(regions * n_table)[:ids.size]
    region, block = np.divmod(np.arange(regions * n_table), n_table)
    address = block * regions + region if interleave else region * n_table + block
    position = np.argsort(np.argsort(address))[ids]
    assert np.array_equal(address_order(position, ids), np.argsort(position, kind="stable"))


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 400), slot=st.sampled_from([1, 7, 128, 4096]),
       capacity_slots=st.integers(0, 100), lanes=st.integers(1, 4), shrink=st.integers(1, 32),
       share=st.integers(1, 4))
def test_chunk_schedule_covers_the_request_in_lanes_that_fit(rows: int, slot: int,
                                                             capacity_slots: int, lanes: int,
                                                             shrink: int, share: int) -> None:
    """Every size tried fits ``lanes`` times in the buffer, halves down to its floor and no
    further; the chunks tile the rows in order, at least two of them (one read while the
    other is gathered)."""
    capacity = capacity_slots * slot + (slot - 1 if slot > 1 else 0)
    sizes = lane_rows_to_try(rows, slot, capacity, lanes, shrink, share)
    room = capacity // share if capacity // share // lanes >= slot else capacity
    first = chunk_rows(rows, slot, room, lanes)
    if capacity // lanes < slot:
        assert sizes == [] and first == 0
        return
    assert sizes[0] == first and first >= 1
    assert all(lanes * n * slot <= room for n in sizes)    # 1/share of the buffer if it can
    assert all(b == a // 2 for a, b in itertools.pairwise(sizes))
    assert sizes[-1] >= max(first // shrink, 1) and sizes[-1] // 2 < max(first // shrink, 1)
    for n in sizes:
        bounds = chunk_bounds(rows, n)
        assert bounds[0] == 0 and bounds[-1] == rows
        assert np.all(np.diff(bounds) >= 1) and np.all(np.diff(bounds) <= n)
        assert np.all(np.diff(bounds)[:-1] == n)
    chunks = chunk_bounds(rows, first).size - 1
    if lanes >= 2 and rows >= 2:
        assert chunks >= 2                   # one chunk is read while another is gathered
    # the even share: a request that fits the lanes is cut evenly, not into a full lane + tail
    assert first == min(room // lanes // slot, -(-rows // lanes))


@settings(max_examples=300, deadline=None)
@given(gaps=st.lists(st.integers(0, 300), min_size=1, max_size=80),
       joinable=st.lists(st.booleans(), min_size=80, max_size=80),
       slot=st.sampled_from([1, 16, 64]), max_gap=st.integers(0, 400),
       lane_slots=st.integers(1, 12))
def test_packed_spans_read_every_row_into_lanes_it_fits(gaps: list[int], joinable: list[bool],
                                                        slot: int, max_gap: int,
                                                        lane_slots: int) -> None:
    """A chunked gap READ, simulated on bytes: each chunk reads its pieces back to back into
    a lane, and every row, gathered from its lane at ``row_off``, is the peer's row.  No
    piece or chunk exceeds a lane, a piece never joins rows its span did not, chunk edges
    fall on pieces, and pieces never outnumber the rows."""
    lane = lane_slots * slot + (slot // 2)
    start = np.cumsum(np.asarray(gaps, dtype=np.int64) + slot) - slot
    n = start.size
    join = np.asarray(joinable[:n - 1], dtype=bool)
    first, last, _ = read_spans(start, start + slot, join, max_gap, None)
    packed = pack_spans(start, slot, first, last, lane)
    peer = np.random.default_rng(n).integers(0, 256, int(start[-1]) + slot, dtype=np.uint8)
    assert packed.bounds[0] == 0 and packed.bounds[-1] == n
    assert np.all(np.diff(packed.bounds) >= 1)
    assert set(packed.bounds[:-1].tolist()) <= set(packed.first.tolist())
    assert np.all(packed.length <= lane) and packed.start.size <= n
    span_of = np.repeat(np.arange(first.size), last - first + 1)
    for c in range(packed.bounds.size - 1):
        a, b = int(packed.bounds[c]), int(packed.bounds[c + 1])
        ks = np.flatnonzero((packed.first >= a) & (packed.first < b))
        buf = np.zeros(lane, dtype=np.uint8)
        for k in ks:
            off, ln, at = int(packed.lane_off[k]), int(packed.length[k]), int(packed.start[k])
            assert off + ln <= lane
            buf[off:off + ln] = peer[at:at + ln]
            rows = np.arange(int(packed.first[k]), b if k + 1 == packed.first.size or
                             packed.first[k + 1] >= b else int(packed.first[k + 1]))
            assert np.unique(span_of[rows]).size == 1      # one span's rows only
        for r in range(a, b):
            got = buf[packed.row_off[r]:packed.row_off[r] + slot]
            assert np.array_equal(got, peer[start[r]:start[r] + slot]), (c, r)


def test_packed_spans_refuse_a_lane_smaller_than_a_row() -> None:
    with pytest.raises(ValueError, match="cannot hold a row"):
        pack_spans(np.array([0, 64]), 64, np.array([0]), np.array([1]), 63)


@settings(max_examples=300, deadline=None)
@given(joins=st.lists(st.booleans(), max_size=80), per=st.integers(1, 20))
def test_chunk_descriptors_count_runs_cut_by_chunk_edges(joins: list[bool], per: int) -> None:
    """Per chunk: the runs of joined rows inside it (a chunk edge starts a new descriptor)."""
    rows = len(joins) + 1
    bounds = chunk_bounds(rows, per)
    got = chunk_descriptors(np.asarray(joins, dtype=bool), bounds)
    for c in range(bounds.size - 1):
        a, b = int(bounds[c]), int(bounds[c + 1])
        assert got[c] == 1 + sum(not j for j in joins[a:b - 1])
    assert int(got.sum()) >= rows - sum(joins)


def test_chunk_schedule_refuses_what_it_cannot_plan() -> None:
    with pytest.raises(ValueError):
        chunk_rows(0, 8, 64, 2)
    with pytest.raises(ValueError):
        chunk_rows(4, 8, -1, 2)
    with pytest.raises(ValueError):
        chunk_bounds(4, 0)


def test_strided_rows_expand_to_one_row_per_descriptor_id() -> None:
    """vLLM 0.33+ prepare ``(addr, len, dev, stride, count)`` rows: descriptor id ``i`` is the
    ``i``-th block counted across them, which is what a READ's ids index."""
    from pdpatch.kv.staging.rows import RowTable, as_rows

    strided = np.array([[1000, 16, 0, 64, 3], [5000, 16, 0, 32, 2]], dtype=np.uint64)
    assert as_rows(strided).tolist() == [[1000, 16, 0], [1064, 16, 0], [1128, 16, 0],
                                         [5000, 16, 0], [5032, 16, 0]]
    assert as_rows([(7, 8, 1), (15, 8, 1)]).tolist() == [[7, 8, 1], [15, 8, 1]]
    table = RowTable(strided)
    assert table.length == 16 and table.contiguous_next.tolist() == [False] * 5


@pytest.mark.parametrize("eager", [True, False])
def test_an_eager_agent_builds_its_own_lists_tables_when_they_are_prepared(monkeypatch,
                                                                          eager: bool) -> None:
    """``eager`` (coalescing on, or a kvcached pool: READs will be staged): the table of the
    worker's own list is built when vLLM prepares the list at start-up, not in a peer's
    first READ (bench_first_contact, 0.25.1, 32 layers: that READ's planning 35 -> 1 ms); a
    peer's list is left to its first READ, and nothing is built when not eager.  The gather's
    CUDA kernels are loaded then too (once; 14.5 ms of the first staged READ on an H200)."""
    from pdpatch.kv.staging import StagingAgent
    from pdpatch.kv.staging import lists as lists_mod

    built: list[int] = []
    real = lists_mod.RowTable
    monkeypatch.setattr(lists_mod, "RowTable", lambda rows: built.append(len(rows)) or real(rows))
    warmed: list = []
    monkeypatch.setattr(ByteCopier, "warm", staticmethod(warmed.append))

    class KVCache:        # where the worker's KV lives: only its device is asked for
        device = torch.device("cuda", 3)

    class Agent:          # the bookkeeping calls only: nothing is transferred here
        def prep_xfer_dlist(self, agent_name, descs, *args, **kwargs):
            return (agent_name, len(descs))

    agent = StagingAgent(Agent(), mem_type="VRAM", capacity=1 << 20,
                         memory=lambda: [KVCache()], eager=eager)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(4096 * i, 4096, 0) for i in range(64)])
    agent.prep_xfer_dlist("peer", [(4096 * i, 4096, 0) for i in range(32)])
    agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(4096 * i, 4096, 0) for i in range(8)])
    assert built == ([64, 8] if eager else [])
    assert warmed == ([torch.device("cuda", 3)] if eager else [])
    agent._lists.table(local)                # the first READ's lookup builds nothing more
    assert built == [64, 8] if eager else [64]
