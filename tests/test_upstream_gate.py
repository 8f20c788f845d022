"""The do-no-harm gate's verdict: it passes only when pdpatch was in force in its "pdpatch" run
and lost nothing; a run in which no patch applied compared stock with stock and must fail
(on vLLM 0.34.0 before pdpatch verified it, every patch was off and the gate printed PASS)."""

from __future__ import annotations

import json

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
