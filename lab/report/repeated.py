"""The repeated samples of the GPU runs: several requests per pair and prompt, pair starts
crossed, the aged decode engine, the full-width models -- what ``lab/gpu/plan.py``'s calls
record beyond the first pass, read into the report.

What a run records (``scripts/gpu_pd.py``):

* ``samples`` per scenario (``--repeat``): each a P/D request of a prompt under its own salt,
  with its ``phase`` (``fresh``; ``aged`` after ``aging``, the aged D's driver), D's NIXL time
  and descriptors, and the oracle's verdict against D's own prefill of that prompt;
* ``aging`` per aged scenario: the requests that aged D, how many times its cache they asked
  for, and how far their finishing order was from their sending order;
* ``order`` and ``crossed`` per file: the pairs' start order (a ``--cross`` call writes the
  reversed order to its own file);
* ``weights`` per file of a full-width model: the seeded checkpoint's manifest;
* ``rounds_detail`` per ``--speed`` start: every paired round's length, which pair was sent
  first, each pair's TTFT and NIXL time.

A *unit* stays what :mod:`lab.report.stats` says: a pair start.  Within one start the samples
of a prompt give the pair's median time (with its range and n); the start's ratio is the
pdpatch pair's median over the stock pair's of the same run; the cell pools the starts' ratios
(median, range, n; a t-interval from three).  For the runs before repeated samples, each
request of the first pass is that pair's one sample (:func:`samples_of`), so the pooling is the
transfer table's (``tests/test_gpu_report.py`` checks it against the recorded runs).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from lab.report import records
from lab.report.cells import PairCell, StartCell
from lab.report.stats import Interval, Spread, geo, num, spread, ttft


@dataclass(frozen=True)
class Sample:
    """One P/D request of a pair: its prompt, phase, D's NIXL time (ms) and descriptors, the
    oracle's verdict (None: not judged), whether it failed, whether its answer was the stock
    pair's token for token (None: not compared)."""

    prompt: str
    phase: str
    xfer_ms: float | None
    descriptors: int | None
    intact: bool | None
    failed: bool
    same_as_stock: bool | None = None


def recorded_samples(s: records.Scenario) -> list[Sample]:
    """The scenario's ``samples`` as recorded (none before ``--repeat``)."""
    out = []
    for x in s.raw.get("samples") or []:
        xfer = x.get("xfer_s")
        out.append(Sample(x["prompt"], x.get("phase", "fresh"), xfer * 1e3 if xfer else None,
                          x.get("descriptors"), x.get("intact"), bool(x.get("error")),
                          x.get("same_as_stock")))
    return out


def samples_of(s: records.Scenario, phase: str = "fresh") -> list[Sample]:
    """A pair's samples of ``phase``: its recorded samples where it has any of that phase,
    else (``fresh`` only) its first pass, one sample per prompt -- the shared reading of every
    run, old and new."""
    got = [x for x in recorded_samples(s) if x.phase == phase]
    if got or phase != "fresh":
        return got
    return [Sample(n, "fresh", r.xfer_ms, s.raw["requests"][n].get("descriptors"), r.intact,
                   r.failed, r.same_as_stock) for n, r in s.requests.items()]


def _times(samples: list[Sample], prompt: str) -> list[float]:
    return [x.xfer_ms for x in samples if x.prompt == prompt and x.xfer_ms]


def start_ratios(cell: PairCell, prompt: str, phase: str = "fresh") -> list[float]:
    """Per pair start of ``cell``: the median of its samples' D-side NIXL time for ``prompt``
    over its stock pair's (same run; the stock pair's samples of the same phase)."""
    out = []
    for p in cell.pairs:
        if p.stock is None:
            continue
        a, b = _times(samples_of(p.scenario, phase), prompt), \
            _times(samples_of(p.stock, phase), prompt)
        if a and b:
            out.append(statistics.median(a) / statistics.median(b))
    return out


