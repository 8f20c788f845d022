"""The README's patch and settings tables are the registry's and the declarations' own text
(``python -m scripts.doc_tables`` writes them; ``--check`` is what this test asks), and
docs/patches.md's hand-written table names every patch with the registry's vLLM range."""

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


def _docs_range_drift(detail: str) -> dict[str, tuple[str | None, str]]:
    """Patch -> (docs/patches.md's vLLM cell, the registry's range as the README renders it),
    for every patch whose row is missing or says another range."""
    from pdpatch import config
    from pdpatch.patches import all_patches

    drift = {}
    for p in all_patches():
        head = f"| `{p.name}` | `{config.toggle_var(p.name)}` |"
        row = next((line for line in detail.splitlines() if line.startswith(head)), None)
        cell = row[len(head):].split("|", 1)[0].strip() if row is not None else None
        want = doc_tables.releases(p.versions)
        if cell != want:
            drift[p.name] = (cell, want)
    return drift


def test_docs_patches_ranges_are_the_registrys():
    """The vLLM column of docs/patches.md is written by hand and drifted before (12 rows ended
    below the registry's 0.34): each row must say what the registry declares, rendered as the
    README's generated table renders it (``lab.doc_tables.releases``)."""
    detail = (ROOT / "docs" / "patches.md").read_text()
    assert _docs_range_drift(detail) == {}
    from pdpatch import config
    from pdpatch.patches import all_patches

    first = all_patches()[0]                    # the check sees a drifted row
    head = f"| `{first.name}` | `{config.toggle_var(first.name)}` |"
    want = doc_tables.releases(first.versions)
    drifted = detail.replace(f"{head} {want} |", f"{head} 0.19\N{EN DASH}0.20 |", 1)
    assert drifted != detail
    assert _docs_range_drift(drifted) == {first.name: ("0.19\N{EN DASH}0.20", want)}
