"""Descriptor planning that pdpatch's runtime never calls: the references and bench forms
that tests and benches compare pdpatch's runtime planning against (lab code, not in the wheel).

* :func:`coalesce` -- merge descriptor pairs whose local AND remote ranges are both contiguous
  (fused<->fused runs collapse to one descriptor per run; a split side stays per segment,
  because its K and V are apart).  Same bytes moved, fewer descriptors.  With NIXL the cost of
  a transfer is mostly per descriptor (about 2.8 µs each on an H200 over cuda_ipc, see
  research/gpu_probe.md), which is what the benches measure against.
* strided rows ``(addr, len, dev, stride, count)`` -- NIXL >= 1.5's compressed descriptor
  list (``prep_xfer_dlist`` with an Nx5 array): :func:`strided_pair_rows` compresses runs of
  equal-length, equally-spaced descriptor pairs, :func:`expand_strided` restores Nx3 and
  :func:`plan_from_nx3` pairs two Nx3 lists back into a plan.
* :func:`vllm_remote_descs` / :func:`vllm_local_descs` -- the per-peer descriptor lists of a
  patched ``_build_fa_remote`` / ``_build_fa_local`` in each release's form (tuples, Nx3, Nx5),
  built independently of :meth:`~pdpatch.kv.plan.PairPlan.local_rows`, which the tests check
  them against.
* staged transfers as whole plans (see :mod:`pdpatch.kv.staging.plans` for why staging):
  :func:`stage` routes a per-request :class:`~pdpatch.kv.plan.DescPlan` through a staging
  buffer in remote address order, :func:`stage_ids` does the same in vLLM's form (tables
  prepared once per peer, per request only descriptor ids, which NIXL merges),
  :func:`split_staged` cuts a staged transfer into pieces whose copies can overlap the rest of
  the transfer.  The runtime's form,
  :class:`pdpatch.kv.staging.StagingAgent`, is built from the same pieces of
  :mod:`pdpatch.kv.staging.plans`; the tests and the bench compare it with these.
* :func:`whole_blocks` gives the same-layout fused path its best tables: one descriptor per
  ``[K|V]`` block, so consecutive blocks are consecutive, contiguous entries that NIXL merges
  (what vLLM >= 0.26 does for its packed layout).  :func:`nixl_merged_count` predicts NIXL's
  ``descCount`` for a request.

``from lab.kv_reference import coalesce``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdpatch.kv.geometry import (
    KIND_FUSED,
    KIND_PACKED,
    ROLE_KV,
    GeometryMismatch,
    KVGeometry,
    KVPlanError,
    LayerGeometry,
    Segment,
)
from pdpatch.kv.plan import DescPlan, HeadSlice, PairPlan, as_tuples
from pdpatch.kv.staging.plans import CopyPlan, range_ids, read_spans, span_layout

_U64 = np.uint64
OPS = ("READ", "WRITE")


def coalesce(plan: DescPlan) -> DescPlan:
    """Merge pairs that are contiguous on both sides (after ordering by local address).

    Order does not matter to a NIXL transfer, so sorting is safe as long as local ranges do
    not overlap (a valid plan never writes a byte twice).
    """
    n = len(plan)
    if n <= 1:
        return plan
    order = np.argsort(plan.local_addr, kind="stable")
    la = plan.local_addr[order]
    ra = plan.remote_addr[order]
    ln = plan.length[order]
    ends_l = la[:-1] + ln[:-1]
    ends_r = ra[:-1] + ln[:-1]
    joins = (la[1:] == ends_l) & (ra[1:] == ends_r)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    region = None if plan.region is None else plan.region[order][starts]
    return DescPlan(
        la[starts], ra[starts], np.add.reduceat(ln, starts).astype(_U64),
        plan.local_dev, plan.remote_dev, region,
    )


def strided_pair_rows(plan: DescPlan) -> tuple[np.ndarray, np.ndarray]:
    """Compress a plan (in its order) into local and remote Nx5 strided rows.

    A row covers a maximal greedy run of descriptors of one region with equal length whose
    local and remote addresses both advance by a constant step of at least that length (NIXL
    1.5 refuses a row whose stride is below its length, or that leaves one registered memory
    region); both sides get the same row boundaries, so expanding them gives back the plan's
    pairs in order.
    """
    n = len(plan)
    la = plan.local_addr.astype(np.int64)
    ra = plan.remote_addr.astype(np.int64)
    ln = plan.length.astype(np.int64)
    if n == 0:
        empty = np.empty((0, 5), dtype=_U64)
        return empty, empty.copy()
    dl = np.diff(la)
    dr = np.diff(ra)
    # link k joins descriptor k and k+1
    link_ok = (ln[1:] == ln[:-1]) & (dl >= ln[:-1]) & (dr >= ln[:-1])
    if plan.region is not None:
        link_ok &= plan.region[1:] == plan.region[:-1]
    # link k continues the run of link k-1 when both are ok with the same steps
    cont = np.zeros(max(n - 1, 0), dtype=bool)
    if n > 2:
        cont[1:] = link_ok[1:] & link_ok[:-1] & (dl[1:] == dl[:-1]) & (dr[1:] == dr[:-1])
    breaks = np.flatnonzero(~cont)  # links that do not continue the previous one
    starts: list[int] = []
    counts: list[int] = []
    i = 0
    while i < n:
        if i == n - 1 or not link_ok[i]:
            starts.append(i)
            counts.append(1)
            i += 1
            continue
        # run of links i .. e-1 (same step), e = first break after i
        pos = np.searchsorted(breaks, i + 1)
        e = int(breaks[pos]) if pos < breaks.size else n - 1
        starts.append(i)
        counts.append(e - i + 1)
        i = e + 1
    s = np.asarray(starts, dtype=np.int64)
    c = np.asarray(counts, dtype=np.int64)
    step_l = np.where(c > 1, np.concatenate((dl, [0]))[s], ln[s])
    step_r = np.where(c > 1, np.concatenate((dr, [0]))[s], ln[s])
    local = np.stack([la[s], ln[s], np.full_like(s, plan.local_dev), step_l, c], axis=1)
    remote = np.stack([ra[s], ln[s], np.full_like(s, plan.remote_dev), step_r, c], axis=1)
    return local.astype(_U64), remote.astype(_U64)


def strided_rows(addr: np.ndarray, length: np.ndarray, dev: int) -> np.ndarray:
    """Nx5 strided rows for one side's descriptor list (in order)."""
    plan = DescPlan(np.asarray(addr, dtype=_U64), np.asarray(addr, dtype=_U64),
                    np.asarray(length, dtype=_U64), dev, dev)
    return strided_pair_rows(plan)[0]


