"""Copies and space inside known memory, for a staged READ's gather: a first-fit allocator of
the staging buffer and a copier that runs thousands of equal segments as one torch index
kernel over all the memory it was given."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdpatch.kv.staging.plans import CopyPlan
from pdpatch.log import logger

FUSED_MAX_COPIES = 256
"""Where the arenas have no span of rows (:class:`_Span`), a gather of at most this many
copies (once neighbours are merged) runs as one
``torch._foreach_copy_`` over a view of each copy: a fused kernel and ~4 us of host work per
copy.  The index path costs a kernel and ~30-40 us of host work per (source, destination)
arena pair, whatever the bytes: one block at 8B geometry (32 layers, an arena each) took 1.3
ms to plan on an H200 host -- more than vLLM's own READ of that block.  On the CPU machine
the two paths' host work meets at ~256 copies at 32 layers (``python -m scripts.bench_gather``:
0.35 vs 1.35 ms at 64 copies, 0.94 vs 0.86 at 256, 3.4 vs 0.93 at 1,024), at ~600 at 80 layers
(``--layers 80``): the index path's cost follows the arena pairs.  Over the span there is one
pair, and one index op costs less than the fused copy of even a few copies (0.14 vs 0.56 ms
at 64 copies, 0.18 vs 1.1 at 160; ``bench_gather``'s ``span`` column)."""

SPAN_MIN_ROW = 4096
"""The span's rows may be smaller than the arenas' (an arena starting off a row of the span)
down to this many bytes: the index costs per row, and a 128 MiB gather is 32k such rows.
CUDA's caching allocator starts allocations at 512 B multiples, and KV caches' large ones at
2 MiB; torch's CPU allocator at 64 B, so on CPU the span is taken only for small rows."""


class ByteAllocator:
    """First-fit ranges of one buffer; each range starts at a multiple of its ``align``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)] if size > 0 else []

    @property
    def free_bytes(self) -> int:
        return sum(e - s for s, e in self._free)

    def alloc(self, nbytes: int, align: int) -> int | None:
        if nbytes <= 0 or align <= 0:
            raise ValueError(f"nbytes and align must be > 0, got {nbytes}, {align}")
        for i, (s, e) in enumerate(self._free):
            start = -(-s // align) * align
            if start + nbytes <= e:
                rest = [r for r in ((s, start), (start + nbytes, e)) if r[1] > r[0]]
                self._free[i:i + 1] = rest
                return start
        return None

    def free(self, start: int, nbytes: int) -> None:
        end = start + nbytes
        i = bisect.bisect_left(self._free, (start, end))
        if (i > 0 and self._free[i - 1][1] > start) or \
                (i < len(self._free) and self._free[i][0] < end):
            raise ValueError(f"range {start}+{nbytes} is already free")
        if i < len(self._free) and self._free[i][0] == end:
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))


def arenas_of(tensors: Iterable[Any]) -> list[tuple[int, Any]]:
    """``(base address, flat uint8 tensor)`` over the storage of each tensor (once each): the
    memory a :class:`ByteCopier` may read and write, whatever the tensors' shapes."""
    import torch

    arenas: dict[int, Any] = {}
    for t in tensors:
        storage = t.untyped_storage()
        base = int(storage.data_ptr())
        if base not in arenas:
            arenas[base] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    return list(arenas.items())


class ByteCopier:
    """Runs a :class:`CopyPlan` inside known arenas with torch index kernels, on CPU and GPU.

    Why rows: the copies of a staged READ are thousands of equal segments; one
    ``index_copy_`` per (source, destination) arena moves them all where a loop would launch
    one copy each.  The row is the largest power of two (up to 64 KiB) dividing every length
    and offset, so no byte outside a copy is written; rows of 8-byte words when it allows.
    When one side's rows are consecutive (the staging side of a READ usually is) that side is
    a plain slice and no temporary is made.  A gather of few copies
    (:data:`FUSED_MAX_COPIES`) is one fused copy of views instead: with an arena per layer,
    its index ops would cost more than its bytes.  On CUDA the copies run on the copier's own
    non-blocking stream: not behind the model's kernels, and not on the legacy stream that
    waits for NIXL's copies in flight.
    """

    name = "torch-index"

    def __init__(self, arenas: Sequence[tuple[int, Any]]) -> None:
        import torch

        self.arenas = sorted(((int(b), t) for b, t in arenas), key=lambda a: a[0])
        self.bases = np.array([a[0] for a in self.arenas], dtype=np.int64)
        self.ends = self.bases + np.array([t.numel() for _, t in self.arenas], dtype=np.int64)
        devices = {t.device for _, t in self.arenas}
        if len(devices) != 1:
            raise ValueError(f"arenas must share one device, got {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._stream = (torch.cuda.Stream(self.device, priority=0)
                        if self.device.type == "cuda" else None)
        self._words: dict[tuple[int, int], Any] = {}    # (arena, word bytes) -> 1-D view
        self._span = _Span.over(self.bases, self.ends, self.device)

    @staticmethod
    def warm(device: Any) -> None:
        """Launch each kernel a gather may use once, on a few bytes of ``device``."""
        import torch

        for dtype in (torch.int64, torch.uint8):
            words = torch.zeros(4, dtype=dtype, device=device)
            torch._foreach_copy_([words[:1]], [words[1:2]])
            words[2:].index_copy_(0, torch.zeros(1, dtype=torch.int64, device=device),
                                  words[:1])
            torch.index_select(words, 0, torch.zeros(1, dtype=torch.int64, device=device))
        torch.cuda.synchronize(device)

    def check_span(self, scratch: Any) -> None:
        """Copy up to 64 bytes within ``scratch`` (a byte tensor of this copier's memory that
        holds nothing yet: the staging buffer when made) through the span, and read them back.
        A span that fails it is dropped, with a warning: gathers then run per arena pair.
        Why: the span is memory torch did not allocate, viewed whole; this is where a device
        or a torch that will not view it so says it, before any KV byte is at stake."""
        if self._span is None:
            return
        import torch

        n = min(64, scratch.numel() // 2)
        try:
            pattern = torch.arange(1, n + 1, dtype=torch.uint8, device=scratch.device)
            scratch[:n].copy_(pattern)
            scratch[n: 2 * n].zero_()
            if scratch.device.type == "cuda":
                torch.cuda.synchronize(scratch.device)    # the copier's stream waits for none
            self.locate(np.array([scratch.data_ptr()]), np.array([2 * n]))
            at = scratch.data_ptr() - self._span.base
            self.launch([("scatter", self._span.rows(0, 1, 1)[at: at + n],
                          self._span.rows(1, 1, 1), self._index(np.arange(at + n, at + 2 * n)))])
            got = scratch[n: 2 * n].clone()
            if not torch.equal(got, pattern):
                raise RuntimeError(f"the probe copy read back {got[:8].tolist()}..., not "
                                   f"{pattern[:8].tolist()}...")
        except Exception as exc:
            logger.warning("pdpatch kv_segments: a copy over the span of the KV memory and "
                           "staging failed (%s: %s); gathers run one index op per arena pair",
                           type(exc).__name__, exc)
            self._span = None

    def locate(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """The arena of each range; ValueError names the first one no arena holds."""
        first = int(np.searchsorted(self.bases, int(addr.min()), side="right")) - 1
        if first >= 0 and int((addr + length).max()) <= int(self.ends[first]):
            return np.full(addr.size, first, dtype=np.int64)   # all in one (staging's side)
        i = np.searchsorted(self.bases, addr, side="right") - 1
        ok = (i >= 0) & (addr + length <= self.ends[np.maximum(i, 0)])
        if not bool(np.all(ok)):
            bad = int(np.flatnonzero(~ok)[0])
            raise ValueError(f"copy of {int(length[bad])} B at {int(addr[bad]):#x} lies outside "
                             "the memory this copier was given")
        return i

    def prepare(self, plan: CopyPlan) -> list[tuple]:
        """The copies as ops :meth:`launch` runs: host work that needs no bytes yet, so a READ
        can do it while NIXL still moves them.  One index op over the arenas' span
        (:class:`_Span`) where their starts allow rows of the plan's size; else few copies as
        one fused copy of views, more as an index op per (source, destination) arena pair."""
        if len(plan) == 0:
            return []
        placed = sa, da, s_off, d_off, ln, g = self._placed(plan.merged())
        span = self._span
        if span is not None:
            s_at, d_at = s_off + span.shift[sa], d_off + span.shift[da]
            row = _row_bytes(s_at, d_at, ln)
            if row >= min(g, SPAN_MIN_ROW):
                return self._row_ops(s_at, d_at, ln, row, np.zeros(ln.size, dtype=np.int64),
                                     lambda key, esz: (span.rows(0, row, esz),
                                                       span.rows(1, row, esz)))
        if ln.size <= FUSED_MAX_COPIES:
            return [self._views(placed)]
        n = len(self.arenas)
        return self._row_ops(s_off, d_off, ln, g, sa * n + da,
                             lambda key, esz: (self._rows(key // n, g, esz),
                                               self._rows(key % n, g, esz)))

    def row_scatter(self, dst: np.ndarray, length: int, sources: np.ndarray,
                    source_bytes: int, src_off: np.ndarray | None = None
                    ) -> RowScatter | None:
        """The gather of ``length``-byte rows into ``dst`` (their addresses, in order) from
        any of ``sources`` (``source_bytes`` each: a chunked READ's lanes), where each part's
        rows lie back to back from its source's start or, given ``src_off``, at those offsets
        from it (a gap READ's rows, with the bytes between them), prepared once for all of
        them (:class:`RowScatter`).  None without a span, or where its rows would be shorter
        than :meth:`prepare` would take over the span: each part is then prepared on its own."""
        span = self._span
        if span is None or dst.size == 0:
            return None
        d_arena = self.locate(dst, np.full(dst.size, length, dtype=np.int64))
        s_arena = self.locate(sources, np.full(sources.size, source_bytes, dtype=np.int64))
        sizes = np.array([length, source_bytes]) if src_off is None else \
            np.concatenate([[length, source_bytes], src_off])
        d_at = dst - span.base
        g = _row_bytes(sources - span.base, d_at, sizes)
        own = _row_bytes(sources - self.bases[s_arena], dst - self.bases[d_arena], sizes)
        if g < min(own, SPAN_MIN_ROW):
            return None
        esz, per_row = (8 if g % 8 == 0 else 1), length // g

        def rows(at: np.ndarray) -> np.ndarray:
            at = at // g
            return at if per_row == 1 else \
                (at[:, None] + np.arange(per_row, dtype=np.int64)).reshape(-1)
        return RowScatter(span.rows(0, g, esz), span.rows(1, g, esz), self._index(rows(d_at)),
                          span.base, g, per_row,
                          None if src_off is None else self._index(rows(src_off)))

    def _row_ops(self, s_off: np.ndarray, d_off: np.ndarray, ln: np.ndarray, g: int,
                 keys: np.ndarray, views: Any) -> list[tuple]:
        """Index ops moving rows of ``g`` bytes, one per key (a pair of row views,
        ``views(key, element size)``)."""
        esz = 8 if g % 8 == 0 else 1
        rows = ln // g
        src_rows, dst_rows = s_off // g, d_off // g
        if int(rows.max()) > 1:      # copies of several rows each: one index per row
            within = np.arange(int(rows.sum()), dtype=np.int64) - np.repeat(
                np.cumsum(rows) - rows, rows)
            src_rows = np.repeat(src_rows, rows) + within
            dst_rows = np.repeat(dst_rows, rows) + within
            keys = np.repeat(keys, rows)
        ops = []
        present = np.flatnonzero(np.bincount(keys))    # (a sort, as np.unique, costs ~1 ms)
        for key in present.tolist():
            sel = keys == key if present.size > 1 else slice(None)
            s_r, d_r = src_rows[sel], dst_rows[sel]
            s2, d2 = views(key, esz)
            if _consecutive(s_r):
                ops.append(("scatter", s2[s_r[0]: s_r[0] + s_r.size], d2, self._index(d_r)))
            elif _consecutive(d_r):
                ops.append(("gather", s2, d2[d_r[0]: d_r[0] + d_r.size], self._index(s_r)))
            else:
                ops.append(("both", s2, d2, (self._index(s_r), self._index(d_r))))
        return ops

    def _placed(self, plan: CopyPlan) -> tuple:
        """Each copy's source and destination arena and offsets in them, its length, and the
        largest power of two (up to 64 KiB) dividing every offset and length."""
        src, dst, ln = (np.asarray(a, dtype=np.int64) for a in (plan.src, plan.dst,
                                                               plan.length))
        sa, da = self.locate(src, ln), self.locate(dst, ln)
        s_off, d_off = src - self.bases[sa], dst - self.bases[da]
        return sa, da, s_off, d_off, ln, _row_bytes(s_off, d_off, ln)

    def _views(self, placed: tuple) -> tuple:
        """One op copying each of the :meth:`_placed` copies as a view of its arena (in
        8-byte words when every offset and length allows)."""
        sa, da, s_off, d_off, ln, g = placed
        word = 8 if g % 8 == 0 else 1
        n = ln // word
        return ("views", self._side(sa, s_off // word, n, word),
                self._side(da, d_off // word, n, word), None)

    def _side(self, arena: np.ndarray, off: np.ndarray, n: np.ndarray, word: int) -> list:
        """Views of one side's copies: one ``split`` where they lie back to back in one arena
        (staging's side of a gather: ~1 us a view), else a slice each (~2.5 us)."""
        sizes = n.tolist()
        if bool(np.all(arena == arena[0])) and bool(np.all(off[1:] == off[:-1] + n[:-1])):
            first = int(off[0])
            return list(self._flat(int(arena[0]), word)[first: first + sum(sizes)].split(sizes))
        arenas = arena.tolist()
        flat = {a: self._flat(a, word) for a in set(arenas)}
        return [flat[a][o: o + k] for a, o, k in zip(arenas, off.tolist(), sizes, strict=True)]

    def _flat(self, arena: int, word: int) -> Any:
        """The arena as a 1-D tensor of ``word``-byte elements (its whole words)."""
        import torch

        view = self._words.get((arena, word))
        if view is None:
            flat = self.arenas[arena][1]
            view = flat[: flat.numel() // word * word].view(
                torch.int64 if word == 8 else torch.uint8)
            self._words[(arena, word)] = view
        return view

    def _rows(self, arena: int, g: int, esz: int) -> Any:
        """The arena as rows of ``g`` bytes, of ``esz``-byte elements (its whole rows)."""
        per_row = g // esz
        return self._flat(arena, esz)[: self.arenas[arena][1].numel() // g * per_row].view(
            -1, per_row)

    def _index(self, rows: np.ndarray) -> Any:
        """The rows as an index tensor, uploaded on the copier's own stream: the kernels that
        read it run there, and stream order is what makes them wait for the upload.  Uploaded
        on the calling thread's stream instead, the index reached the GPU behind the model's
        kernels while the copy stream read it already (an H200 run under load: "index_copy_():
        index out of bounds", a device-side assert that killed the engine)."""
        import torch

        host = torch.from_numpy(rows)
        if self._stream is None:
            return host.to(self.device)
        with torch.cuda.stream(self._stream):
            return host.to(self.device, non_blocking=True)

    def launch(self, ops: list[tuple], sync: bool = True) -> Any:
        """Run prepared copies.  ``sync=False`` on CUDA returns an event to poll; the caller
        keeps ``ops`` alive until it has completed (their index tensors are in use).

        Under ``torch.inference_mode()``: vLLM allocates its KV caches inside inference mode,
        and torch refuses an in-place write to such a tensor outside it -- which is where the
        chunk driver's thread runs (a GPU run failed every chunked READ with "Inplace update to
        inference tensor outside InferenceMode")."""
        import torch

        if not ops:
            return None
        with torch.inference_mode(), \
                torch.cuda.stream(self._stream) if self._stream is not None else _nothing():
            for kind, src, dst, idx in ops:
                if kind == "views":
                    torch._foreach_copy_(dst, src)
                elif kind == "scatter":
                    dst.index_copy_(0, idx, src)
                elif kind == "gather":
                    torch.index_select(src, 0, idx, out=dst)
                else:
                    dst.index_copy_(0, idx[1], src.index_select(0, idx[0]))
            if self._stream is None:
                return None
            event = torch.cuda.Event()
            event.record(self._stream)
        if sync:
            event.synchronize()
            return None
        return event

    def run(self, plan: CopyPlan, sync: bool = True) -> Any:
        return self.launch(self.prepare(plan), sync)

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()


@dataclass(frozen=True)
class RowScatter:
    """A chunked READ's gather prepared once for the whole READ
    (:meth:`ByteCopier.row_scatter`): every row's destination rows of ``g`` bytes in one
    index, uploaded once (and, for a gap READ, every row's source rows from its lane's
    start in another); a chunk's gather is one op over slices of them.

    Why: prepared per chunk (:meth:`ByteCopier.prepare`: merge, locate, the index's upload),
    a chunk's gather took the chunk driver 0.18-0.3 ms of host work on an H200, about half of
    a chunk's cycle -- and the driver's host work, not NIXL (32 MiB in 0.04-0.14 ms) or the
    copy, set the chunks' pace (``scripts/bench_chunk_pace.py``)."""

    src: Any            # the span's read side, as rows of ``g`` bytes
    dst: Any            # its written side
    index: Any          # each row's ``per_row`` destination rows, in the rows' order
    base: int           # the span's address
    g: int
    per_row: int
    src_index: Any = None   # a gap READ's: each row's source rows from its lane's start

    def ops(self, first: int, end: int, src: int) -> list[tuple]:
        """The gather of rows ``[first, end)``, whose lane starts at address ``src``: ops for
        :meth:`ByteCopier.launch`."""
        at, k = (src - self.base) // self.g, self.per_row
        dst_rows = self.index[first * k: end * k]
        if self.src_index is None:                  # back to back from the lane's start
            return [("scatter", self.src[at: at + (end - first) * k], self.dst, dst_rows)]
        return [("both", self.src[at:], self.dst, (self.src_index[first * k: end * k],
                                                   dst_rows))]


class _Span:
    """All the arenas' address range, holes between them included, as two byte tensors (two
    storages: torch refuses an in-place copy between views of one storage that may overlap).

    Why: an index op moves rows within one tensor, so with an arena per layer a gather was
    one op per (source, destination) arena pair, ~35 us of host work each whatever the bytes
    (1.3 ms for one block at 32 layers).  Over the span it is one op.  Nothing reads or writes
    a hole: every copy is checked to lie inside an arena first (:meth:`ByteCopier.locate`).
    The span starts at the lowest arena, so that its first byte is memory the device knows
    (torch asks the driver which device a CUDA pointer belongs to)."""

    def __init__(self, base: int, views: tuple[Any, Any], shift: np.ndarray) -> None:
        self.base = base
        self._views = views
        self.shift = shift              # each arena's start, from the span's
        self._rows: dict[tuple[int, int, int], Any] = {}

    @classmethod
    def over(cls, bases: np.ndarray, ends: np.ndarray, device: Any) -> _Span | None:
        """The span of the arenas ``[bases[i], ends[i])`` (sorted by base); None for one
        arena, or where the memory cannot be viewed so (a copier then runs an index op per
        arena pair)."""
        if bases.size < 2:
            return None
        base, nbytes = int(bases[0]), int(ends.max() - bases[0])
        try:
            views = (_raw_bytes(base, nbytes, device), _raw_bytes(base, nbytes, device))
        except Exception as exc:
            logger.debug("pdpatch kv_segments: no span view over %d arenas on %s (%s: %s); "
                         "a gather runs an index op per arena pair", bases.size, device,
                         type(exc).__name__, exc)
            return None
        return cls(base, views, bases - base)

    def rows(self, side: int, g: int, esz: int) -> Any:
        """Side ``side`` (0: read, 1: written) as rows of ``g`` bytes of ``esz``-byte
        elements."""
        key = (side, g, esz)
        view = self._rows.get(key)
        if view is None:
            import torch

            flat = self._views[side]
            view = flat[: flat.numel() // g * g].view(
                torch.int64 if esz == 8 else torch.uint8).view(-1, g // esz)
            self._rows[key] = view
        return view


class _ArrayInterface:
    """``nbytes`` bytes at ``addr``, as numpy's (host) or CUDA's array interface describes
    them: how torch makes a tensor of memory it did not allocate."""

    def __init__(self, addr: int, nbytes: int, cuda: bool) -> None:
        desc = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}
        if cuda:
            self.__cuda_array_interface__ = {**desc, "strides": None}
        else:
            self.__array_interface__ = desc


def _raw_bytes(addr: int, nbytes: int, device: Any) -> Any:
    import torch

    if device.type == "cuda":
        tensor = torch.as_tensor(_ArrayInterface(addr, nbytes, cuda=True), device=device)
    else:
        tensor = torch.from_numpy(np.asarray(_ArrayInterface(addr, nbytes, cuda=False)))
    if tensor.data_ptr() != addr or tensor.numel() != nbytes or tensor.device != device:
        raise RuntimeError(f"a view of {nbytes} B at {addr:#x} came out as {tensor.numel()} B "
                           f"at {tensor.data_ptr():#x} on {tensor.device}")
    return tensor


def _row_bytes(s_off: np.ndarray, d_off: np.ndarray, ln: np.ndarray) -> int:
    """The largest power of two (up to 64 KiB) dividing every offset and length: a bitwise
    or's lowest set bit (``np.gcd.reduce`` costs ~1 ms)."""
    low = int(np.bitwise_or.reduce(np.concatenate([s_off, d_off, ln])))
    return min(low & -low, 1 << 16)


def _consecutive(rows: np.ndarray) -> bool:
    return bool(rows.size) and int(rows[-1]) - int(rows[0]) + 1 == rows.size and \
        bool(np.all(np.diff(rows) == 1))


@contextmanager
def _nothing() -> Iterator[None]:
    yield
