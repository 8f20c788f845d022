"""The do-no-harm gate's verdict: it passes only when pdpatch was in force in its "pdpatch" run
and lost nothing; a run in which no patch applied compared stock with stock and must fail
(on vLLM 0.34.0 before pdpatch verified it, every patch was off and the gate printed PASS).
And ``record``: the results table of docs/upstream_suites.md stays one table when the header
gains a column (rows recorded before it say "not recorded" there)."""

from __future__ import annotations

import json

import pytest

from lab.upstream import suites

PASSED = {"t.py::a": "passed", "t.py::b": "passed", "t.py::c": "failed"}


def verdict(pdpatch_outcomes: dict[str, str], applied: list[str]) -> suites.Verdict:
    stock = suites.SuiteRun("stock", dict(PASSED))
    patched = suites.SuiteRun("pdpatch", pdpatch_outcomes, applied=applied)
    return suites.compare("9.9.0", stock, patched, [])


def test_equal_outcomes_with_patches_in_force_pass():
    v = verdict(dict(PASSED), ["read_guard"])
    assert v.ok and v.compared
    assert "pdpatch applied 1 patch(es): read_guard" in suites.describe(v)


def test_a_run_with_no_patch_in_force_compared_nothing_and_fails():
    v = verdict(dict(PASSED), [])
    assert not v.compared and not v.ok
    text = suites.describe(v)
    assert "NOTHING WAS COMPARED" in text and "verdict: FAIL (nothing compared)" in text


def test_a_test_lost_with_pdpatch_fails_naming_it():
    v = verdict({**PASSED, "t.py::b": "failed"}, ["read_guard"])
    assert not v.ok and v.lost == ["t.py::b"]


def test_the_plugin_record_names_the_patches_in_force(tmp_path):
    record = tmp_path / "s.json"
    record.write_text(json.dumps({"installed": True, "active": ["a", "b"], "skipped": {}}))
    assert suites.applied_patches(record) == ["a", "b"]
    assert suites.applied_patches(tmp_path / "absent.json") == []


OLD_TABLE = """# Upstream suites

intro

## Results

Rows from runs with `--record`.

| vLLM | tests | stock passed | pdpatch passed | lost with pdpatch | deliberate \
| gained with pdpatch | verdict | last run |
|---|---|---|---|---|---|---|---|---|
| 0.19.1 | 96 | 89 | 89 | 0 | 0 | 0 | pass | 2026-11-28 |
| 0.33.0 | 763 | 760 | 760 | 0 | 0 | 0 | pass | 2026-11-27 |

## Deliberate differences

| release | test | reason |
|---|---|---|
"""


def _row(release: str, applied: int) -> dict[str, object]:
    return {"release": release, "tests": 852, "stock": {"passed": 848},
            "pdpatch": {"passed": 848}, "applied": [f"p{i}" for i in range(applied)],
            "lost": [], "deliberate": [], "gained": [], "ok": True, "run": "2026-12-06"}


def _results(text: str) -> list[list[str]]:
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]


def test_record_merges_a_table_recorded_before_the_patches_applied_column(tmp_path):
    """A results table of 9 columns (before "patches applied") and a new 10-column row: one
    table of 10 columns, the old rows' cells under their own column names and "not recorded"
    under the new one, the rest of the file untouched; recording again changes nothing."""
    doc = tmp_path / "upstream_suites.md"
    doc.write_text(OLD_TABLE)
    suites.record([_row("0.34.0", 19)], doc)
    text = doc.read_text()
    header, rule, *rows = _results(text)
    assert header == [c.strip() for c in suites.RESULTS_HEADER.splitlines()[0].strip("|")
                      .split("|")]
    assert len(header) == len(rule) == 10 and header[2] == "patches applied"
    assert [len(r) for r in rows] == [10, 10, 10]
    assert rows[0] == ["0.19.1", "96", suites.NOT_RECORDED, "89", "89", "0", "0", "0",
                       "pass", "2026-11-28"]
    assert rows[1][:4] == ["0.33.0", "763", suites.NOT_RECORDED, "760"]
    assert rows[2] == ["0.34.0", "852", "19", "848", "848", "0", "0", "0", "pass",
                       "2026-12-06"]
    assert text.split("## Results")[0] == OLD_TABLE.split("## Results")[0]
    assert "Rows from runs with `--record`.\n\n| vLLM |" in text
    assert text.endswith(OLD_TABLE[OLD_TABLE.index("## Deliberate"):])

    suites.record([], doc)
    assert doc.read_text() == text
    suites.record([_row("0.33.0", 18)], doc)     # a newer run of a kept release replaces it
    assert _results(doc.read_text())[3][:4] == ["0.33.0", "852", "18", "848"]


def test_record_refuses_a_row_that_does_not_fit_its_header(tmp_path):
    doc = tmp_path / "upstream_suites.md"
    doc.write_text(OLD_TABLE.replace("| 0.19.1 | 96 |", "| 0.19.1 |", 1))
    with pytest.raises(ValueError, match="8 cells under a header of 9"):
        suites.record([_row("0.34.0", 19)], doc)
    assert doc.read_text() == OLD_TABLE.replace("| 0.19.1 | 96 |", "| 0.19.1 |", 1)


def test_docs_results_table_is_what_record_writes(tmp_path):
    """docs/upstream_suites.md's results table is one table of the current header's columns:
    recording nothing into a copy of it changes nothing."""
    doc = tmp_path / "upstream_suites.md"
    doc.write_text(suites.DIFFERENCES.read_text())
    suites.record([], doc)
    assert doc.read_text() == suites.DIFFERENCES.read_text()
    header, *rows = _results(doc.read_text())
    assert {len(r) for r in rows} == {len(header)}
