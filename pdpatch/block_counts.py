"""Block-count reconciliation: what a NIXL worker may register when its KV tensors hold more (or
fewer) blocks than the engine planned.

The three numbers that must agree per engine:

* the block ids the scheduler can hand out: ``[0, kv_cache_config.num_blocks)`` logical blocks
  (kvcached's ``ElasticBlockPool`` is built with exactly ``kv_cache_config.num_blocks``);
* what is registered with NIXL and described by local descriptors;
* what is advertised to the peer (``num_blocks``, ``region_num_blocks``), from which the peer
  builds its remote descriptors and desc ids.

kvcached hands vLLM views over a virtual range sized from the whole GPU (1.2-7x the plan).
Decision (``MODE_SLICE``, the default): narrow every view to the planned count.  Then all three
numbers equal the plan on every TP rank by construction (one ``KVCacheConfig`` per engine), and
the registered bytes end where the plan ends.  The GPU probe (``gpu_probe.md`` Q3) showed why the
alternative is worse: with kvcached's whole range registered, a block index past the plan reads
kvcached's shared zero page *silently* (a write would scribble on it), and a raw VMM hole
crashes the peer process; with the range sliced, NIXL rejects the same index cleanly
(``NIXL_ERR_NOT_FOUND``).  ``MODE_VIRTUAL`` (advertise the tensors' full capacity) is kept as a
switch for deployments that want it; it registers unmapped virtual memory and lets the advertised
count exceed what the scheduler can use.

Under-allocation (a tensor with fewer blocks than planned) is always an error: the scheduler would
hand out block ids that do not exist in memory.

Pure module (no torch, no vLLM): callers pass shapes, strides and counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

MODE_SLICE = "slice"
MODE_VIRTUAL = "virtual"
MODES = (MODE_SLICE, MODE_VIRTUAL)

ACTION_KEEP = "keep"
ACTION_SLICE = "slice"
ACTION_VIRTUAL = "virtual"


class BlockCountError(RuntimeError):
    """A KV tensor's block count cannot be reconciled with the engine's plan."""


class UnderAllocatedError(BlockCountError):
    """A KV tensor holds fewer blocks than the scheduler may address."""


class InconsistentBlocksError(BlockCountError):
    """KV tensors of one engine disagree on their block count where they must not."""


def block_dim(shape: Sequence[int]) -> int:
    """The dimension that counts blocks in a vLLM attention KV tensor.

    ``(2, N, bs, H, D)`` (FlashAttention up to vLLM 0.22, K/V outermost) counts blocks in dim 1;
    every other layout vLLM or kvcached hands the NIXL worker counts them in dim 0: FlashInfer and
    FlashAttention 0.23-0.25 ``(N, 2, bs, H, D)``, packed ``(N, H, bs, 2D)`` from 0.26, the
    planner's views from 0.29, MLA ``(N, bs, D)``.  With ``N == 2`` the two 5-D forms look alike;
    dim 0 is returned then, which is right for the blocks-first form and for the K/V-first form
    still yields the value 2 that the caller compares against its plan.
    """
    if len(shape) == 5 and shape[0] == 2 and shape[1] != 2:
        return 1
    return 0


@dataclass(frozen=True)
class LayerBlocks:
    """Block count of one layer's KV tensor."""

    name: str
    dim: int
    count: int


@dataclass(frozen=True)
class Reconciliation:
    """What to do with each layer, and the count every consumer will then see."""

    mode: str
    planned: int                      # kernel-granularity blocks the engine planned
    target: int                       # the count registered and advertised afterwards
    layers: tuple[LayerBlocks, ...]
    actions: Mapping[str, str]        # layer name -> keep | slice | virtual

    @property
    def over_allocated(self) -> tuple[LayerBlocks, ...]:
        return tuple(lb for lb in self.layers if lb.count > self.planned)

    @property
    def changed(self) -> bool:
        return any(a != ACTION_KEEP for a in self.actions.values())

    def describe(self) -> str:
        over = self.over_allocated
        if not over:
            return f"all {len(self.layers)} KV tensors hold the planned {self.planned} blocks"
        counts = sorted({lb.count for lb in over})
        verb = ("sliced to the planned" if self.mode == MODE_SLICE
                else "advertised whole instead of the planned")
        return (f"{len(over)} of {len(self.layers)} KV tensors hold {_fmt(counts)} blocks; "
                f"{verb} {self.planned if self.mode == MODE_SLICE else self.target} "
                f"(plan: {self.planned})")


