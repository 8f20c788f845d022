"""Sum the wrapper clock's records (``lab/rig/wrapper_clock``): pdpatch's own host time per
wrapped target in each engine of a run, largest first, and per request where the run's
request count is given.

Usage: ``python -m lab.wrapper_clock DIR [--requests N]`` (DIR: the ``PDLAB_WRAPPER_CLOCK``
directory; the GPU rig writes one subdirectory per engine).  ``--steps``: the step clock's
records instead (``PDLAB_STEP_CLOCK``): each engine's per-step calls of vLLM, whole, with their
median and tail, to set a pdpatch engine's steps beside a stock engine's."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(directory: Path) -> dict[str, dict[str, dict[str, float]]]:
    """engine (subdirectory, or ``.``) -> label -> ``calls``, ``own_ms``, ``inclusive_ms``
    summed over the engine's processes, and the largest call's ``max_own_ms``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for f in sorted(directory.rglob("wrapper-clock-*.json")):
        engine = str(f.parent.relative_to(directory))
        labels = out.setdefault(engine, {})
        for label, rec in json.loads(f.read_text()).items():
            acc = labels.setdefault(label, {"calls": 0, "own_ms": 0.0, "inclusive_ms": 0.0,
                                            "max_own_ms": 0.0})
            for k in ("calls", "own_ms", "inclusive_ms"):
                acc[k] += rec[k]
            acc["max_own_ms"] = max(acc["max_own_ms"], rec["max_own_ms"])
    return out


def table(records: dict[str, dict[str, dict[str, float]]], requests: int | None) -> str:
    per = f" per request (/{requests})" if requests else ""
    lines = [f"| engine | target | calls | pdpatch's own ms | own ms{per} | us per call "
             "| largest call, ms |", "|---|---|---|---|---|---|---|"]
    for engine, labels in records.items():
        total = sum(r["own_ms"] for r in labels.values())
        rows = sorted(labels.items(), key=lambda kv: -kv[1]["own_ms"])
        top = max((r["max_own_ms"] for r in labels.values()), default=0.0)
        for label, r in [("(all)", {"calls": sum(x["calls"] for x in labels.values()),
                                    "own_ms": total, "max_own_ms": top}), *rows]:
            each = f"{r['own_ms'] / requests:.3f}" if requests else "-"
            us = 1e3 * r["own_ms"] / r["calls"] if r["calls"] else 0.0
            lines.append(f"| {engine} | {label} | {r['calls']} | {r['own_ms']:.2f} | {each} "
                         f"| {us:.1f} | {r['max_own_ms']:.2f} |")
    return "\n".join(lines)


def load_steps(directory: Path) -> dict[str, dict[str, dict]]:
    """engine -> label -> ``calls``, ``total_ms`` and the duration histogram ``buckets``
    (bucket -> calls), summed over the engine's processes."""
    out: dict[str, dict[str, dict]] = {}
    for f in sorted(directory.rglob("step-clock-*.json")):
        labels = out.setdefault(str(f.parent.relative_to(directory)), {})
        for label, rec in json.loads(f.read_text()).items():
            acc = labels.setdefault(label, {"calls": 0, "total_ms": 0.0, "buckets": {}})
            acc["calls"] += rec["calls"]
            acc["total_ms"] += rec["total_ms"]
            for b, n in rec["buckets"].items():
                acc["buckets"][int(b)] = acc["buckets"].get(int(b), 0) + n
    return out


def quantile_us(buckets: dict[int, int], q: float) -> float:
    """The ``q`` quantile of a step-clock histogram, in us (its bucket's value: +-1.2 %)."""
    total = sum(buckets.values())
    seen = 0
    for b in sorted(buckets):
        seen += buckets[b]
        if seen >= q * total:
            return 10 ** (b / 100)
    return float("nan")


def step_table(records: dict[str, dict[str, dict]]) -> str:
    lines = ["| engine | vLLM call | calls | mean us | median us | p90 us | p99 us |",
             "|---|---|---|---|---|---|---|"]
    for engine, labels in sorted(records.items()):
        for label, r in sorted(labels.items()):
            b = r["buckets"]
            lines.append(f"| {engine} | {label.rsplit(':', 1)[-1]} | {r['calls']} | "
                         f"{1e3 * r['total_ms'] / r['calls']:.1f} | {quantile_us(b, 0.5):.1f} | "
                         f"{quantile_us(b, 0.9):.1f} | {quantile_us(b, 0.99):.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory", type=Path)
    ap.add_argument("--requests", type=int, help="requests the run sent to each engine")
    ap.add_argument("--steps", action="store_true",
                    help="the step clock's records (PDLAB_STEP_CLOCK), not the wrapper clock's")
    args = ap.parse_args()
    print(step_table(load_steps(args.directory)) if args.steps
          else table(load(args.directory), args.requests))


if __name__ == "__main__":
    main()
