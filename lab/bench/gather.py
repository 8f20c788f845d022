"""Benchmark a staged READ's gather planning: the fused copy of views against the index ops,
per number of copies (the choice :data:`pdpatch.kv.staging.copier.FUSED_MAX_COPIES` makes).

The copies are blocks of one K or V segment (32 KiB: 16 tokens x 8 heads x 128 x bf16) from
back-to-back staging into a KV cache of an arena per layer (``(2, blocks, segment)``, K and V
apart), blocks three apart so nothing merges: the gather of a READ from a converted peer.
Host time of ``ByteCopier.prepare`` is what lies between a READ's post and vLLM's next poll;
with ``--device cuda`` the prepare + launch + synchronize time is printed too.

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
    args = ap.parse_args(argv)
    blocks = [int(b) for b in args.blocks.split(",")]
    device = torch.device(args.device)
    pool = 3 * max(blocks) + 1
    kv = [torch.zeros(2, pool, SEGMENT, dtype=torch.uint8, device=device)
          for _ in range(args.layers)]
    staging = torch.empty(2 * args.layers * max(blocks) * SEGMENT, dtype=torch.uint8,
                          device=device)
    copier = ByteCopier(arenas_of([*kv, staging]))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    print(f"{args.layers} layers, {SEGMENT >> 10} KiB copies, {device}; median of "
          f"{args.rounds}, ms")
    print("| blocks | copies | prepare: fused | index | index/fused |"
          + (" prepare+copy: fused | index | index/fused |" if device.type == "cuda" else ""))
    for n in blocks:
        ids = np.arange(n) * 3
        dst = np.array([t.data_ptr() + side * pool * SEGMENT + b * SEGMENT
                        for b in ids for t in kv for side in (0, 1)], dtype=np.int64)
        src = staging.data_ptr() + np.arange(dst.size, dtype=np.int64) * SEGMENT
        plan = CopyPlan(src, dst, np.full(dst.size, SEGMENT, dtype=np.int64))
        row = [f"| {n} | {dst.size} |"]
        results = {}
        for path, limit in (("fused", 1 << 62), ("index", 0)):
            with mock.patch.object(copier_module, "FUSED_MAX_COPIES", limit):
                results[path] = (
                    _median_ms(lambda p=plan: copier.prepare(p), args.rounds),
                    _median_ms(lambda p=plan: (copier.launch(copier.prepare(p)), sync()),
                               args.rounds) if device.type == "cuda" else None)
        for i in (0, 1) if device.type == "cuda" else (0,):
            fused, index = results["fused"][i], results["index"][i]
            row.append(f" {fused:.3f} | {index:.3f} | {index / fused:.2f} |")
        print("".join(row))
    return 0
