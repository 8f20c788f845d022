"""The README's patch and settings tables, written from the code that defines them.

The patch table comes from the registry (``pdpatch.patches.all_patches()``: name, toggle, vLLM
releases, summary), the settings table from the declarations in ``pdpatch.config``
(``GLOBAL_SETTINGS``, ``PATCH_OPTIONS``).  Each lives between a pair of marker comments in
README.md; this script replaces what is between them.  ``--check`` changes nothing and exits 1
when the README differs from what would be written (``tests/test_readme.py`` runs it).

    .venv/bin/python -m scripts.doc_tables            # rewrite README.md
    .venv/bin/python -m scripts.doc_tables --check    # exit 1 if README.md has drifted
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab import generated
from pdpatch import config
from pdpatch.patches import all_patches
from pdpatch.versions import VersionRange

ROOT = Path(__file__).resolve().parents[1]

README = ROOT / "README.md"
COMMAND = "scripts/doc_tables.py"


def releases(versions: VersionRange) -> str:
    """``>=0.19,<0.34`` as an operator reads it: 0.19 to 0.33, with an en dash (minors)."""
    low, high = versions.lower(), versions.upper()
    last = f"{high.major}.{high.minor - 1}" if high is not None and high.minor else None
    first = f"{low.major}.{low.minor}" if low is not None else None
    if first and last:
        return first if first == last else f"{first}\N{EN DASH}{last}"
    return f"{first}+" if first else f"up to {last}"


def patch_table() -> str:
    rows = ["| patch | turn off | vLLM | what it does | options |", "|---|---|---|---|---|"]
    for p in all_patches():
        options = ", ".join(f"`{o.var}`" for o in p.options) or "—"
        rows.append(f"| `{p.name}` | `{config.toggle_var(p.name)}=0` | {releases(p.versions)} "
                    f"| {p.summary} | {options} |")
    return "\n".join(rows)


def settings_table() -> str:
    rows = ["| variable | values | default | meaning |", "|---|---|---|---|"]
    for s in (*config.GLOBAL_SETTINGS, *config.PATCH_OPTIONS):
        doc = s.doc + (f" (option of `{s.patch}`)" if s.patch else "")
        rows.append(f"| `{s.var}` | {s.accepted()} | `{s.default or '(none)'}` | {doc} |")
    return "\n".join(rows)


TABLES = {"patches": patch_table, "settings": settings_table}


def render(text: str) -> str:
    """``text`` with every generated block replaced; a missing marker pair is an error."""
    missing = sorted(set(TABLES) - set(generated.names(text, COMMAND)))
    if missing:
        raise SystemExit(f"README.md lacks the generated blocks {', '.join(missing)} "
                         f"({COMMAND})")
    return generated.fill(text, COMMAND, TABLES, "README.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when README.md differs from the generated tables")
    args = parser.parse_args(argv)
    current = README.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print("README.md's generated tables are stale: run "
                  ".venv/bin/python -m scripts.doc_tables", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        README.write_text(wanted)
    return 0