def expand_strided(rows: np.ndarray) -> np.ndarray:
    """Nx5 ``(addr, len, dev, stride, count)`` rows -> Nx3 ``(addr, len, dev)`` descriptors,
    the list NIXL prepares from them."""
    rows = np.asarray(rows, dtype=_U64).reshape(-1, 5)
    counts = rows[:, 4].astype(np.int64)
    total = int(counts.sum())
    out = np.empty((total, 3), dtype=_U64)
    if total == 0:
        return out
    idx = np.repeat(np.arange(rows.shape[0]), counts)
    first = np.cumsum(counts) - counts
    within = (np.arange(total, dtype=np.int64) - np.repeat(first, counts)).astype(_U64)
    out[:, 0] = rows[idx, 0] + within * rows[idx, 3]
    out[:, 1] = rows[idx, 1]
    out[:, 2] = rows[idx, 2]
    return out


def plan_from_nx3(local: np.ndarray, remote: np.ndarray) -> DescPlan:
    """Pair two equally long Nx3 lists (e.g. expanded strided rows) back into a plan."""
    local = np.asarray(local, dtype=_U64).reshape(-1, 3)
    remote = np.asarray(remote, dtype=_U64).reshape(-1, 3)
    if local.shape != remote.shape or not np.array_equal(local[:, 1], remote[:, 1]):
        raise ValueError("local and remote descriptor lists differ in count or lengths")
    ldev = int(local[0, 2]) if local.shape[0] else 0
    rdev = int(remote[0, 2]) if remote.shape[0] else 0
    return DescPlan(local[:, 0].copy(), remote[:, 0].copy(), local[:, 1].copy(), ldev, rdev)


def vllm_remote_descs(
    local: KVGeometry,
    remote: KVGeometry,
    *,
    remote_slice: HeadSlice | None = None,
    local_slice: HeadSlice | None = None,
    block_size_ratio: int = 1,
    form: str = "nx3",
) -> np.ndarray | list[tuple[int, int, int]]:
    """The remote descriptor list a patched ``_build_fa_remote`` / ``add_remote_agent`` returns.

    Same count and order as stock: per layer one logical region per segment role (K then V;
    2·L regions for split/fused peers, L for packed), ``remote.num_blocks`` descriptors per
    region, id = ``region * num_blocks + block``.  ``form``: ``"tuples"`` (vLLM 0.19-0.25),
    ``"nx3"`` (0.26-0.32) or ``"nx5"`` (0.33+ strided rows).
    """
    pair = PairPlan(local, remote, local_slice=local_slice, remote_slice=remote_slice,
                    block_size_ratio=block_size_ratio)
    if form == "nx5":
        return pair.remote_rows()
    table = pair.remote_table()
    if form == "nx3":
        return table
    if form == "tuples":
        return as_tuples(table)
    raise ValueError(f"form must be 'tuples', 'nx3' or 'nx5', got {form!r}")


