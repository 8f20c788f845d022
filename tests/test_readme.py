"""The README's patch and settings tables are the registry's and the declarations' own text
(``python -m scripts.doc_tables`` writes them; ``--check`` is what this test asks)."""

from __future__ import annotations

from pathlib import Path

from lab import doc_tables

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_are_generated_from_the_code():
    assert doc_tables.main(["--check"]) == 0        # it says what to run when not
    text = (ROOT / "README.md").read_text()
    drifted = text.replace("| `peer_check` |", "| `peer_check_old` |", 1)
    assert drifted != text and doc_tables.render(drifted) == text


def test_every_patch_has_its_detail_row_in_docs_patches():
    from pdpatch.patches import patch_names

    detail = (ROOT / "docs" / "patches.md").read_text()
    assert [n for n in patch_names() if f"| `{n}` | `PDPATCH_{n.upper()}` |" not in detail] == []