def has_samples(cell: PairCell) -> bool:
    return any(recorded_samples(p.scenario) for p in cell.pairs)


def phases(cell: PairCell) -> list[str]:
    return list(dict.fromkeys(x.phase for p in cell.pairs for x in recorded_samples(p.scenario)))


def orders(cell: PairCell) -> str:
    """How many of the cell's starts measured the pdpatch pair before its stock pair."""
    own = [p for p in cell.pairs if p.stock and p.stock.run == p.scenario.run]
    first = sum(p.scenario.position < p.stock.position for p in own)
    return f"{first} / {len(own) - first}"


def pooled(cell: PairCell, prompt: str, phase: str, stock: bool) -> list[Sample]:
    return [x for p in cell.pairs if (q := p.stock if stock else p.scenario) is not None
            for x in samples_of(q, phase) if x.prompt == prompt]


def _median_int(xs: list[int | None]) -> str:
    got = [x for x in xs if x]
    return f"{statistics.median(got):,.0f}" if got else ""


def answers(samples: list[Sample]) -> str:
    judged = [x for x in samples if x.intact is not None]
    same = [x for x in samples if x.same_as_stock is not None]
    failed = sum(x.failed for x in samples)
    parts = [f"intact {sum(x.intact for x in judged)}/{len(judged)}" if judged
             else "not judged"]
    if same:
        parts.append(f"identical to stock's {sum(x.same_as_stock for x in same)}/{len(same)}")
    if failed:
        parts.append(f"{failed} failed")
    return ", ".join(parts)


def aging(cell: PairCell) -> str:
    """The aged D of each start of the cell, pdpatch pair's and stock pair's: requests, times
    the cache, finish-order inversions (0: as sent, ~0.5: unrelated)."""
    out = []
    for p in cell.pairs:
        for s in (p.scenario, p.stock):
            a = s.raw.get("aging") if s else None
            if a:
                out.append(f"{s.run.letter}:{s.name} {a['requests']} requests, {a['cycles']}x "
                           f"its cache, inversions {a['inversions']}"
                           + (f", {a['failed']} failed" if a.get("failed") else ""))
    return "; ".join(out)


def transfer_samples(data) -> str:      # data: lab.report.tables.Data
    """Each pdpatch configuration with repeated samples: per phase and prompt, both pairs'
    D-side NIXL time (median, range, n requests), descriptors per READ, the starts' ratios."""
    from lab.report import tables

    lines = tables.header("vLLM", "KV", "P -> D", "pdpatch", "D", "prompt", "runs",
                          "pdpatch pair measured first / second", "pdpatch pair's ms",
                          "stock pair's ms", "descriptors per READ, pdpatch / stock",
                          "÷ stock, per start", "geometric mean [95 % t], df",
                          "answers (pdpatch pair; stock pair)", "D aged by", "current code")
    rows = 0
    for c in sorted((c for c in data.pairs if has_samples(c)), key=tables._pair_order):
        for phase in phases(c):
            prompts = records_prompts(c, phase)
            for prompt in prompts:
                mine, stock = pooled(c, prompt, phase, False), pooled(c, prompt, phase, True)
                ratios = start_ratios(c, prompt, phase)
                lines.append(tables.row(
                    c.release, tables.kv_of(c.geometry), tables.pair_of(c.backends, c.tp),
                    tables.setting(c.name), "aged" if phase == "aged" else "fresh",
                    tables.prompt_name(prompt), ", ".join(c.runs()), orders(c),
                    spread(_spread([x.xfer_ms for x in mine])),
                    spread(_spread([x.xfer_ms for x in stock])),
                    f"{_median_int([x.descriptors for x in mine])} / "
                    f"{_median_int([x.descriptors for x in stock])}",
                    spread(Spread.of(ratios)) if ratios else "",
                    geo(Interval.of(ratios), num) if ratios else "",
                    f"{answers(mine)}; {answers(stock)}",
                    aging(c) if phase == "aged" else "", tables.changed(c.superseded)))
                rows += 1
    if not rows:
        return ("No run has recorded repeated samples yet: the calls that will are in "
                "[the run plan](gpu_plan.md).")
    return "\n".join(lines)