def vllm_local_descs(
    local: KVGeometry,
    *,
    block_size_ratio: int = 1,
    local_slice: HeadSlice | None = None,
    form: str = "nx3",
) -> np.ndarray | list[tuple[int, int, int]]:
    """The local descriptor list a patched ``_build_fa_local`` returns, for local memory that
    stock code cannot describe (kvcached split-half on vLLM 0.23-0.25, where stock assumes
    blocks-first ``[K|V]``).

    Desc-id order as stock: per layer one region per segment role, ``num_blocks * ratio``
    sub-blocks per region, each ``segment / ratio / parts`` bytes at slice ``index``.
    Equals :meth:`PairPlan.local_table` / :meth:`PairPlan.local_rows` of any pair with this
    local side.
    """
    sl = local_slice or HeadSlice()
    r = int(block_size_ratio)
    if r < 1:
        raise GeometryMismatch(f"block-size ratio must be a positive integer, got {r}", local)
    n_blocks = local.num_blocks
    rows: list[np.ndarray] = []
    for li, la in enumerate(local.layers):
        for seg in la.segments:
            if seg.length % (r * sl.parts):
                raise GeometryMismatch(
                    f"layer {li} segment {seg.role}: {seg.length} B is not divisible by "
                    f"block-size ratio {r} x {sl.parts} slices", local)
            chunk = seg.length // r
            n = chunk // sl.parts
            base = la.base + seg.offset + sl.index * n
            if form == "nx5" and (r == 1 or la.block_stride == r * chunk):
                rows.append(np.array([[base, n, local.device_id, la.block_stride // r,
                                       n_blocks * r]], dtype=_U64))
                continue
            blk = np.arange(n_blocks, dtype=np.int64)
            if form == "nx5":
                part = np.empty((n_blocks, 5), dtype=_U64)
                part[:, 0] = base + blk * la.block_stride
                part[:, 1] = n
                part[:, 2] = local.device_id
                part[:, 3] = chunk
                part[:, 4] = r
                rows.append(part)
                continue
            addr = (base + blk[:, None] * la.block_stride
                    + np.arange(r, dtype=np.int64)[None, :] * chunk).reshape(-1)
            dev = np.full(addr.shape, local.device_id)
            rows.append(np.stack([addr, np.full(addr.shape, n), dev], axis=1).astype(_U64))
    if form not in ("nx3", "nx5", "tuples"):
        raise ValueError(f"form must be 'tuples', 'nx3' or 'nx5', got {form!r}")
    width = 5 if form == "nx5" else 3
    out = np.concatenate(rows) if rows else np.empty((0, width), dtype=_U64)
    return as_tuples(out) if form == "tuples" else out


