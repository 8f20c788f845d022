"""Staged K/V conversion: as few NIXL descriptors as the REMOTE layout allows, plus one local copy.

Why: with NIXL the cost of a transfer is mostly per descriptor (about 2.8 µs each on an H200 over
cuda_ipc, research/gpu_probe.md), and NIXL merges consecutive descriptor pairs only when they are
contiguous on BOTH sides (measured: ``make_prepped_xfer`` merges such pairs, ``descCount`` drops
to one per run).  A split<->fused conversion pairs a contiguous run on one side with a strided
run on the other, so nothing merges: a run of 16 blocks costs 32 descriptors per layer instead of
one.  NIXL >= 1.5 strided rows ``(addr, len, dev, stride, count)`` do not help at transfer time:
NIXL expands them back into one descriptor per element (measured: ``descCount`` equals the
element count for a strided local row).

Staging moves the layout change out of NIXL.  The local side of the transfer becomes a staging
buffer laid out in REMOTE address order, so every run that is contiguous on the remote side is
one descriptor, whatever the local layout; one local gather/scatter (a device copy at memory
bandwidth) then moves the bytes into (READ) or out of (WRITE) the local KV layout.  The number of
descriptors equals what the same-layout path needs whenever the remote side is fused (fused
remote -> split local), and drops from one per block-segment to one per run and segment pool
when the remote side is split.

Two forms, the same semantics:

* :func:`stage` -- address level, from a :class:`~pdpatch.kv.plan.DescPlan` (per-request
  descriptor lists);
* :func:`stage_ids` -- vLLM's form: tables prepared once per peer (the stock remote table and a
  :func:`staging_table` of equal slots), per request only descriptor ids, which NIXL merges.

:func:`merge_order` is the same-layout counterpart: it orders desc ids by local address so
NIXL merges runs that are contiguous on both sides (the fused path).

Pure module: numpy only.  The copy itself is the caller's (a device kernel or host memmove) and
is described by a :class:`CopyPlan`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdpatch.kv.geometry import KVPlanError
from pdpatch.kv.plan import DescPlan

_U64 = np.uint64
OPS = ("READ", "WRITE")


@dataclass(frozen=True)
class CopyPlan:
    """Local copies: ``length[i]`` bytes from ``src[i]`` to ``dst[i]`` (addresses)."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.length.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum(dtype=_U64))

    def chunks(self, max_bytes: int) -> CopyPlan:
        """The same copies cut into pieces of at most ``max_bytes`` (in order), so a kernel can
        give every piece one thread block however long the merged runs are."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        n = len(self)
        if n == 0:
            return self
        ln = self.length.astype(np.int64)
        pieces = np.maximum((ln + max_bytes - 1) // max_bytes, 1)
        if int(pieces.max()) == 1:
            return self
        idx = np.repeat(np.arange(n), pieces)
        first = np.cumsum(pieces) - pieces
        k = np.arange(idx.size, dtype=np.int64) - np.repeat(first, pieces)
        off = k * max_bytes
        length = np.minimum(ln[idx] - off, max_bytes)
        return CopyPlan(
            (self.src.astype(np.int64)[idx] + off).astype(_U64),
            (self.dst.astype(np.int64)[idx] + off).astype(_U64),
            length.astype(_U64),
        )


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
          staging_dev: int | None = None, staging_bytes: int | None = None) -> StagedPlan:
    """Route ``plan`` through a staging buffer at ``staging_base`` (registered with NIXL like
    any local memory).

    Pairs are laid out in the staging buffer in remote-address order, so remote-contiguous runs
    become one descriptor each; ``copies`` move staging <-> the plan's local addresses.  A plan
    whose remote ranges overlap (a WRITE that lands twice) is refused.
    """
    _check_op(op)
    n = len(plan)
    ra = plan.remote_addr.astype(_U64)
    ln = plan.length.astype(_U64)
    order = np.argsort(ra, kind="stable")
    ra_o, ln_o = ra[order], ln[order]
    if n > 1 and bool(np.any(ra_o[1:] < ra_o[:-1] + ln_o[:-1])):
        raise KVPlanError("remote ranges of the plan overlap; staging needs disjoint ranges")
    offs = np.concatenate(([0], np.cumsum(ln_o[:-1], dtype=_U64))).astype(_U64) if n else ln_o
    need = int(ln_o.sum(dtype=_U64))
    if staging_bytes is not None and need > staging_bytes:
        raise KVPlanError(f"request needs {need} B of staging, only {staging_bytes} B exist")
    st = (np.uint64(staging_base) + offs).astype(_U64)
    dev = plan.local_dev if staging_dev is None else staging_dev
    # staging is contiguous, so pairs merge exactly where the remote side is contiguous
    transfer = _merge_pairs(st, ra_o, ln_o, dev, plan.remote_dev)
    la_o = plan.local_addr.astype(_U64)[order]
    copies = merge_copies(st, la_o, ln_o) if op == "READ" else merge_copies(la_o, st, ln_o)
    return StagedPlan(transfer, copies, need, op)


def _merge_pairs(la: np.ndarray, ra: np.ndarray, ln: np.ndarray, ldev: int,
                 rdev: int) -> DescPlan:
    merged = merge_copies(la, ra, ln)  # same rule: contiguous on both sides, in order
    return DescPlan(merged.src, merged.dst, merged.length, ldev, rdev)


# ------------------------------------------------------------------ vLLM form: tables + ids
def staging_table(staging_base: int, slot_len: int, num_slots: int, dev: int = 0) -> np.ndarray:
    """Nx3 descriptors of ``num_slots`` equal, back-to-back staging slots (prepared once)."""
    out = np.empty((num_slots, 3), dtype=_U64)
    out[:, 0] = staging_base + np.arange(num_slots, dtype=np.int64) * slot_len
    out[:, 1] = slot_len
    out[:, 2] = dev
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


def merge_order(local_table: np.ndarray, remote_table: np.ndarray, local_ids: np.ndarray,
                remote_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same pairs ordered by local address, so NIXL's ``make_prepped_xfer`` merges every
    run that is contiguous on both sides (fused<->fused runs become one descriptor per run and
    layer; vLLM's region-major id order never merges K|V of a fused block)."""
    lid = np.asarray(local_ids, dtype=np.int64).reshape(-1)
    rid = np.asarray(remote_ids, dtype=np.int64).reshape(-1)
    order = np.argsort(local_table[lid, 0], kind="stable")
    return lid[order], rid[order]


def nixl_merged_count(local_addr: np.ndarray, remote_addr: np.ndarray,
                      length: np.ndarray) -> int:
    """How many descriptors NIXL will post for these pairs in this order (its merge rule:
    consecutive pairs contiguous on both sides) -- to log or check ``descCount``."""
    return len(merge_copies(local_addr, remote_addr, length))
