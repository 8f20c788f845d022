"""The raw records pooled into cells: one per configuration and code epoch, every run of it.

A *pair cell* holds one pdpatch scenario (its release, KV geometry, TP sizes, settings) in one
epoch (:mod:`lab.report.epochs`): per run, the scenario and the stock pair its times are divided
by (same run, same TP sizes, D's backend first; or the run :data:`~lab.report.epochs.STOCK_FROM`
names), and whether its answers were judged intact with its controls caught.  A *start cell*
holds the ``--speed`` pair starts of one configuration and epoch.  Nothing is chosen by value:
a cell pools every run its key matches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lab.gpu import oracle
from lab.gpu.pd import pair_calibration, parse_tolerances
from lab.report.epochs import (
    COALESCED,
    REQUEST,
    STAGED,
    STOCK_FROM,
    Change,
    epoch,
    paths_of,
    superseded,
)
from lab.report.records import Records, Scenario, SpeedStart
from lab.report.stats import Interval, Spread


@dataclass(frozen=True)
class Judged:
    """Answers judged intact out of those judged, those not judged, requests that failed,
    controls caught out of the controls judged (``controls``: how many were sent), and how they
    were judged where not by their own run."""

    intact: int = 0
    judged: int = 0
    unjudged: int = 0
    failed: int = 0
    caught: int = 0
    controls_judged: int = 0
    controls: int = 0
    how: tuple[str, ...] = ()

    def __add__(self, o: Judged) -> Judged:
        return Judged(self.intact + o.intact, self.judged + o.judged, self.unjudged + o.unjudged,
                      self.failed + o.failed, self.caught + o.caught,
                      self.controls_judged + o.controls_judged, self.controls + o.controls,
                      tuple(dict.fromkeys(self.how + o.how)))

    def text(self) -> str:
        parts = [f"intact {self.intact}/{self.judged}" if self.judged else "not judged"]
        if self.unjudged and self.judged:
            parts.append(f"{self.unjudged} not judged")
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.controls_judged:
            parts.append(f"controls caught {self.caught}/{self.controls_judged}"
                         + (f" ({self.controls - self.controls_judged} not judged)"
                            if self.controls > self.controls_judged else ""))
        else:
            parts.append(f"{self.controls} controls not judged" if self.controls
                         else "no controls")
        return ", ".join(parts) + "".join(f" ({h})" for h in self.how)


def judged_in_run(s: Scenario) -> Judged:
    """What the run's own oracle said."""
    reqs = list(s.requests.values())
    caught = list(s.controls.values())
    return Judged(sum(r.intact is True for r in reqs), sum(r.intact is not None for r in reqs),
                  sum(r.intact is None and not r.failed for r in reqs),
                  sum(r.failed for r in reqs), sum(c is True for c in caught),
                  sum(c is not None for c in caught), len(caught))


REJUDGED = "judged by the report against the stock pair's run: its own run had none"


def rejudged(s: Scenario, stock: Scenario) -> Judged:
    """``s``'s answers and controls judged by ``stock``'s run's calibration, from the first tokens
    and drifts ``s``'s record kept (its run had no reference of its own; see STOCK_FROM)."""
    cals = parse_tolerances(stock.tolerances, stock.run.file)
    cal, _ = pair_calibration({"backends": list(s.backends), "tp": list(s.tp)}, cals,
                              "sequential")
    if cal is None:
        return judged_in_run(s)

    def verdict(first: int, base_first: int, dlp0: float, prompt: str) -> bool:
        return oracle.judge(oracle.Decoded([first], [-dlp0]), oracle.Decoded([base_first], [0.0]),
                            cal.tol[prompt], None, cal.ties.get(prompt, ())).intact

    entries = s.raw["requests"]
    verdicts = [verdict(e["first"], e["base_first"], e["dlp0"], n)
                for n, e in entries.items() if n in cal.tol and e.get("dlp0") is not None]
    caught = [not verdict(c["ids"][0], entries[c["prompt"]]["base_first"], c["dlp0"],
                          c["prompt"])
              for c in s.raw["controls"].values() if c.get("ids") and c.get("dlp0") is not None]
    failed = sum(r.failed for r in s.requests.values())
    return Judged(sum(verdicts), len(verdicts), len(entries) - len(verdicts) - failed, failed,
                  sum(caught), len(caught), len(s.raw["controls"]), (REJUDGED,))


