"""Paired on/off comparisons for the P/D benches: the same prompt sent to both sides back to
back, so a slow period of a shared machine hits both alike; the ratio's median and a bootstrap
interval of it say whether a run resolves the goal."""

from __future__ import annotations

import random
import statistics


def median_ci(xs: list[float], n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the median: how well this run resolves the ratio."""
    if len(xs) < 3:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n_boot))
    return meds[int(0.025 * n_boot)], meds[int(0.975 * n_boot) - 1]


def verdict(ratios: dict[str, list[float]], goal: float) -> tuple[float, str]:
    """The worst median of the named paired ratios (> 1: pdpatch slower) and what the run can
    say about ``goal``: within it, above it, or inconclusive."""
    worst_med = max(statistics.median(xs) for xs in ratios.values())
    lo = max(median_ci(xs)[0] for xs in ratios.values())
    hi = max(median_ci(xs)[1] for xs in ratios.values())
    if hi <= goal:
        return worst_med, f"within the {goal:.2f}x goal"
    if lo > goal:
        return worst_med, f"ABOVE the {goal:.2f}x goal"
    return worst_med, (f"INCONCLUSIVE: this run cannot resolve {goal:.2f}x (CI up to "
                       f"{hi:.2f}x); rerun on a quiet machine or with more repetitions")