def _fmt(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}..{values[-1]}"


def reconcile(layers: Iterable[LayerBlocks], planned: int, mode: str = MODE_SLICE,
              *, context: str = "") -> Reconciliation:
    """Decide per layer; raise :class:`UnderAllocatedError` / :class:`InconsistentBlocksError`.

    ``planned`` is at the tensors' granularity (kernel blocks: logical plan x
    ``physical_blocks_per_logical``).  ``context`` is appended to error messages (where the
    plan came from, which engine).
    """
    if mode not in MODES:
        raise ValueError(f"unknown block-count mode {mode!r}; accepted: {', '.join(MODES)}")
    if planned <= 0:
        raise BlockCountError(f"planned block count must be positive, got {planned}{context}")
    layers = tuple(layers)
    under = [lb for lb in layers if lb.count < planned]
    if under:
        worst = min(under, key=lambda lb: lb.count)
        raise UnderAllocatedError(
            f"pdpatch num_blocks: {len(under)} KV tensor(s) hold fewer blocks than the engine "
            f"planned: layer {worst.name!r} has {worst.count} (dim {worst.dim}), the plan is "
            f"{planned}{context}. The scheduler would hand out block ids up to {planned - 1}, "
            f"which do not exist in that tensor; NIXL transfers to them would read or write "
            f"outside the KV cache. Make the allocator (e.g. kvcached) reserve at least "
            f"{planned} blocks per layer, or lower gpu_memory_utilization / "
            f"num_gpu_blocks_override so the plan fits.")
    if mode == MODE_SLICE:
        actions = {lb.name: ACTION_SLICE if lb.count > planned else ACTION_KEEP for lb in layers}
        return Reconciliation(mode, planned, planned, layers, actions)
    counts = {lb.count for lb in layers}
    if len(counts) > 1:
        raise InconsistentBlocksError(
            f"pdpatch num_blocks (mode {MODE_VIRTUAL}): KV tensors hold different block counts "
            f"{sorted(counts)}{context}; one count must be advertised for every region. Use "
            f"mode {MODE_SLICE!r} (the default), which registers the planned {planned} blocks.")
    target = counts.pop() if counts else planned
    actions = {lb.name: ACTION_VIRTUAL if lb.count > planned else ACTION_KEEP for lb in layers}
    return Reconciliation(mode, planned, target, layers, actions)


def byte_extent(storage_offset: int, shape: Sequence[int], stride: Sequence[int],
                itemsize: int) -> tuple[int, int]:
    """``[lo, hi)`` bytes, relative to the storage start, that a strided view can touch."""
    if any(n == 0 for n in shape):
        start = storage_offset * itemsize
        return start, start
    lo = hi = storage_offset
    for n, s in zip(shape, stride, strict=True):
        span = (n - 1) * s
        if span < 0:
            lo += span
        else:
            hi += span
    return lo * itemsize, (hi + 1) * itemsize


def merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of half-open intervals, sorted; touching intervals merge."""
    out: list[list[int]] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def covering_range(extents: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    """The single interval that the extents of views sharing one storage cover, or None when
    they leave a gap (then no single registration covers exactly the planned bytes)."""
    merged = merge(extents)
    if len(merged) != 1:
        return None
    return merged[0]


__all__ = [
    "MODES",
    "MODE_SLICE",
    "MODE_VIRTUAL",
    "BlockCountError",
    "InconsistentBlocksError",
    "LayerBlocks",
    "Reconciliation",
    "UnderAllocatedError",
    "block_dim",
    "byte_extent",
    "covering_range",
    "merge",
    "reconcile",
]
