"""Which runs measured the same code: the reviewed table the report pools by.

A figure pools every run of its configuration on one code path, never the best or the oldest.
So each run of a scenario belongs to an *epoch*: the runs since the last change of the code its
requests went through.  What a request goes through is a set of *paths* (:func:`paths_of`); a
:class:`Change` names the first run that measured it, the commit, the paths it touched and why
it could move the figures.  A run's epoch for a set of paths is the last change touching any of
them at or before it; a cell whose paths a later change touched is no longer the current code
(the report says so), and where no run measured that change yet, the cell has no successor.

The table is ``epochs.json`` beside this module (data, reviewed like code).  A ``change`` row: a
change of the code a measured request goes through; ``first_run``, the first run that measured
it; ``commit``; ``paths``, which of the paths below it touched; ``from_release`` /
``to_release``, the vLLM releases it applies to where not all; ``why``, what it changed that could
move the figures.  Rows in run order; commits between two runs that only refactor, log, or touch
releases or paths no cell runs are not listed; a change no run has measured yet is listed with
the first run after it, so that the cells before it say their code has changed since.

A ``kept`` row is a change on a measured path that does *not* start a new cell, with why, so
that the judgement is as visible as the boundaries.  Those there are on the request path the
TTFT starts since run bg ran through: each moves a step or a request by far less than one start
resolves (+-3-4 % of TTFT; the step clock of runs bk-br: pdpatch's wrappers ~35-45 us of a ~16 ms
step), so the starts since bg measure one path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from lab.gpu.pd import SCENARIOS
from lab.report.records import run_order

REQUEST = "request"       # every pdpatch request: block_keys, the guards, metrics' stats
STAGED = "staged"         # READs through pdpatch's staging agent (converted or coalesced)
COALESCED = "coalesced"   # PDPATCH_KV_COALESCE=1 on D
HEAD_SLICES = "head-slices"   # staged READs of head slices (D's TP larger than P's)
KVCACHED = "kvcached"     # D's KV in a kvcached pool
REORDER = "reorder"       # a token-major D that reorders what a head-major P sends


def paths_of(scenario: str, release: str) -> frozenset[str]:
    """The code paths a scenario's requests go through on ``release`` (none for a stock pair).
    Staging serves converted peers on 0.19-0.25 (a kvcached D's split-half cache, mixed
    backends' layouts) and, opted in, same-layout peers on every release."""
    sc = SCENARIOS[scenario]
    if not sc.pdpatch:
        return frozenset()
    paths = {REQUEST}
    converted = sc.d_kvcached or sc.p_backend != sc.d_backend
    if sc.d_env.get("PDPATCH_KV_COALESCE") == "1":
        paths |= {STAGED, COALESCED}
    elif converted and Version(release) < Version("0.26"):
        paths.add(STAGED)
    if STAGED in paths and sc.d_tp > sc.p_tp:
        paths.add(HEAD_SLICES)
    if sc.d_kvcached:
        paths |= {KVCACHED, REORDER}
    if sc.d_env.get("PDPATCH_LAYOUT_FORCE") == "1":
        paths.add(REORDER)
    return frozenset(paths)


@dataclass(frozen=True)
class Change:
    """A change of the measured code: the first run on it, the commit, what it touched and why
    it could move the figures; ``releases`` (lowest, highest or None) where it applies."""

    first_run: str
    commit: str
    paths: frozenset[str]
    why: str
    releases: tuple[str | None, str | None] = (None, None)

    def applies(self, paths: frozenset[str], release: str) -> bool:
        low, high = self.releases
        v = Version(release)
        return bool(self.paths & paths) and (low is None or v >= Version(low)) and \
            (high is None or v <= Version(high))


PATHS = frozenset({REQUEST, STAGED, COALESCED, HEAD_SLICES, KVCACHED, REORDER})
TABLE = Path(__file__).with_name("epochs.json")


def _changes(kind: str) -> tuple[Change, ...]:
    """The ``kind`` rows of :data:`TABLE`, checked: known paths, in run order."""
    rows = json.loads(TABLE.read_text())[kind]
    out = tuple(Change(r["first_run"], r["commit"], frozenset(r["paths"]), r["why"],
                       (r.get("from_release"), r.get("to_release"))) for r in rows)
    for c in out:
        if not c.paths <= PATHS:
            raise ValueError(f"{TABLE.name}: {c.commit} names unknown paths "
                             f"{sorted(c.paths - PATHS)}")
    if [run_order(c.first_run) for c in out] != sorted(run_order(c.first_run) for c in out):
        raise ValueError(f"{TABLE.name}: the {kind} rows are not in run order")
    return out


CHANGES = _changes("change")
"""Every change that starts a new cell, in run order."""
KEPT = _changes("kept")
"""Changes on a measured path kept inside their epoch, each with why."""

STOCK_FROM = {"s": "t", "ce": "by", "dj": "dk"}
"""Runs made without a stock pair of their own, and the run of the same release, model, prompt
lengths and GPUs whose stock pair they were made against (the seeded model and prompts are the
same wherever those are): s (a kvcached D under load) against t (the stock pair under the same
load), ce (a kvcached D at TP 1 -> 2 and 2 -> 1) against by (whose kvcached D could not start),
dj (a kvcached D) against dk: each of dj and dk hit its time limit after its first pair."""


def epoch(run: str, paths: frozenset[str], release: str) -> tuple[Change, ...]:
    """The changes that began ``run``'s epoch on ``paths`` (the latest first run at or before
    ``run`` among the changes touching them; empty: before every listed change)."""
    touching = [c for c in CHANGES if c.applies(paths, release)
                and run_order(c.first_run) <= run_order(run)]
    if not touching:
        return ()
    last = max(run_order(c.first_run) for c in touching)
    return tuple(c for c in touching if run_order(c.first_run) == last)


def superseded(start: tuple[Change, ...], paths: frozenset[str], release: str
               ) -> tuple[Change, ...]:
    """The changes after the epoch that began with ``start`` that touch its paths: the cell is
    the current code only where there are none."""
    after = run_order(start[0].first_run) if start else (0, "")
    return tuple(c for c in CHANGES if c.applies(paths, release)
                 and run_order(c.first_run) > after)
