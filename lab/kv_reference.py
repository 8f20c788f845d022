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

Imported with ``lab/`` on ``sys.path``: ``from kv_reference import coalesce``.
"""

from __future__ import annotations

import numpy as np

from pdpatch.kv.geometry import GeometryMismatch, KVGeometry
from pdpatch.kv.plan import DescPlan, HeadSlice, PairPlan, as_tuples

_U64 = np.uint64


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
    ``"nx3"`` (0.26-0.32) or ``"nx5"`` (0.33 strided rows).
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
