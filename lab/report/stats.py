"""What a cell says about its samples: how many, the median and the range always; a t-interval
only where the independent units allow one.

A unit is what varies independently: a run's pair (transfer ratios, first requests) or a pair
start (TTFT), never a request of it.  With two units a t-interval has one degree of freedom
(t = 12.7) and says nothing useful, so an interval is given from three units on, always with
its degrees of freedom: the geometric mean of the ratios and Student's t on their logs
(:func:`lab.speed_starts.interval`, the statistics the TTFT starts were pooled by).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from lab.speed_starts import interval

MIN_UNITS_FOR_INTERVAL = 3


@dataclass(frozen=True)
class Spread:
    """n values: their median, lowest and highest."""

    n: int
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(len(values), statistics.median(values), min(values), max(values))


@dataclass(frozen=True)
class Interval:
    """The geometric mean of ratios with its 95 % t-interval and degrees of freedom."""

    mean: float
    low: float
    high: float
    df: int

    @classmethod
    def of(cls, ratios: Sequence[float]) -> Interval | None:
        """None below :data:`MIN_UNITS_FOR_INTERVAL` ratios (one per independent unit)."""
        if len(ratios) < MIN_UNITS_FOR_INTERVAL:
            return None
        mean, low, high = interval([math.log(r) for r in ratios])
        return cls(mean, low, high, len(ratios) - 1)


def num(x: float) -> str:
    """A time or a ratio at the precision the runs resolve: three significant digits, whole
    numbers from 1,000 on (with a thousands separator)."""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def spread(s: Spread | None, fmt=num) -> str:
    """``median (low-high, n=N)`` (an en dash); one value: ``value (n=1)``; none: an empty cell."""
    if s is None:
        return ""
    if s.n == 1:
        return f"{fmt(s.median)} (n=1)"
    return f"{fmt(s.median)} ({fmt(s.low)}\N{EN DASH}{fmt(s.high)}, n={s.n})"


def ttft(x: float) -> str:
    """A TTFT ratio near 1: three decimals, the resolution the 1.02 goal is judged at."""
    return f"{x:.3f}"


def geo(i: Interval | None, fmt=ttft) -> str:
    """``mean [low, high], df N``, or "no interval" (fewer than three units)."""
    if i is None:
        return f"no interval (< {MIN_UNITS_FOR_INTERVAL} units)"
    return f"{fmt(i.mean)} [{fmt(i.low)}, {fmt(i.high)}], df {i.df}"
