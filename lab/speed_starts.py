"""TTFT on/off pooled over several pair starts of ``scripts/gpu_pd.py --speed``.

One start resolves its ratio to +-3-4 %: the pairs' own start-to-start spread (an A/A control,
both pairs stock, spreads as much) is larger than what 80 paired rounds leave.  So the goal
(<= 1.02x) is judged over starts: each start's median paired ratio is one sample.  The design
crosses the order the pairs start in (``--speed-on-first``); a crossover analysis takes the
order's own effect out of the error, as the design intends.  A/A starts (``--speed-control``)
are pooled apart and compared with the pdpatch starts (Welch).

    python -m lab.speed_starts docs/gpu/2026-11-30-b[k-r]-8b-speed-*.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t, two-sided 95 %, for 1-30 degrees of freedom (no scipy on the device)."""


def t975(df: int) -> float:
    """Student's t quantile for ``df`` degrees of freedom (1.96 beyond the table)."""
    if df < 1:
        raise ValueError("an interval needs at least two samples")
    return T975[df - 1] if df <= len(T975) else 1.96


@dataclass(frozen=True)
class Start:
    """One pair start: its file, whether it is an A/A control, whether the "on" pair started
    first, its median paired TTFT ratio, and its mean TTFT (s) per prompt length, per pair."""

    path: str
    control: bool
    on_first: bool
    ratio: float
    by_length: dict[str, dict[str, float]]


def load(path: Path) -> Start:
    """A ``gpu_speed.json`` written by ``scripts/gpu_pd.py --speed``."""
    d = json.loads(path.read_text())
    return Start(path.name, bool(d["control"]), d["started_first"] == "on",
                 float(d["ratio_ttft_on_off"][0]), d["ttft_s_by_length"])


def interval(logs: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the ratios whose logs are given, with its t-interval."""
    m, n = statistics.mean(logs), len(logs)
    h = t975(n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(m), math.exp(m - h), math.exp(m + h)


def crossover(first: list[float], second: list[float]) -> tuple[float, float, float, float]:
    """The on/off effect with the start order's effect taken out (log ratios of the starts whose
    "on" pair started first and second): effect, its interval, and the order's own factor."""
    effect = (statistics.mean(first) + statistics.mean(second)) / 2
    order = (statistics.mean(first) - statistics.mean(second)) / 2
    df = len(first) + len(second) - 2
    pooled = ((len(first) - 1) * statistics.variance(first)
              + (len(second) - 1) * statistics.variance(second)) / df
    h = t975(df) * math.sqrt(pooled * (1 / len(first) + 1 / len(second))) / 2
    return math.exp(effect), math.exp(effect - h), math.exp(effect + h), math.exp(order)


def welch(a: list[float], b: list[float]) -> float:
    """Welch's t of mean(a) - mean(b)."""
    return (statistics.mean(a) - statistics.mean(b)) / math.sqrt(
        statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def by_length(group: list[Start], length: str) -> str:
    """The starts' mean TTFT on/off at one prompt length: geometric mean, with its interval
    where two starts or more have it."""
    logs = [math.log(s.by_length["on"][length] / s.by_length["off"][length])
            for s in group if length in s.by_length["on"]]
    if len(logs) < 2:
        return f"{math.exp(logs[0]):.3f}"
    g, lo, hi = interval(logs)
    return f"{g:.3f} [{lo:.3f}, {hi:.3f}]"


def report(starts: list[Start]) -> list[str]:
    """The lines this tool prints: per group, the starts, the pooled ratio and, with both orders
    twice or more, the crossover estimate; per length, the geometric mean of on/off; then the
    pdpatch starts against the A/A starts."""
    lines: list[str] = []
    logs: dict[str, list[float]] = {}
    for label, control in (("pdpatch", False), ("A/A control", True)):
        group = [s for s in starts if s.control == control]
        if not group:
            continue
        lines.append(f"{label}: {len(group)} starts: "
                     + " ".join(f"{s.ratio:.3f}{'f' if s.on_first else 's'}" for s in group))
        logs[label] = [math.log(s.ratio) for s in group]
        if len(group) >= 2:
            g, lo, hi = interval(logs[label])
            lines.append(f"  TTFT on/off {g:.3f} [{lo:.3f}, {hi:.3f}] "
                         f"(sd of log ratios {statistics.stdev(logs[label]):.4f})")
        first = [math.log(s.ratio) for s in group if s.on_first]
        second = [math.log(s.ratio) for s in group if not s.on_first]
        if len(first) >= 2 and len(second) >= 2:
            e, lo, hi, order = crossover(first, second)
            lines.append(f"  crossover: {e:.3f} [{lo:.3f}, {hi:.3f}]; "
                         f"the pair started first x{order:.3f}")
        lengths = sorted({n for s in group for n in s.by_length["on"]}, key=int)
        lines.append("  mean TTFT on/off by length: " + ", ".join(
            f"{n}: {by_length(group, n)}" for n in lengths))
    if all(len(v) >= 2 for v in logs.values()) and len(logs) == 2:
        lines.append(f"pdpatch vs A/A: Welch t {welch(logs['pdpatch'], logs['A/A control']):.2f}")
    return lines


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="gpu_speed.json files, one per start")
    args = ap.parse_args(argv)
    print("\n".join(report([load(p) for p in args.files])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
