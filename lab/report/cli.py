"""The report's command line: print every block, write them into the pages, or check them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab import generated
from lab.report import bench
from lab.report.records import ROOT
from lab.report.tables import BLOCKS, Data

COMMAND = "python -m lab.report"


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that may hold blocks: the README and every page of ``docs/`` (not its
    archive, which keeps the sessions' own text as it was written)."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def render(text: str, data: Data, where: str) -> str:
    """``text`` with every block of the report's in it written from ``data``."""
    makers = {name: (lambda make=make: make(data)) for name, make in BLOCKS.items()}
    return generated.fill(text, COMMAND, makers, where)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the pages' blocks")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when a page's blocks differ from what would be written")
    args = ap.parse_args(argv)
    try:
        data = Data.load()
    except bench.RecordError as e:     # a record or a row of the epochs table it refuses
        print(f"{COMMAND}: {e}", file=sys.stderr)
        return 1
    moved = bench.stale(data.bench_runs)
    if moved:
        print(f"note: the code {', '.join(f'bench_{b}' for b in moved)} measure(s) differs in "
              "this checkout from their latest run's in docs/bench/ (lab.bench.record.CODE): "
              "their figures are that code's; re-run them, or list the change as not yet "
              "measured in lab/report/bench_epochs.json", file=sys.stderr)
    if not (args.write or args.check):
        for name, make in BLOCKS.items():
            print(f"## {name}\n\n{make(data)}\n")
        return 0
    now = {p: p.read_text() for p in pages()}
    unused = set(BLOCKS) - {n for text in now.values() for n in generated.names(text, COMMAND)}
    if unused:
        print(f"no page holds the block(s) {', '.join(sorted(unused))}", file=sys.stderr)
        return 1
    stale = [p for p, text in now.items() if render(text, data, p.name) != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)}: its measured figures differ from the raw records: "
                  f"run {COMMAND} --write", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(render(now[p], data, p.name))
    return 0
