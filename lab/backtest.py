"""Backtest of "patches whose vLLM code did not change stay on by themselves" on vLLM's history.

For each transition A -> B between consecutive supported minors (0.19 -> 0.20 ... 0.33 ->
0.34), pretend A is the newest release pdpatch verified: a patch in force on A applies by itself
on B where every site it rests on, as declared for A (:meth:`pdpatch.registry.Patch.sites`),
is identical in B's source (:mod:`pdpatch.verified`).  Then ask whether that was right:

* **verified for B**: the patch is declared for B today, so B's do-no-harm gate and per-release
  scenarios run with it on (``docs/upstream_suites.md``, the version-matrix tests);
* **harmful**: turned on by fingerprints but not declared for B (its range ended there: vLLM
  fixed the fault, or changed what it rests on).  The goal is none.
* **judged** (``--judge``): B's own connector tests (its sdist), stock vs pdpatch reading A as
  the installed release with only the patches the fingerprints kept on, compared test by test.

    .venv/bin/python -m scripts.backtest            # the static table
    .venv/bin/python -m scripts.backtest --judge --write   # with B's tests; into docs/

``tests/test_backtest.py`` checks the static part in every CI run: a declaration narrowed so
that a patch vLLM made unneeded would be turned on fails it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from lab import site_fingerprints
from lab.env import cache_dir
from lab.upstream import suites
from pdpatch import verified
from pdpatch.patches import all_patches
from pdpatch.site_sources import SourceTree

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "backtest.md"
WORK = cache_dir() / "backtest"


@dataclass
class Transition:
    old: str
    new: str
    in_force: list[str] = field(default_factory=list)     # patches declared for the old one
    kept: list[str] = field(default_factory=list)         # ... whose sites are unchanged
    harmful: list[str] = field(default_factory=list)      # kept, but not declared for new
    changed: dict[str, list[str]] = field(default_factory=dict)   # kept off: what changed
    judged: str = ""                                       # B's connector tests, if run

    @property
    def share(self) -> float:
        return len(self.kept) / len(self.in_force) if self.in_force else 0.0


def transitions(trees: dict[str, Path] | None = None) -> list[Transition]:
    """Every consecutive pair of verified releases, with what the fingerprints decide."""
    trees = trees or site_fingerprints.verified_trees()
    releases = list(trees)
    parsed = {r: SourceTree(trees[r]) for r in releases}
    out = []
    for old, new in itertools.pairwise(releases):
        t = Transition(old, new)
        for patch in all_patches():
            if Version(old) not in patch.versions:
                continue
            t.in_force.append(patch.name)
            differ = [verified.label(m, q) for m, q in patch.sites(Version(old))
                      if parsed[old].fingerprint(m, q) != parsed[new].fingerprint(m, q)]
            if differ:
                t.changed[patch.name] = differ
                continue
            t.kept.append(patch.name)
            if Version(new) not in patch.versions:
                t.harmful.append(patch.name)
        out.append(t)
    return out


def judge(t: Transition) -> str:
    """B's connector tests, stock vs the kept-on patches as declared for A."""
    if not t.kept:
        return "nothing kept on"
    settings = {"PDLAB_GATE_PRETEND_VLLM": t.old, "PDPATCH_DISABLE": "*",
                **{f"PDPATCH_{n.upper()}": "1" for n in t.kept}}
    runs = suites.run_release(t.new, WORK / f"{t.old}-{t.new}", settings=settings)
    v = suites.compare(t.new, runs["stock"], runs["pdpatch"], suites.read_differences())
    s, p = v.stock.counts(), v.pdpatch.counts()
    lost = f"lost {len(v.lost)}: {', '.join(v.lost)}" if v.lost else "lost none"
    return (f"{s['passed']} / {p['passed']} passed ({len(v.pdpatch.applied)} applied), {lost}"
            if v.compared else "nothing applied: not compared")


def render(rows: list[Transition], judged: bool) -> str:
    lines = [
        "# Backtest: which patches fingerprints keep on across vLLM's releases",
        "",
        "For each transition A -> B, A is taken as the newest release pdpatch verified: a patch "
        "in force on A stays on in B by itself where every vLLM site it rests on (as declared "
        "for A) is unchanged in B's source.  *Verified for B*: declared for B today, so B's "
        "do-no-harm gate and per-release scenarios run with it on.  *Harmful*: kept on but "
        "not declared for B (its range ended: vLLM fixed the fault or changed what it rests "
        "on).  " + ("*B's tests*: vLLM B's own connector tests (its sdist), stock / with only "
                    "the kept-on patches, pdpatch reading A as the installed release."
                    if judged else ""),
        "",
        "Generated by `python -m scripts.backtest" + (" --judge" if judged else "")
        + " --write` (`lab/backtest.py`); the static part is checked by "
        "`tests/test_backtest.py` in every CI run.",
        "",
        "| A -> B | in force on A | kept on in B | share | verified for B | harmful |"
        + (" B's tests: stock / pdpatch |" if judged else ""),
        "|---|---|---|---|---|---|" + ("---|" if judged else ""),
    ]
    for t in rows:
        verified_b = [n for n in t.kept if n not in t.harmful]
        lines.append(
            f"| {t.old} -> {t.new} | {len(t.in_force)} | "
            + (", ".join(f"`{n}`" for n in t.kept) or "none")
            + f" | {len(t.kept)}/{len(t.in_force)} ({t.share:.0%}) | {len(verified_b)} | "
            + (", ".join(t.harmful) or "none") + " |"
            + (f" {t.judged} |" if judged else ""))
    total_kept = sum(len(t.kept) for t in rows)
    total = sum(len(t.in_force) for t in rows)
    harmful = sum(len(t.harmful) for t in rows)
    lines += ["", f"Over {len(rows)} transitions: {total_kept} of {total} patch-transitions kept "
              f"on ({total_kept / total:.0%}), {harmful} harmful."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--judge", action="store_true",
                    help="also run B's connector tests with the kept-on patches")
    ap.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    rows = transitions()
    if args.judge:
        for t in rows:
            t.judged = judge(t)
            print(f"{t.old} -> {t.new}: {t.judged}", flush=True)
    text = render(rows, args.judge)
    print(text)
    if args.write:
        DOC.write_text(text)
        print(f"wrote {DOC}")
    return 1 if any(t.harmful for t in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
