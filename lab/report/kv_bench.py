"""The K/V transfer bench's raw output (``scripts/gpu_kv_bench.py``, ``docs/gpu_runs/*.txt``),
read back into its measurements.

The bench prints one line per READ it timed::

    sparse    READ  fused<-split  vllm-agent+gap    descs  16384 -> NIXL      8 (exp      8)
        45.04 GB/s  x9.08 of fused  ...

under a section naming the pool and the block size (``== cuda 16 KiB: ...``).  A *cell* is one
pattern of one section of one file, in one direction; its baseline is the same-layout READ of
whole blocks (``fused<-fused whole-blocks``, "x1.00 of fused") and vLLM's own per-segment READ
of the conversion (``vllm-ids``) in the same cell.  The files of one series (``NAME-runN.txt``)
ran the same tree.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lab.report.records import ROOT
from lab.report.stats import Spread

RUNS_DIR = ROOT / "docs" / "gpu_runs"
SECTION = re.compile(r"== (?P<pool>\w+) (?P<block>\d+ KiB): (?P<shape>.*)")
READ = re.compile(r"\s+(?P<pattern>\w+)\s+READ\s+(?P<dir>\w+<-\w+)\s+(?P<mode>\S+)\s+descs.*?"
                  r"\s(?P<gbs>[\d.]+) GB/s\s+x(?P<fused>[\d.]+) of fused")
CONVERTED = ("fused<-split", "split<-fused")


@dataclass(frozen=True)
class Read:
    """One timed READ: its file's series and file, the cell it belongs to, its mode, its
    bandwidth and its ratio to the cell's fused path."""

    series: str
    file: str
    cell: tuple[str, str, str, str]       # pool, block and shape, pattern, direction
    mode: str
    gb_s: float
    x_fused: float


def load(folder: Path = RUNS_DIR) -> list[Read]:
    out: list[Read] = []
    for path in sorted(folder.glob("*.txt")):
        series = re.sub(r"-run\d+$", "", path.stem)
        section = ("", "")
        for line in path.read_text().splitlines():
            if m := SECTION.fullmatch(line):
                section = (m["pool"], f"{m['block']}: {m['shape']}")
            elif m := READ.match(line):
                out.append(Read(series, path.name, (*section, m["pattern"], m["dir"]),
                                m["mode"], float(m["gbs"]), float(m["fused"])))
    return out


@dataclass(frozen=True)
class Row:
    """One mode of the converted READs in one series: its cells, how many reached 0.9 of the
    fused path, and its ratios to the fused path and to vLLM's per-segment READ."""

    series: str
    mode: str
    files: int
    cells: int
    at_least_0_9: int
    x_fused: Spread
    x_vllm: Spread | None


def rows(reads: list[Read]) -> list[Row]:
    vllm = {(r.file, r.cell): r.gb_s for r in reads if r.mode == "vllm-ids"}
    groups: dict[tuple[str, str], list[Read]] = {}
    for r in reads:
        if r.cell[3] in CONVERTED:
            groups.setdefault((r.series, r.mode), []).append(r)
    out = []
    for (series, mode), got in groups.items():
        over = [r.gb_s / vllm[r.file, r.cell] for r in got
                if mode != "vllm-ids" and vllm.get((r.file, r.cell))]
        out.append(Row(series, mode, len({r.file for r in got}), len(got),
                       sum(r.x_fused >= 0.9 for r in got), Spread.of([r.x_fused for r in got]),
                       Spread.of(over) if over else None))
    return out
