"""vllm#42895's family (0.23-0.26): a Mamba hybrid with prefix caching and speculative decoding
kills the decode worker on every P/D request ("SSM can only have one local block"); with
pdpatch, ``read_guard`` fails the request through ``hma_failed_recv``'s worker -> scheduler
channel, and D's scheduler fails it with an error or computes it again
(``kv_load_failure_policy``).  The lists are the releases' own schedulers'; the worker and
scheduler the releases' own (``tests/ssm_prefix_scenarios.py``)."""

from __future__ import annotations

import pytest
from packaging.specifiers import SpecifierSet
from scheduler_scenarios import observed, report
from versions_harness import releases_in

NAMES = ["ssm_fail", "ssm_recompute"]
#: The releases whose decode worker asserts one local SSM block (0.23.0 worker.py L2344 ...
#: 0.26.0 base_worker.py L2293); 0.27 clips speculative slots on both sides and pairs the rest.
SSM_ONE_LOCAL_BLOCK = SpecifierSet(">=0.23,<0.27")
RELEASES = releases_in(SSM_ONE_LOCAL_BLOCK)


@pytest.mark.parametrize("ver", RELEASES)
def test_ssm_speculative_prefix_read_fails_the_request_not_the_worker(ver):
    rep = report("ssm_prefix_scenarios", NAMES, ver)
    assert rep["status"]["read_guard"] == "active", rep["status"]
    assert rep["status"]["hma_failed_recv"] == "active", rep["status"]
    for name in NAMES:
        stock, patched = observed(rep, "stock", name), observed(rep, "patched", name)
        for obs in (stock, patched):
            # the schedulers' lists: D holds the running state and two speculative slots, P
            # sends nulls, its running state and its speculative slots
            assert len(obs["local_ssm"]) == 3 and 0 not in obs["local_ssm"], obs
            assert len(obs["remote_ssm"]) > 3 and obs["remote_ssm"][0] == 0, obs
        # stock: the assert escapes start_load_kv on the model-runner thread (the worker dies)
        assert stock["crash"] == "AssertionError: SSM can only have one local block", stock
        assert patched["crash"] is None, patched
        assert "id-1" not in patched["reads"], patched          # nothing read into D's blocks
        assert patched["worker_meta"] == ["id-1"], patched
        # one error line, which says what to change
        [line] = [m for m in patched["logged"] if "[read_guard" in m]
        assert "SSM can only have one local block" in line, line
        assert "without speculative decoding" in line and "0.27" in line, line
    fail = observed(rep, "patched", "ssm_fail")
    assert fail["finished"] == [["id-1", "error"]], fail
    assert fail["status_after"] is None, fail
    again = observed(rep, "patched", "ssm_recompute")
    assert again["finished"] == [] and again["status_after"] == "RUNNING", again
    # computed again from its first token (one chunk of "align" mode's block multiples)
    assert 0 < again["scheduled_tokens_after"] == again["computed_after"] \
        <= again["prompt_tokens"], again
