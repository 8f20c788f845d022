"""The CPU benchmarks' raw records (``docs/bench/*.json``), pooled into cells.

Each record is one run of one bench (``scripts/bench_*.py --record``, written by
:mod:`lab.bench.record`): its command, the vLLM release, the machine and its load, a digest of
the code it measured, every sample and the run's own figures (each a ratio against the baseline
measured in the same run, or a time).  A cell pools every run of one bench with one command
(its options and the environment that changes what it measures), one vLLM release, one machine
and one *code epoch*; a cell's figure is each run's figure, pooled: n runs, their median and
range, and a t-interval (the geometric mean's, with its degrees of freedom) only from three
runs.  Nothing is chosen by value.

The epochs are a reviewed table, ``bench_epochs.json`` beside this module, as
``epochs.json`` is for the GPU runs, one row per bench and change: ``first_run`` (the record's
file name without ``.json``, or null: a change no run has measured yet, which marks the
bench's cells as no longer the current code), ``commit``, ``why``.  A ``change`` row starts a new
cell; a ``kept`` row says why a run whose measured code changed still pools with the runs
before it.  The rows are not left to memory: every record carries the sha256 of the code its
bench measures (``lab.bench.record.CODE``), and a run whose digest differs from the run before
it of its bench (or a bench's first run) must be the ``first_run`` of a row -- until it is, the
report refuses to write, naming the run, the two commits and the file to review.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.bench.record import CODE, FILE_NAME, OUTPUT_ONLY
from lab.report.records import ROOT
from lab.report.stats import Interval, Spread

BENCH_DIR = ROOT / "docs" / "bench"
TABLE = Path(__file__).with_name("bench_epochs.json")
BENCHES = ("activation", "block_keys", "descriptors", "chunked", "first_contact", "pd")
"""The CPU benches in the order the table lists them (every one :data:`CODE` knows)."""
SET_BY_BENCH = frozenset({"VLLM_TARGET_DEVICE", "CUDA_VISIBLE_DEVICES"})
"""Environment variables a bench sets itself (the same in each of its runs): not shown."""


class RecordError(ValueError):
    """A record or a row of the epochs table the report refuses, named."""


@dataclass(frozen=True)
class BenchRun:
    """One record: its run (the file name without ``.json``), bench, day and number, the
    command's options and environment, vLLM release, machine, measured code, load, figures."""

    name: str
    bench: str
    date: str
    n: int
    command: str
    config: tuple[tuple[str, str], ...]
    env: tuple[tuple[str, str], ...]
    vllm: str
    machine: str
    code: str
    commit: str
    dirty: tuple[str, ...]
    load_before: float
    load_after: float
    load_during: tuple[float, ...]
    derived: dict[str, float]
    note: str = ""

    @property
    def order(self) -> tuple[str, str, int]:
        return self.bench, self.date, self.n

    @property
    def short(self) -> str:
        """The run without its bench's name: ``2026-12-05-1``."""
        return f"{self.date}-{self.n}"


def _run(path: Path, d: dict[str, Any]) -> BenchRun:
    m = FILE_NAME.fullmatch(path.name)
    if m is None or d.get("bench") != m["bench"] or m["bench"] not in CODE:
        raise RecordError(f"{path.name}: not a bench record named <bench>-<date>-<n>.json of a "
                          f"known bench (its bench: {d.get('bench')!r})")
    env = tuple(sorted((k, str(v)) for k, v in (d.get("env") or {}).items()))
    args = {k: v for k, v in (d.get("args") or {}).items() if k not in OUTPUT_ONLY}
    config = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in args.items())) + env
    mach = d.get("machine") or {}
    load = d.get("load") or {}
    code = d.get("code") or {}
    return BenchRun(path.stem, m["bench"], m["date"], int(m["n"]), _options(d["command"]),
                    config, env, d.get("vllm", "?"),
                    f"{mach.get('cores')} cores, {mach.get('cpu')}", code.get("sha256", ""),
                    code.get("commit", ""), tuple(code.get("dirty") or ()),
                    float(load["before"][0]), float(load["after"][0]),
                    tuple(float(x) for x in load.get("during") or ()),
                    {k: float(v) for k, v in (d.get("derived") or {}).items()
                     if isinstance(v, (int, float)) and math.isfinite(v)}, d.get("note", ""))