# ------------------------------------------------------------------ staged transfers
def merge_copies(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> CopyPlan:
    """Merge consecutive copies (in the given order) that are contiguous on both sides."""
    src = np.asarray(src, dtype=_U64).reshape(-1)
    dst = np.asarray(dst, dtype=_U64).reshape(-1)
    length = np.asarray(length, dtype=_U64).reshape(-1)
    if length.size <= 1:
        return CopyPlan(src, dst, length)
    joins = (src[1:] == src[:-1] + length[:-1]) & (dst[1:] == dst[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return CopyPlan(src[starts], dst[starts],
                    np.add.reduceat(length, starts).astype(_U64))


@dataclass(frozen=True)
class StagedPlan:
    """A staged transfer: NIXL moves ``transfer`` (local side = staging), the caller runs
    ``copies`` locally -- after the transfer for READ, before it for WRITE."""

    transfer: DescPlan
    copies: CopyPlan
    staging_bytes: int
    op: str


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def stage(plan: DescPlan, staging_base: int, *, op: str = "READ",
          staging_dev: int | None = None, staging_bytes: int | None = None,
          max_gap: int = 0, remote_ranges: Sequence[tuple[int, int]] | None = None
          ) -> StagedPlan:
    """Route ``plan`` through a staging buffer at ``staging_base`` (registered with NIXL like
    any local memory).

    Pairs are laid out in the staging buffer in remote-address order, so remote-contiguous runs
    become one descriptor each; ``copies`` move staging <-> the plan's local addresses.  A plan
    whose remote ranges overlap (a WRITE that lands twice) is refused.

    ``max_gap`` (READ only, needs the peer's registered ``remote_ranges``): also read across
    gaps of up to ``max_gap`` unrequested bytes inside one registered range, so nearby blocks
    share a descriptor.  Worth it while a gap costs less wire time than a descriptor:
    :meth:`~pdpatch.kv.staging.plans.TransportCost.gap_budget` of the measured transport (3-7 MiB
    between two processes on one H100/H200 over cuda_ipc); the gap bytes land in staging only
    and are never copied out.  Never for WRITE, which would overwrite other blocks.  When
    ``staging_bytes`` is too small for the gaps, the allowed gap is halved until it fits.
    """
    _check_op(op)
    if max_gap and op != "READ":
        raise KVPlanError("max_gap reads unrequested bytes; it is for READ only")
    if max_gap and remote_ranges is None:
        raise KVPlanError("max_gap needs the peer's registered remote_ranges")
    n = len(plan)
    ra = plan.remote_addr.astype(_U64)
    ln = plan.length.astype(_U64)
    order = np.argsort(ra, kind="stable")
    ra_o, ln_o = ra[order], ln[order]
    ends = ra_o + ln_o
    if n > 1 and bool(np.any(ra_o[1:] < ends[:-1])):
        raise KVPlanError("remote ranges of the plan overlap; staging needs disjoint ranges")
    need = int(ln_o.sum(dtype=_U64))
    if staging_bytes is not None and need > staging_bytes:
        raise KVPlanError(f"request needs {need} B of staging, only {staging_bytes} B exist")
    start_i, end_i = ra_o.astype(np.int64), ends.astype(np.int64)
    joinable = start_i[1:] == end_i[:-1]
    if max_gap and n > 1:
        rid = range_ids(start_i, end_i, remote_ranges)
        joinable |= (rid[1:] == rid[:-1]) & (rid[1:] >= 0)
    first, last, _ = read_spans(start_i, end_i, joinable, max_gap, staging_bytes)
    span_len, span_off, row_off = span_layout(start_i, end_i, first, last)
    total = int(span_len.sum())
    st = (staging_base + row_off).astype(_U64)
    dev = plan.local_dev if staging_dev is None else staging_dev
    transfer = DescPlan((staging_base + span_off).astype(_U64), ra_o[first],
                        span_len.astype(_U64), dev, plan.remote_dev)
    la_o = plan.local_addr.astype(_U64)[order]
    copies = merge_copies(st, la_o, ln_o) if op == "READ" else merge_copies(la_o, st, ln_o)
    return StagedPlan(transfer, copies, total, op)


def split_staged(staged: StagedPlan, parts: int) -> list[StagedPlan]:
    """Cut a staged transfer into up to ``parts`` pieces of about equal bytes, each with the
    copies of its own staging range, so the copy of piece ``i`` can run while NIXL still moves
    piece ``i + 1`` (READ: wait for piece i, then copy it out; WRITE: copy piece i in, then
    post it).  Copies that straddle a cut are clipped at it."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    t = staged.transfer
    n = len(t)
    if n == 0 or parts == 1:
        return [staged]
    cum = np.cumsum(t.length.astype(np.int64))
    total = int(cum[-1])
    cuts = np.searchsorted(cum, [total * (i + 1) / parts for i in range(parts - 1)],
                           side="left") + 1
    bounds = np.unique(np.concatenate(([0], np.minimum(cuts, n), [n])))
    out = []
    on_src = staged.op == "READ"  # the staging side of each copy
    c_st = (staged.copies.src if on_src else staged.copies.dst).astype(np.int64)
    c_ot = (staged.copies.dst if on_src else staged.copies.src).astype(np.int64)
    c_ln = staged.copies.length.astype(np.int64)
    for lo, hi in itertools.pairwise(bounds.tolist()):
        if hi <= lo:
            continue
        piece = DescPlan(t.local_addr[lo:hi], t.remote_addr[lo:hi], t.length[lo:hi],
                         t.local_dev, t.remote_dev)
        gs = int(t.local_addr[lo])
        ge = int(t.local_addr[hi - 1]) + int(t.length[hi - 1])
        start = np.maximum(c_st, gs)
        end = np.minimum(c_st + c_ln, ge)
        keep = end > start
        st_a = start[keep]
        ot_a = c_ot[keep] + (st_a - c_st[keep])
        ln_a = (end - start)[keep]
        src, dst = (st_a, ot_a) if on_src else (ot_a, st_a)
        out.append(StagedPlan(piece, CopyPlan(src.astype(_U64), dst.astype(_U64),
                                              ln_a.astype(_U64)),
                              int(piece.length.sum(dtype=_U64)), staged.op))
    return out


@dataclass(frozen=True)
class StagedIds:
    """Per-request ids for ``make_prepped_xfer(op, staging, staging_ids, remote, remote_ids)``
    and the local copies (see :class:`StagedPlan` for when to run them)."""

    staging_ids: np.ndarray
    remote_ids: np.ndarray
    copies: CopyPlan
    op: str


def stage_ids(local_table: np.ndarray, remote_table: np.ndarray, local_ids: np.ndarray,
              remote_ids: np.ndarray, staging_base: int, slot_len: int, num_slots: int, *,
              op: str = "READ") -> StagedIds:
    """Staged form of a request given as desc ids into vLLM-style Nx3 tables.

    Every selected descriptor must be ``slot_len`` bytes (one K or V segment, or a head slice
    of it).  Staging slot ``i`` receives the ``i``-th pair in remote-address order, so NIXL
    merges remote-contiguous runs (the staging side is always contiguous).
    """
    _check_op(op)
    lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if lid.size != rid.size:
        raise KVPlanError(f"{lid.size} local ids vs {rid.size} remote ids")
    if lid.size > num_slots:
        raise KVPlanError(f"request has {lid.size} descriptors, staging has {num_slots} slots")
    if lid.size == 0:
        empty = np.empty(0, dtype=_U64)
        return StagedIds(np.empty(0, dtype=np.int64), rid, CopyPlan(empty, empty, empty), op)
    lens = remote_table[rid, 1]
    if not (np.all(lens == slot_len) and np.all(local_table[lid, 1] == slot_len)):
        raise KVPlanError(f"staging slots are {slot_len} B but the request's descriptors are "
                          f"{sorted(set(lens.tolist()))} B")
    order = np.argsort(remote_table[rid, 0], kind="stable")
    slots = np.arange(lid.size, dtype=np.int64)
    st = (np.uint64(staging_base) + slots.astype(_U64) * np.uint64(slot_len)).astype(_U64)
    la = local_table[lid[order], 0].astype(_U64)
    ln = np.full(lid.size, slot_len, dtype=_U64)
    copies = merge_copies(st, la, ln) if op == "READ" else merge_copies(la, st, ln)
    return StagedIds(slots, rid[order], copies, op)


def whole_blocks(geo: KVGeometry) -> KVGeometry:
    """The same memory described as one ``[K|V]`` segment per block (fused and packed layers).

    For the same-layout fused path only (no head slicing: a whole block is not a head slice):
    its tables then have one entry per block, consecutive blocks being consecutive, contiguous
    entries.  A split layer has no whole-block range and is refused.
    """
    layers = []
    for li, la in enumerate(geo.layers):
        if la.kind == KIND_PACKED:
            layers.append(la)
            continue
        if la.kind != KIND_FUSED:
            raise KVPlanError(f"layer {li} is {la.kind}: K and V are not one range per block")
        k, v = la.segments
        layers.append(LayerGeometry(la.base + k.offset, la.block_stride, la.num_blocks,
                                    (Segment(ROLE_KV, 0, k.length + v.length),),
                                    capacity=la.capacity))
    return KVGeometry(tuple(layers), geo.device_id, geo.label)


def nixl_merged_count(local_table: np.ndarray, remote_table: np.ndarray,
                      local_ids: np.ndarray, remote_ids: np.ndarray) -> int:
    """The ``descCount`` NIXL will post for a request over prepared Nx3 tables: a pair joins
    the previous one when both ids are the previous ids + 1 and both ranges continue the
    previous ranges in memory (inside one registration: NIXL does not join two).  For a
    per-request list (ids ``0..n-1``) this is the number of both-side-contiguous runs,
    :func:`merge_copies`."""
    lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    if lid.size <= 1:
        return int(lid.size)
    la = local_table[lid, 0].astype(np.int64)
    ra = remote_table[rid, 0].astype(np.int64)
    ln = local_table[lid, 1].astype(np.int64)
    joins = ((lid[1:] == lid[:-1] + 1) & (rid[1:] == rid[:-1] + 1)
             & (la[1:] == la[:-1] + ln[:-1]) & (ra[1:] == ra[:-1] + ln[:-1]))
    return int(lid.size - int(joins.sum()))
