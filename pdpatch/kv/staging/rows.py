"""Descriptor rows as arrays, and the pure address-order helpers a staged READ is planned with
(numpy only)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Spans:
    """A gap READ: its spans of the peer's memory, and where each requested row lands."""

    start: np.ndarray          # remote address of each span
    length: np.ndarray
    span_off: np.ndarray       # each span's offset in staging (back to back)
    offset: np.ndarray         # each row's offset in staging (rows in address order)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @property
    def posted(self) -> int:
        """The descriptors counted for this READ, one per span: an upper bound of NIXL's
        ``descCount``.  Two spans touch only across read ranges, and NIXL merges them when
        one registration holds both (measured: yes for a peer that registered both ranges
        as one region, no for two regions)."""
        return int(self.start.size)


class RowTable:
    """A prepared list's rows as arrays, built once on first use (vLLM keeps lists of
    tuples; turning 10^5 of them into addresses per request would cost more than NIXL)."""

    __slots__ = ("addr", "contiguous_next", "dev", "length")

    def __init__(self, rows: Any) -> None:
        self.addr, lens, self.dev = row_columns(rows)
        # one length per list, or None (then no staging: slots are of one size)
        self.length = int(lens[0]) if lens.size and bool(np.all(lens == lens[0])) else None
        # row i ends where row i + 1 starts: NIXL can merge them when both are requested
        self.contiguous_next = np.append(self.addr[1:] == self.addr[:-1] + lens[:-1], False)


@dataclass(frozen=True)
class SortedTwin:
    """A peer's whole list prepared once more in address order, for READs of many runs.

    Why: NIXL merges two descriptors of a READ only when they follow each other in the
    prepared list (tests/test_nixl_transfer.py), and vLLM lists a peer's rows by layer, then
    K or V, then block.  A READ of few runs posts lists of its own runs instead
    (:class:`Spans`); one of a run per row (head slices) would prepare as many rows per READ
    as it posts, so it takes ids into this twin, prepared at the first such READ (~150 ms
    per 500k rows) rather than at the peer's first contact."""

    handle: Any
    position: np.ndarray       # row id in vLLM's list -> row id in the twin


@dataclass
class StagedPeer:
    """A peer whose READs are staged: its list's rows (vLLM's order), the ranges one
    descriptor may cover (None: unknown, so only NIXL may merge rows, through the twin), its
    gap budget once known, and its twin once a READ needed it."""

    name: str
    agent_name: Any
    table: RowTable
    ranges: list[tuple[int, int]] | None
    gap: int | None = None
    twin: SortedTwin | None = None
    twin_failure: str | None = None


def address_order(key: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` (``key``: the rows' addresses), cheaper for the
    requests vLLM builds.

    Why: sorting a request's 10^4-10^5 rows costs more host time than NIXL spends on the
    descriptors staging saves (6 ms for 65 536 rows on an H200 host).  vLLM's ids are
    region-major -- every layer's K (and V) region asks for the same blocks -- so the rows
    come in chunks that are translates of the first one.  Sorting the first chunk once and
    applying that order to every chunk leaves sorted runs, which a stable sort (timsort)
    merges in O(n log chunks).  The chunking is only a hint: the final sort is exact for any
    input."""
    n = ids.size
    chunk = _period(ids)
    if chunk >= n:
        return np.argsort(key, kind="stable")
    first = np.argsort(key[:chunk], kind="stable")
    hint = (np.arange(0, n, chunk, dtype=np.int64)[:, None] + first[None, :]).reshape(-1)
    return hint[np.argsort(key[hint], kind="stable")]


def _period(ids: np.ndarray) -> int:
    """The shortest chunk length whose chunks are the first chunk shifted by a constant
    (``ids.size`` when there is none)."""
    n = ids.size
    for chunk in _divisors(n):
        if chunk == n:
            break
        step = ids[chunk] - ids[0]
        if ids[n - 1] - ids[n - 1 - chunk] != step:       # cheap test before the full one
            continue
        if bool(np.all(ids[chunk:] - ids[:-chunk] == step)):
            return chunk
    return n


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


STRIDED_COLUMNS = 5
"""vLLM 0.33+ prepare lists of strided rows ``(addr, len, dev, stride, count)``: ``count``
descriptors ``addr + i * stride``, one id each (``_build_fa_local`` / ``_build_fa_remote``)."""


def as_rows(rows: Any) -> np.ndarray:
    """vLLM's list of ``(addr, len, dev)`` tuples, an Nx3 array, or 0.33+'s Nx5 strided rows
    (expanded: row ``i`` is descriptor id ``i``), as an Nx3+ int64 array."""
    arr = np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), dtype=np.int64)
    if not arr.size:
        return np.zeros((0, 3), np.int64)
    arr = arr.reshape(-1, arr.shape[-1])
    if arr.shape[1] != STRIDED_COLUMNS:
        return arr
    counts = arr[:, 4]
    first = np.repeat(np.cumsum(counts) - counts, counts)
    index = np.arange(int(counts.sum()), dtype=np.int64) - first
    addr = np.repeat(arr[:, 0], counts) + index * np.repeat(arr[:, 3], counts)
    return np.column_stack([addr, np.repeat(arr[:, 1], counts), np.repeat(arr[:, 2], counts)])


def row_columns(rows: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """``(addresses, lengths, device id of the first row)`` of :func:`as_rows`'s rows.

    Why not ``as_rows`` alone: up to vLLM 0.32 a list is a Python list of ``(addr, len, dev)``
    tuples, 10^5-10^6 of them per peer, and ``np.asarray`` of it (a whole Nx3 array, every
    element converted) held up a peer's first READ for ~90 ms per 500k rows; pulling the two
    columns a table uses with ``np.fromiter`` costs a third of that."""
    if isinstance(rows, list) and rows and isinstance(rows[0], tuple) and len(rows[0]) == 3:
        n = len(rows)
        addr = np.fromiter(map(itemgetter(0), rows), dtype=np.int64, count=n)
        lens = np.fromiter(map(itemgetter(1), rows), dtype=np.int64, count=n)
        return addr, lens, int(rows[0][2])
    arr = as_rows(rows)
    return arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64), \
        int(arr[0, 2]) if arr.size else 0


def posted_descriptors(lid: np.ndarray, rid: np.ndarray, ltab: RowTable, rtab: RowTable) -> int:
    """NIXL's ``descCount`` for ids into two lists: a pair joins the previous one when both
    ids follow the previous ones and both rows continue them in memory."""
    joins = ((lid[1:] == lid[:-1] + 1) & (rid[1:] == rid[:-1] + 1)
             & ltab.contiguous_next[lid[:-1]] & rtab.contiguous_next[rid[:-1]])
    return int(lid.size - np.count_nonzero(joins))