def _options(command: str) -> str:
    """The command as typed, without the options that only say where the record goes."""
    return re.sub(r" --(?:record|json \S+|note (?:'[^']*'|\S+))", "", command)


def load(folder: Path = BENCH_DIR) -> tuple[BenchRun, ...]:
    """Every record in ``folder``, in run order (bench, day, number)."""
    runs = [_run(p, json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]
    return tuple(sorted(runs, key=lambda r: r.order))


@dataclass(frozen=True)
class Change:
    """A reviewed row: the bench, its first run (None: not measured yet), commit, why."""

    bench: str
    first_run: str | None
    commit: str
    why: str


def changes(table: Path | None = None) -> tuple[tuple[Change, ...], tuple[Change, ...]]:
    """The ``change`` and ``kept`` rows of :data:`TABLE`, checked: known benches, kept rows
    measured."""
    table = table or TABLE
    d = json.loads(table.read_text())
    out = []
    for kind in ("change", "kept"):
        rows = tuple(Change(r["bench"], r.get("first_run"), r["commit"], r["why"])
                     for r in d.get(kind, ()))
        for c in rows:
            if c.bench not in CODE:
                raise RecordError(f"{table.name}: {c.commit} names an unknown bench {c.bench!r}")
            if kind == "kept" and c.first_run is None:
                raise RecordError(f"{table.name}: the kept row {c.commit} names no run")
        out.append(rows)
    return out[0], out[1]


class Unreviewed(RecordError):
    """A run measured changed code that no row of the epochs table reviews."""


def epochs(runs: tuple[BenchRun, ...], change: tuple[Change, ...], kept: tuple[Change, ...],
           table: str = "lab/report/bench_epochs.json") -> dict[str, Change]:
    """Each run's epoch (its bench's latest change row at or before it), checked against the
    measured code: a bench's first run, and every run whose code digest differs from the
    previous run's, must be a row's first run; a row must name a recorded run of its bench
    (or none: not measured yet), a kept row only a run whose code did change."""
    names = {r.name: r for r in runs}
    rows: dict[str, tuple[str, Change]] = {}
    for kind, group in (("change", change), ("kept", kept)):
        for c in group:
            if c.first_run is None:
                continue
            r = names.get(c.first_run)
            if r is None or r.bench != c.bench:
                raise RecordError(f"{table}: {c.commit} names {c.first_run!r}, no run of "
                                  f"{c.bench} in docs/bench/")
            if c.first_run in rows:
                raise RecordError(f"{table}: two rows name the run {c.first_run}")
            rows[c.first_run] = (kind, c)
    out: dict[str, Change] = {}
    prev: BenchRun | None = None
    for r in runs:
        if prev is not None and prev.bench != r.bench:
            prev = None
        changed = prev is None or prev.code != r.code
        row = rows.get(r.name)
        if changed and row is None:
            what = (f"measured other code than {prev.name} (the digest of "
                    f"{', '.join(CODE[r.bench])} differs; commits {prev.commit[:7]} -> "
                    f"{r.commit[:7]})" if prev else f"is the first run of {r.bench}")
            raise Unreviewed(f"docs/bench/{r.name}.json {what}: review it in {table}, as a "
                             "change (a new cell) or kept (why it pools with the runs before)")
        if row and row[0] == "kept" and prev is None:
            raise RecordError(f"{table}: the kept row {row[1].commit} names {r.name}, the first "
                              f"run of {r.bench}: a first run starts a cell (a change row)")
        if row and row[0] == "kept" and not changed:
            raise RecordError(f"{table}: the kept row {row[1].commit} names {r.name}, whose "
                              "measured code did not change")
        if row and row[0] == "change":
            out[r.name] = row[1]
        else:
            assert prev is not None
            out[r.name] = out[prev.name]
        prev = r
    return out


@dataclass(frozen=True)
class BenchCell:
    """Every run of one bench, command, vLLM release, machine and code epoch."""

    bench: str
    command: str
    env: tuple[tuple[str, str], ...]
    vllm: str
    machine: str
    epoch: Change
    superseded: tuple[Change, ...]
    runs: tuple[BenchRun, ...]

    def values(self, key: str) -> list[float]:
        return [r.derived[key] for r in self.runs if key in r.derived]

    def spread(self, key: str) -> Spread | None:
        xs = self.values(key)
        return Spread.of(xs) if xs else None

    def interval(self, key: str) -> Interval | None:
        """The runs' geometric mean with its t-interval (None below three runs, or where a
        figure is not a positive quantity)."""
        xs = self.values(key)
        if not xs or min(xs) <= 0 or not all(math.isfinite(x) for x in xs):
            return None
        return Interval.of(xs)

    def names(self) -> list[str]:
        return list(dict.fromkeys(k for r in self.runs for k in r.derived))

    def current(self) -> bool:
        return not self.superseded


def cells(runs: tuple[BenchRun, ...], change: tuple[Change, ...], kept: tuple[Change, ...]
          ) -> tuple[BenchCell, ...]:
    """The runs pooled per (bench, command and environment, vLLM, machine, epoch)."""
    of = epochs(runs, change, kept)
    order = {r.name: i for i, r in enumerate(runs)}
    groups: dict[tuple, list[BenchRun]] = {}
    for r in runs:
        groups.setdefault((r.bench, r.config, r.vllm, r.machine, of[r.name]), []).append(r)
    out = []
    for (bench, _, vllm, machine, start), got in groups.items():
        later = tuple(c for c in change if c.bench == bench and c is not start and (
            c.first_run is None or order[c.first_run] > order[start.first_run]))
        out.append(BenchCell(bench, got[0].command, got[0].env, vllm, machine, start, later,
                             tuple(got)))
    return tuple(sorted(out, key=lambda c: (BENCHES.index(c.bench), c.vllm,
                                            order[c.runs[0].name])))


def stale(runs: tuple[BenchRun, ...], root: Path = ROOT) -> list[str]:
    """Benches whose measured code in the checkout differs from their latest run's: a note
    (re-run it, or mark the change not yet measured), never a failure -- the pages must not
    depend on what is being edited in the working tree."""
    from lab.bench.record import code_digest

    latest = {r.bench: r for r in runs}
    return [b for b, r in latest.items() if code_digest(CODE[b], root)[0] != r.code]


FIGURES: dict[str, tuple[tuple[str, str], ...]] = {
    "activation": (
        ("enabled pdpatch adds ms", "enabled pdpatch adds to `import vllm`: `.pth` at start-up "
         "+ first `vllm` lookup + hook, ms (goal ≤ 20)"),
        ("start-up ms: installed, enabled", "`.pth` at start-up (`python -c pass`, enabled - "
         "not installed), ms"),
        ("first vllm lookup ms", "first `vllm` lookup (wrapt import, hook registered), ms"),
        ("hook ms: installed, enabled", "pdpatch's hook on `vllm`, enabled, ms"),
        ("hook ms: installed, disabled", "pdpatch's hook on `vllm`, installed but disabled, ms"),
        ("import vllm in-child import ms: not installed", "whole `import vllm` (timed in the "
         "child), pdpatch not installed, ms"),
        ("import vllm in-child import: installed, enabled / not installed", "whole `import "
         "vllm`, enabled ÷ not installed"),
        ("import vllm in-child import: installed, disabled / not installed", "whole `import "
         "vllm`, installed but disabled ÷ not installed"),
        ("vLLM submodules imported only because pdpatch is enabled", "vLLM submodules imported "
         "only because pdpatch is enabled"),
    ),
    "block_keys": (
        *((f"{a}: vLLM chain / pdpatch", f"{a}: vLLM's `hash_block_tokens` chain ÷ pdpatch's "
           f"keys{' (goal ≥ 3)' if a.endswith('_cbor') else ''}")
          for a in ("sha256_cbor", "xxhash_cbor", "sha256", "xxhash")),
        *((f"{a}: vLLM chain / pure Python", f"{a}: vLLM's chain ÷ pdpatch without its C "
           "encoder") for a in ("sha256_cbor", "xxhash_cbor", "sha256", "xxhash")),
        (r"path, (?P<n>\d+) tokens: D check / vLLM Request", "{n} tokens: D's check (input "
         "digests) ÷ vLLM's `Request` hashing of the prompt"),
        (r"path, (?P<n>\d+) tokens: P params / vLLM Request", "{n} tokens: P's params at "
         "finish ÷ vLLM's `Request` hashing"),
    ),
    "descriptors": (
        (r"planning per request, (?P<n>\d+) blocks: pdpatch / stock", "planning per request, "
         "{n} blocks: pdpatch's `desc_ids` ÷ vLLM's `_compute_desc_ids` x2 (goal ≤ 1.05)"),
        ("planning per peer: pass-through / stock", "planning per peer: patched pass-through ÷ "
         "vLLM's `_build_fa_remote` (goal ≤ 1.05)"),
        (r"transfers, (?P<p>[^:]+): converted   fused<-split per-segment / unconverted "
         "per-segment", "NIXL READ, {p} blocks: converted (fused ← split) ÷ unconverted, "
         "per-segment descriptors, GB/s"),
        (r"transfers, (?P<p>[^:]+): unconverted fused<-fused coalesced / unconverted "
         "per-segment", "NIXL READ, {p} blocks: coalesced ÷ per-segment descriptors, GB/s"),
    ),
    "chunked": (
        (r"(?P<f>[\d.]+)x staging, (?P<p>[^:]+): per-segment / staged", "{f}x the staging "
         "buffer, {p}: vLLM's per-segment READ time ÷ the staged READ's"),
    ),
    "first_contact": (
        (r"(?P<c>[^:]+): pdpatch / stock", "{c}: first contact (`add_remote_agent` + first "
         "READ), pdpatch ÷ stock"),
        (r"(?P<c>[^:]+): stock ms", "{c}: stock first contact, ms"),
        (r"(?P<c>[^:]+): pdpatch's phases ms", "{c}: pdpatch's phases (planning, staging "
         "setup, first READ planning), ms"),
    ),
    "pd": (
        ("paired TTFT on/off", "TTFT on ÷ off, paired requests' median"),
        ("paired decode tok/s off/on", "decode throughput off ÷ on, paired requests' median"),
        ("outputs identical", "outputs identical on vs off"),
        ("outputs compared", "outputs compared"),
    ),
}
"""Per bench, the figures the table gives (a pattern over the records' ``derived`` names, and
its label); the records keep every other figure and every sample."""
COUNTS = frozenset({"vLLM submodules imported only because pdpatch is enabled",
                    "outputs identical", "outputs compared"})
"""Figures that count (no interval: a geometric mean of counts says nothing)."""



def figures(cell: BenchCell) -> list[tuple[str, str]]:
    """The cell's figures the table gives: (derived name, label), in :data:`FIGURES` order."""
    out: list[tuple[str, str]] = []
    keys = cell.names()
    for pattern, label in FIGURES[cell.bench]:
        for k in keys:
            m = re.fullmatch(pattern, k)
            if m:
                out.append((k, label.format(**m.groupdict())))
    return list(dict.fromkeys(out))