def records_prompts(c: PairCell, phase: str) -> list[str]:
    from lab.report.cells import ordered_prompts

    return ordered_prompts(x.prompt for p in c.pairs for x in recorded_samples(p.scenario)
                           if x.phase == phase)


def _spread(xs: list[float | None]) -> Spread | None:
    got = [x for x in xs if x]
    return Spread.of(got) if got else None


# ------------------------------------------------------------------------------ TTFT rounds


def rounds_of(start: records.SpeedStart, folder: Path = records.GPU_DIR) -> list[dict]:
    """The start's ``rounds_detail`` (none before it was recorded)."""
    d = json.loads((folder / start.run.file).read_text())
    return d.get("rounds_detail") or []


def ttft_rounds(data, folder: Path = records.GPU_DIR) -> str:   # data: tables.Data
    """Per TTFT cell with every round recorded: per prompt length, the paired rounds' TTFT on/off
    (median, range, n rounds), the starts' medians at that length, each pair's NIXL time."""
    from lab.report import tables

    lines = tables.header("vLLM", "KV", '"on" pair', "runs", '"on" started first / second',
                          "length", "TTFT on/off, rounds", "TTFT on/off, starts' medians",
                          "geometric mean [95 % t], df", "D's NIXL ms, on", "D's NIXL ms, off",
                          "outputs identical", "current code")
    rows = 0
    for c in sorted(data.starts, key=lambda c: (c.release, c.geometry, c.control, c.on_env)):
        detail = {s.run.file: rounds_of(s, folder) for s in c.starts}
        if not any(detail.values()):
            continue
        for length in sorted({r["length"] for rs in detail.values() for r in rs}):
            per_round, per_start, on_ms, off_ms, same = _length(detail, length)
            lines.append(tables.row(
                c.release, tables.kv_of(c.geometry), tables.on_pair(c), ", ".join(c.runs()),
                c.orders(), f"{length:,}", spread(_spread(per_round), ttft),
                spread(_spread(per_start), ttft), geo(Interval.of(per_start)),
                spread(_spread(on_ms)), spread(_spread(off_ms)),
                f"{sum(same)}/{len(same)}", tables.changed(c.superseded)))
            rows += 1
    if not rows:
        return ("No TTFT start has recorded its rounds one by one yet: the calls that will are "
                "in [the run plan](gpu_plan.md).")
    return "\n".join(lines)


def _length(detail: dict, length: int) -> tuple[list, list, list, list, list]:
    per_round, per_start, on_ms, off_ms, same = [], [], [], [], []
    for rs in detail.values():
        mine = [r for r in rs if r["length"] == length]
        ratios = [r["ttft_s"]["on"] / r["ttft_s"]["off"] for r in mine]
        per_round += ratios
        if ratios:
            per_start.append(statistics.median(ratios))
        on_ms += [r["xfer_s"]["on"] * 1e3 for r in mine if r["xfer_s"].get("on")]
        off_ms += [r["xfer_s"]["off"] * 1e3 for r in mine if r["xfer_s"].get("off")]
        same += [bool(r.get("identical")) for r in mine]
    return per_round, per_start, on_ms, off_ms, same


def start_cells_with_rounds(cells: list[StartCell], folder: Path = records.GPU_DIR
                            ) -> list[StartCell]:
    return [c for c in cells if any(rounds_of(s, folder) for s in c.starts)]


BLOCKS = {"transfer-samples": transfer_samples, "ttft-rounds": ttft_rounds}
"""The blocks this module adds to the report (``lab/report/tables.py``'s ``BLOCKS``)."""
