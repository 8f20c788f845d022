"""vllm#52234 (0.22-0.29): a failed KV receive of a hybrid (HMA) model, from the release's real
decode worker to its real scheduler (``tests/hma_failed_recv_scenarios.py``).  Stock: the
request is promoted as if its KV had arrived and decoded from blocks that never received
anything.  With ``hma_failed_recv``: failed with an error (``kv_load_failure_policy="fail"``)
or its whole prompt computed again (``"recompute"``)."""

from __future__ import annotations

import pytest
import robust_matrix
from scheduler_scenarios import observed, report
from versions_harness import releases_in

from pdpatch import vllm_sites

NAMES = ["hma_fail", "hma_recompute"]
RELEASES = releases_in(vllm_sites.HMA_FAILURE_UNREPORTED)


@pytest.mark.parametrize("ver", RELEASES)
def test_failed_hma_receive_is_failed_not_decoded(ver):
    rep = report("hma_failed_recv_scenarios", NAMES, ver)
    assert rep["status"]["hma_failed_recv"] == "active", rep["status"]
    for name in NAMES:
        stock, patched = observed(rep, "stock", name), observed(rep, "patched", name)
        for obs in (stock, patched):
            assert obs["hma"] and obs["status_waiting"] == "WAITING_FOR_REMOTE_KVS", obs
            assert len(obs["reported_done"]) == 1, obs      # the worker lists it as done
        # stock: promoted with every prompt token counted as received (vllm#52234)
        assert stock["meta"] is None and stock["finished"] == [], stock
        assert stock["computed_after"] == stock["prompt_tokens"], stock
        assert stock["scheduled_tokens_after"] == 1, stock
        assert patched["meta"] == "FailedReceives", patched
    fail = observed(rep, "patched", "hma_fail")
    assert [reason for _, reason in fail["finished"]] == ["error"], fail
    assert fail["status_after"] is None, fail                 # finished and gone
    again = observed(rep, "patched", "hma_recompute")
    assert again["finished"] == [], again
    # computed again from its first token
    assert again["scheduled_tokens_after"] == again["prompt_tokens"], again


@pytest.mark.parametrize("ver", RELEASES)
def test_channel_takes_a_request_mid_read_after_its_reads(ver):
    """Another patch failing an HMA request whose READs are posted (``fail_alone``): stock has
    no channel (the request is reported loaded); patched, it is named failed once its READs
    are done, never while they may still write into its blocks."""
    stock, patched = robust_matrix.stock_and_patched(ver, "hma_fail_in_flight",
                                                     "hma_failed_recv")
    for obs in (stock, patched):
        assert obs["crash"] is None and obs["in_flight"], obs
        assert "r" in obs["done"] and "r" in obs["reads"], obs
        assert not set(obs["invalid_blocks"]), obs
    assert not stock["taken"] and stock["worker_meta"] is None, stock
    assert patched["taken"] and patched["worker_meta"] == ["r"], patched
