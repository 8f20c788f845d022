"""The TTFT pooling over pair starts (``lab/speed_starts``) that ``docs/gpu_results.md``'s
TTFT claims come from: its interval is Student's, its crossover estimate takes out the start
order's effect and nothing else, and its report reads ``scripts/gpu_pd.py --speed`` output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab import speed_starts


def test_interval_is_students_t_on_the_log_ratios() -> None:
    g, lo, hi = speed_starts.interval([0.0, 0.02])
    half = 12.706 * math.sqrt(0.0002) / math.sqrt(2)        # sd 0.01414, t(1) = 12.706
    assert g == pytest.approx(math.exp(0.01))
    assert (lo, hi) == pytest.approx((math.exp(0.01 - half), math.exp(0.01 + half)))
    with pytest.raises(ValueError):
        speed_starts.t975(0)


def test_crossover_takes_out_the_order_and_keeps_the_effect() -> None:
    """Starts whose "on" pair started first read effect + order, the others effect - order: the
    crossover estimate is the effect, with an interval as wide as the noise alone leaves."""
    effect, order, noise = math.log(1.01), math.log(1.03), [0.004, -0.006, 0.002]
    first = [effect + order + e for e in noise]
    second = [effect - order + e for e in noise]
    e, lo, hi, got_order = speed_starts.crossover(first, second)
    assert e == pytest.approx(1.01) and got_order == pytest.approx(1.03)
    assert hi / lo < 1.02 < speed_starts.interval(first + second)[2] / speed_starts.interval(
        first + second)[1]


def _speed_json(path: Path, *, control: bool, on_first: bool, ratio: float, on_ms: float) -> Path:
    path.write_text(json.dumps({
        "control": control, "started_first": "on" if on_first else "off",
        "ratio_ttft_on_off": [ratio, ratio - 0.03, ratio + 0.03],
        "ttft_s_by_length": {"off": {"100": 0.080, "16000": 0.400},
                             "on": {"100": on_ms / 1000, "16000": 0.400}}}))
    return path


def test_report_pools_pdpatch_and_control_starts_apart(tmp_path: Path) -> None:
    files = [_speed_json(tmp_path / f"pd{i}.json", control=False, on_first=i % 2 == 0,
                         ratio=r, on_ms=82.0) for i, r in enumerate([1.02, 1.00, 1.03, 0.99])]
    files += [_speed_json(tmp_path / f"aa{i}.json", control=True, on_first=i == 0, ratio=r,
                          on_ms=80.0) for i, r in enumerate([1.01, 0.99])]
    lines = speed_starts.report([speed_starts.load(p) for p in files])
    assert lines[0] == "pdpatch: 4 starts: 1.020f 1.000s 1.030f 0.990s"
    assert lines[1].startswith("  TTFT on/off 1.010 [")
    assert lines[2].startswith("  crossover: 1.010 [") and lines[2].endswith("x1.015")
    assert lines[3].startswith("  mean TTFT on/off by length: 100: 1.025 [1.025, 1.025], 16000")
    assert lines[4] == "A/A control: 2 starts: 1.010f 0.990s"
    assert lines[-1].startswith("pdpatch vs A/A: Welch t ")
    alone = speed_starts.report([speed_starts.load(p) for p in files[:1]])
    assert alone == ["pdpatch: 1 starts: 1.020f", "  mean TTFT on/off by length: 100: 1.025, "
                     "16000: 1.000"]