@dataclass(frozen=True)
class Pair:
    """One run of a pdpatch scenario, the stock pair its times are divided by (None: the run
    had none), and its answers' judgement."""

    scenario: Scenario
    stock: Scenario | None
    judged: Judged


def stock_pair(s: Scenario, run: list[Scenario]) -> Scenario | None:
    """The stock pair ``s``'s times are divided by: a stock scenario of the run with ``s``'s
    model and TP sizes that pulled KV, the same backends first, then D's (D posts the READ), one
    without a load phase first."""
    stock = [r for r in run if not r.pdpatch and r.tp == s.tp
             and (r.run.release, r.run.geometry) == (s.run.release, s.run.geometry)
             and any(q.xfer_ms for q in r.requests.values())]
    stock.sort(key=lambda r: (r.backends != s.backends, r.backends[1] != s.backends[1],
                              r.load is not None, r.name.startswith("stock-")))
    return stock[0] if stock else None


@dataclass
class PairCell:
    """Every run of one pdpatch scenario in one epoch."""

    release: str
    geometry: str
    name: str
    paths: frozenset[str]
    epoch: tuple[Change, ...]
    superseded: tuple[Change, ...]
    pairs: list[Pair] = field(default_factory=list)

    @property
    def tp(self) -> tuple[int, int]:
        return self.pairs[0].scenario.tp

    @property
    def backends(self) -> tuple[str, str]:
        return self.pairs[0].scenario.backends

    def runs(self) -> list[str]:
        return list(dict.fromkeys(p.scenario.run.letter for p in self.pairs))

    def stock_runs(self) -> list[str]:
        """The stock pairs divided by, as ``run:scenario`` where not the pair's own run."""
        return list(dict.fromkeys(
            p.stock.name if p.stock.run == p.scenario.run
            else f"{p.stock.run.letter}:{p.stock.name}" for p in self.pairs if p.stock))

    def prompts(self) -> list[str]:
        return list(dict.fromkeys(n for p in self.pairs for n in p.scenario.requests))

    def ratios(self, prompt: str) -> Spread | None:
        """D's NIXL time over the stock pair's, the prompt's request in each run."""
        xs = [a.xfer_ms / b.xfer_ms for p in self.pairs if p.stock
              and (a := p.scenario.requests.get(prompt)) and (b := p.stock.requests.get(prompt))
              and a.xfer_ms and b.xfer_ms]
        return Spread.of(xs) if xs else None

    def first_requests(self) -> list[tuple[float, bool]]:
        """Per run: the pair's first P/D request over the stock pair's, and whether the pdpatch
        pair's was measured first in its run (a pair whose stock pair is another run's was
        alone, so first, as that stock pair was in its own run)."""
        out = []
        for p in self.pairs:
            if p.stock is None or not p.scenario.requests:
                continue
            a = next(iter(p.scenario.requests.values())).ms
            b = next(iter(p.stock.requests.values())).ms
            if a and b:
                own = p.stock.run == p.scenario.run
                out.append((a / b, p.scenario.position < p.stock.position if own else True))
        return out

    def judged(self) -> Judged:
        return sum((p.judged for p in self.pairs), Judged())

    def stock_judged(self) -> Judged:
        return sum((judged_in_run(p.stock) for p in self.pairs if p.stock), Judged())

    def current(self) -> bool:
        return not self.superseded


def pair_cells(records: Records) -> list[PairCell]:
    """Every pdpatch scenario of the records, pooled per (release, geometry, scenario, epoch)."""
    by_file: dict[str, list[Scenario]] = {}
    by_run: dict[str, list[Scenario]] = {}
    for s in records.scenarios:
        by_file.setdefault(s.run.file, []).append(s)
        by_run.setdefault(s.run.letter, []).append(s)
    cells: dict[tuple, PairCell] = {}
    for s in records.scenarios:
        if not s.pdpatch or not s.requests:     # engines that never served measured nothing:
            continue                            # the answers table names their error
        paths = paths_of(s.name, s.run.release)
        start = epoch(s.run.letter, paths, s.run.release)
        key = (s.run.release, s.run.geometry, s.name, tuple(c.commit for c in start))
        cell = cells.setdefault(key, PairCell(s.run.release, s.run.geometry, s.name, paths,
                                              start, superseded(start, paths, s.run.release)))
        other = STOCK_FROM.get(s.run.letter)
        stock = stock_pair(s, by_run[other] if other else by_file[s.run.file])
        judged = rejudged(s, stock) if other and stock and not any(
            r.intact is not None for r in s.requests.values()) else judged_in_run(s)
        cell.pairs.append(Pair(s, stock, judged))
    return list(cells.values())


