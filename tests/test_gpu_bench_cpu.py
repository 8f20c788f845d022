"""The CPU mode of scripts/gpu_kv_bench.py (the script that produced docs/gpu_results.md on
the GPU machine): the same planning, staging and copy code over real NIXL between two
processes on host memory.  Every case must be byte-exact, NIXL's descCount must equal what
pdpatch.kv.staging.plans predicts, and the registration policy must hold.  Timings on CPU mean
nothing and are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.nixl
pytest.importorskip("nixl._api")

ROOT = Path(__file__).resolve().parents[1]


def run_bench(out: Path, *args: str) -> dict:
    """The bench's small CPU run (16 KiB blocks, 2 MiB pools) with ``args``; its JSON report."""
    cmd = [sys.executable, "-m", "scripts.gpu_kv_bench", "--device", "cpu",
           "--quick", "--block-kib", "16", "--pool-mib", "2", *args, "--json", str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "cpu.json"
    return run_bench(out, "--write-kib", "16", "--gap-kib", "64")


def test_every_case_is_byte_exact(report) -> None:
    rows = [r for r in report["results"] if "op" in r]
    bad = [(r["case"], r["pattern"], r["mode"], r["error"]) for r in rows if not r["ok"]]
    assert not bad
    seen = {(r["op"], r["case"], r["pattern"], r["mode"].split("/")[0]) for r in rows}
    for op, arrow in (("READ", "<-"), ("WRITE", "->")):
        for case in (f"fused{arrow}fused", f"fused{arrow}split", f"split{arrow}fused"):
            for pattern in ("scattered", "runs4"):
                assert (op, case, pattern, "vllm-ids") in seen
                if case != f"fused{arrow}fused":
                    assert (op, case, pattern, "staged") in seen
                    # the agent the kv_segments patch installs inside vLLM (READ only)
                    assert ((op, case, pattern, "vllm-agent") in seen) == (op == "READ")
                    # ... and with the gap budget it measures itself
                    assert ((op, case, pattern, "vllm-agent+gap") in seen) == (op == "READ")
    assert ("READ", "fused<-split", "runs4", "staged-ids") in seen
    assert ("READ", "split<-fused", "scattered", "staged+gap") in seen
    assert not report.get("section_errors")


def test_nixl_posts_the_predicted_descriptors(report) -> None:
    rows = [r for r in report["results"] if "op" in r]
    def predicted(r) -> bool:
        if r.get("expect_at_most"):      # the agent's gap READs: a span per read range at most
            return 0 < r["nixl_descs"] <= r["expected_nixl_descs"]
        return r["nixl_descs"] == r["expected_nixl_descs"]

    assert all(predicted(r) for r in rows), [
        (r["case"], r["mode"], r["nixl_descs"], r["expected_nixl_descs"]) for r in rows
        if not predicted(r)]

    def row(case, pattern, mode, op="READ"):
        (r,) = [r for r in rows if (r["op"], r["case"], r["pattern"]) == (op, case, pattern)
                and r["mode"].startswith(mode)]
        return r

    for pattern in ("scattered", "runs4"):
        fused = row("fused<-fused", pattern, "whole-blocks")["nixl_descs"]
        # a fused remote: staging posts no more descriptors than the fused path itself
        assert row("split<-fused", pattern, "staged/")["nixl_descs"] <= fused
        # the per-segment conversion never merges anything
        for case in ("split<-fused", "fused<-split"):
            r = row(case, pattern, "vllm-ids")
            assert r["nixl_descs"] == r["descs"]
    # a split remote: staging merges each run of 4 within each K and V pool
    per_seg = row("fused<-split", "runs4", "vllm-ids")["nixl_descs"]
    staged = row("fused<-split", "runs4", "staged/")["nixl_descs"]
    assert 4 * staged <= per_seg
    assert row("fused<-split", "runs4", "staged-ids")["nixl_descs"] == staged
    # gap reads merge scattered blocks too
    assert (row("fused<-split", "scattered", "staged+gap")["nixl_descs"]
            < row("fused<-split", "scattered", "staged/")["nixl_descs"])


def test_gap_budget_is_calibrated_on_the_transport(tmp_path) -> None:
    """Without --gap-kib the bench measures this transport (UCX over host memory here) and
    reads gaps up to TransportCost.gap_budget(); a calibration the noise defeats means no gap
    reads, said in the notes, never a guessed budget."""
    rep = run_bench(tmp_path / "cal.json", "--write-kib", "0", "--cases", "ff", "--patterns",
                    "scattered", "--no-policy", "--no-detect", "--no-warmup")
    (note,) = [n for n in rep["notes"] if "gap" in n]
    gap_rows = [r for r in rep["results"] if "+gap" in r.get("mode", "")]
    if "calibration failed" in note:
        assert not gap_rows
        return
    budget = int(note.rsplit("gap budget ", 1)[1].split()[0])
    assert "TransportCost(desc_cost_s=" in note
    assert all(r["max_gap"] == budget and r["ok"] for r in gap_rows)
    assert bool(gap_rows) == (budget > 0)


def test_registration_policy_on_host_memory(report) -> None:
    (pol,) = report["policy"]
    assert pol["planner_past_plan"].startswith("BlockIdError")
    assert "NIXL_ERR_NOT_FOUND" in pol["sliced_past_plan_read"]
    assert pol["peer_alive_after"] and pol["peer_alive_end"]
    assert pol["valid_read_after"] == "byte-exact"
    assert pol["whole_past_plan_read"].startswith("succeeded")  # why slicing matters
