"""Benchmark a staged READ's gather planning: the fused copy of views against the index ops --
one over the arenas' span, or one per arena pair -- per number of copies (the choice
:data:`pdpatch.kv.staging.copier.FUSED_MAX_COPIES` makes where there is no span).

The copies are blocks of one K or V segment (32 KiB: 16 tokens x 8 heads x 128 x bf16) from
back-to-back staging into a KV cache of an arena per layer (``(2, blocks, segment)``, K and V
apart), blocks three apart so nothing merges: the gather of a READ from a converted peer
(``--adjacent``: a run of blocks, one copy per layer and side).
Host time of ``ByteCopier.prepare`` is what lies between a READ's post and vLLM's next poll;
with ``--device cuda`` the prepare + launch + synchronize time is printed too.  Each path's
bytes are checked once before it is timed.

Run: ``.venv/bin/python -m scripts.bench_gather [--layers 80] [--device cuda]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from unittest import mock

import numpy as np

SEGMENT = 16 * 8 * 128 * 2
FUSED_SHOWN_MAX = 4096
"""Copies above which the fused path is not timed ("-"): a view each, it is ~100x slower than
the others there and would take most of the run."""


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    import torch

    from pdpatch.kv.staging import copier as copier_module
    from pdpatch.kv.staging.copier import ByteCopier, arenas_of
    from pdpatch.kv.staging.plans import CopyPlan

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", default="1,2,4,8,16", help="blocks per READ, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--adjacent", action="store_true",
                    help="blocks next to each other: a layer's K (and V) is one merged copy")
    args = ap.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    device = torch.device(args.device)
    pool = 3 * max(blocks) + 1
    kv = [_aligned(torch.zeros(2, pool, SEGMENT, dtype=torch.uint8), device)
          for _ in range(args.layers)]
    staging = _aligned(torch.randint(0, 256, (2 * args.layers * max(blocks) * SEGMENT,),
                                     dtype=torch.uint8), device)
    copier = ByteCopier(arenas_of([*kv, staging]))
    per_pair = ByteCopier(arenas_of([*kv, staging]))
    per_pair._span = None
    paths = {"fused": (per_pair, 1 << 62), "span": (copier, 0), "pairs": (per_pair, 0)}
    if copier._span is None:
        del paths["span"]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    cuda = device.type == "cuda"
    print(f"{args.layers} layers, {SEGMENT >> 10} KiB copies, {device}; median of "
          f"{args.rounds}, ms; paths: {', '.join(paths)}")
    names = list(paths)
    head = "| blocks | copies | " + " | ".join(f"prepare: {p}" for p in names) + " |"
    if cuda:
        head += " " + " | ".join(f"prepare+copy: {p}" for p in names) + " |"
    print(head)
    for n in blocks:
        ids = np.arange(n) * (1 if args.adjacent else 3)
        # staging holds the peer's bytes in its address order: a layer's K blocks, its V...
        dst = np.array([t.data_ptr() + side * pool * SEGMENT + b * SEGMENT
                        for t in kv for side in (0, 1) for b in ids], dtype=np.int64)
        src = staging.data_ptr() + np.arange(dst.size, dtype=np.int64) * SEGMENT
        plan = CopyPlan(src, dst, np.full(dst.size, SEGMENT, dtype=np.int64))
        results: dict[str, tuple] = {}
        for path, (cop, limit) in paths.items():
            if path == "fused" and dst.size > FUSED_SHOWN_MAX:
                continue
            with mock.patch.object(copier_module, "FUSED_MAX_COPIES", limit):
                for t in kv:
                    t.zero_()
                sync()               # the copier's stream does not wait for the zeroing
                cop.launch(cop.prepare(plan))
                _check(kv, staging, ids, path)
                results[path] = (
                    _median_ms(lambda p=plan, c=cop: c.prepare(p), args.rounds),
                    _median_ms(lambda p=plan, c=cop: (c.launch(c.prepare(p)), sync()),
                               args.rounds) if cuda else None)
        cell = [(f"{results[p][0]:.3f}", f"{results[p][1]:.3f}" if cuda else "")
                if p in results else ("-", "-") for p in names]
        row = f"| {n} | {dst.size} | " + " | ".join(c[0] for c in cell)
        if cuda:
            row += " | " + " | ".join(c[1] for c in cell)
        print(row + " |")
    return 0


def _aligned(host: object, device: object) -> object:
    """``host`` on ``device``; on CPU moved to a 64 KiB-aligned address, as CUDA's allocator
    places a KV cache (torch's CPU allocator aligns to 64 B only, too little for the span's
    rows of 32 KiB)."""
    import torch

    if device.type != "cpu":
        return host.to(device)
    raw = np.zeros(host.numel() + (1 << 16), dtype=np.uint8)
    skip = -raw.ctypes.data % (1 << 16)
    return torch.from_numpy(raw[skip: skip + host.numel()]).view(host.shape)


def _check(kv: list, staging: object, ids: np.ndarray, path: str) -> None:
    """Every block of every layer and side holds the staging bytes planned for it, and the
    blocks between hold nothing: a path that copies wrong bytes has no time to print."""
    import torch

    seg = 0
    for t in kv:
        for side in (0, 1):
            for b in ids.tolist():
                if not torch.equal(t[side, b], staging[seg * SEGMENT:(seg + 1) * SEGMENT]):
                    raise AssertionError(f"{path}: block {b} side {side} holds wrong bytes")
                seg += 1
    written = sum(int(t.count_nonzero()) for t in kv)
    expected = sum(int(torch.count_nonzero(t[:, ids.tolist()])) for t in kv)
    if written != expected:
        raise AssertionError(f"{path}: {written - expected} nonzero bytes outside the copies")