@dataclass(frozen=True)
class StartCell:
    """Every ``--speed`` start of one configuration in one epoch."""

    release: str
    geometry: str
    on_env: tuple[tuple[str, str], ...]
    control: bool
    epoch: tuple[Change, ...]
    superseded: tuple[Change, ...]
    starts: tuple[SpeedStart, ...]

    def runs(self) -> list[str]:
        return list(dict.fromkeys(s.run.letter for s in self.starts))

    def ratios(self) -> list[float]:
        return [s.ratio for s in self.starts]

    def interval(self) -> Interval | None:
        return Interval.of(self.ratios())

    def orders(self) -> str:
        first = sum(s.on_first is True for s in self.starts)
        second = sum(s.on_first is False for s in self.starts)
        unknown = len(self.starts) - first - second
        return f"{first} / {second}" + (f" ({unknown} not recorded)" if unknown else "")

    def lengths(self) -> list[str]:
        return sorted({n for s in self.starts for n in s.by_length.get("on", {})}, key=int)

    def by_length(self, length: str) -> Spread | None:
        """The starts' mean TTFT on/off at ``length``."""
        xs = [s.by_length["on"][length] / s.by_length["off"][length] for s in self.starts
              if s.by_length.get("on", {}).get(length) and s.by_length["off"].get(length)]
        return Spread.of(xs) if xs else None

    def tput(self) -> Spread | None:
        xs = [s.tput_off_on for s in self.starts if s.tput_off_on]
        return Spread.of(xs) if xs else None

    def xfer(self) -> Spread | None:
        """D's NIXL time on/off over every paired round of the starts."""
        xs = [x for s in self.starts for x in s.xfer_on_off]
        return Spread.of(xs) if xs else None

    def identical(self) -> str:
        same = [tuple(map(int, s.identical.split("/"))) for s in self.starts if s.identical]
        return f"{sum(a for a, _ in same)}/{sum(b for _, b in same)}" if same else ""

    def current(self) -> bool:
        return not self.superseded


def start_paths(start: SpeedStart) -> frozenset[str]:
    """A speed start's "on" pair runs pdpatch's request path, and staging where it coalesces;
    an A/A start runs none."""
    if start.control:
        return frozenset()
    env = dict(start.on_env)
    return frozenset({REQUEST, STAGED, COALESCED} if env.get("PDPATCH_KV_COALESCE") == "1"
                     else {REQUEST})


def start_cells(records: Records) -> list[StartCell]:
    """Every speed start of the records, pooled per (release, geometry, settings, A/A, epoch)."""
    groups: dict[tuple, list[SpeedStart]] = {}
    for s in records.starts:
        start = epoch(s.run.letter, start_paths(s), s.run.release)
        groups.setdefault((s.run.release, s.run.geometry, s.on_env, s.control, start),
                          []).append(s)
    return [StartCell(release, geometry, env, control, start,
                      superseded(start, start_paths(starts[0]), release), tuple(starts))
            for (release, geometry, env, control, start), starts in groups.items()]


def stock_times(records: Records) -> dict[tuple, dict[str, list[tuple[str, float]]]]:
    """Every stock pair's D-side NIXL time per request, per (release, geometry, TP sizes,
    backends, prefix caching): what one stock configuration reads from run to run."""
    out: dict[tuple, dict[str, list[tuple[str, float]]]] = {}
    for s in records.scenarios:
        if s.pdpatch:
            continue
        key = (s.run.release, s.run.geometry, s.tp, s.backends, s.run.prefix_caching)
        for n, r in s.requests.items():
            if r.xfer_ms:
                out.setdefault(key, {}).setdefault(n, []).append((s.run.letter, r.xfer_ms))
    return out


def ordered_prompts(names: Iterable[str]) -> list[str]:
    """``lenN`` by N, then the prefix-cache requests."""
    names = list(dict.fromkeys(names))
    lens = sorted((n for n in names if n.startswith("len")), key=lambda n: int(n[3:]))
    return lens + [n for n in ("hit-partial", "hit-full") if n in names]
