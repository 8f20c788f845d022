"""Issue 7, bug 3: with MLA and prefill TP > decode TP, vLLM 0.19/0.20 notify the prefill ranks
they did not read from under the *decode* request id, so those ranks never free the blocks
(until the lease expires).  Real code on both sides: the decode worker reads from prefill rank 0,
and the notification it sends is delivered to a real prefill rank-1 worker that holds the
request's blocks (``tests/robust_worker.py::scenario_mla_notif``)."""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

BUGGY = [v for v in robust_matrix.OLD_RELEASES if v != "<none>" and Version(v) < Version("0.21")]


def assert_leak(obs: dict) -> None:
    assert obs["use_mla"] and obs["crash"] is None, obs
    assert obs["reads"] == [{"remote": obs["reads"][0]["remote"], "notif": "p-req:1"}]
    assert obs["notifs_sent"] == [["P1", "d-req:1"]], obs
    assert obs["p1_done_sending"] == [] and obs["p1_still_holding"] == ["p-req"], obs


def assert_released(obs: dict) -> None:
    assert obs["use_mla"] and obs["crash"] is None, obs
    assert obs["notifs_sent"] == [["P1", "p-req:1"]], obs
    assert obs["p1_done_sending"] == ["p-req"] and obs["p1_still_holding"] == [], obs


@pytest.mark.parametrize("ver", BUGGY or ["<none>"])
def test_mla_notification_uses_prefill_request_id(ver):
    if ver == "<none>":
        pytest.skip("no 0.19/0.20 source tree extracted (scripts/fetch_vllm_sources.sh)")
    assert_leak(robust_matrix.scenario(ver, "stock", "mla_notif"))
    rep = robust_matrix.report(ver)
    assert rep["status"]["mla_notif"] == "active", rep["summary"]
    assert_released(robust_matrix.scenario(ver, "patched", "mla_notif"))


@pytest.mark.parametrize("ver", ["0.21.0"])  # a release parameter: runs with 0.21.0's group
def test_mla_notif_skipped_where_fixed_upstream_0_21(ver):
    if ver not in robust_matrix.OLD_RELEASES:
        pytest.skip("0.21.0 source tree not extracted")
    assert_released(robust_matrix.scenario(ver, "stock", "mla_notif"))
    rep = robust_matrix.report(ver)
    assert rep["status"]["mla_notif"] == "skipped"
    assert ("mla_notif (vLLM 0.21.0 outside <0.21,>=0.19: fixed upstream in vLLM 0.21.0"
            in rep["summary"]), rep["summary"]
    assert_released(robust_matrix.scenario(ver, "patched", "mla_notif"))


def test_mla_notif_skipped_on_installed(fresh_pdpatch):
    assert_released(rw.scenario_mla_notif())
    states = fresh_pdpatch.install()
    assert states["mla_notif"].status == "skipped"
    assert "fixed upstream in vLLM 0.21.0" in fresh_pdpatch.summary_line()
