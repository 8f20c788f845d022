"""The README's patch and settings tables are the registry's and the declarations' own text
(``scripts/doc_tables.py`` writes them; ``--check`` is what this test asks)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _doc_tables():
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "scripts/doc_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tables_are_generated_from_the_code():
    doc_tables = _doc_tables()
    assert doc_tables.main(["--check"]) == 0        # it says what to run when not
    text = (ROOT / "README.md").read_text()
    drifted = text.replace("| `peer_check` |", "| `peer_check_old` |", 1)
    assert drifted != text and doc_tables.render(drifted) == text


def test_every_patch_has_its_detail_row_in_docs_patches():
    from pdpatch.patches import patch_names

    detail = (ROOT / "docs" / "patches.md").read_text()
    assert [n for n in patch_names() if f"| `{n}` | `PDPATCH_{n.upper()}` |" not in detail] == []
