"""A prompt the decode engine holds entirely in its prefix cache, whose prefill engine is gone
(issue 25, case 4).  The receive the release's real scheduler half queues for it has no local
blocks -- the worker only owes P the notification that frees P's blocks -- and the scheduler
never parks the request on it.  The release's real ZMQ handshake to the dead engine times out
(5 s); the worker must survive and must not report the request as finished or failed
receiving: the release's real ``Scheduler._update_from_kv_xfer_finished`` asserts on such a
report and the engine core dies.  A request to a live peer afterwards must be served.

Per release, stock (``tests/robust_worker.py::scenario_full_hit_dead_peer``):

* 0.19-0.29, one KV-cache group: the failure callback raises IndexError on the empty block
  ids (inside the future's callback, logged and swallowed) before it lists the request as
  failed: nothing is reported, the worker serves on -- the release's own outcome, untouched.
* 0.19-0.21, HMA: the request is listed failed and ``get_finished`` looks the unknown engine
  up: ``KeyError``, the worker dies.
* 0.22-0.29, HMA: the request is reported finished receiving: the scheduler's assertion
  stops the engine core.
* 0.30-0.34: the receive is flagged ``awaiting_kvs=False`` and never stored: clean.

``handshake_failure_guard`` (0.19-0.29) leaves such a receive unreported, as 0.30 does.
"""

from __future__ import annotations

import queue

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import vllm_sites

SCENARIOS = ("full_hit_dead_peer", "full_hit_dead_peer_hma")


def assert_clean(obs: dict, version: Version) -> None:
    """The request runs on unreported, the worker survives and serves the next request."""
    assert obs["crash"] is None, obs
    assert obs["handshake_errors"] and obs["handshake_errors"][0].startswith("Again"), obs
    assert obs["parked"] is False and obs["local_block_ids"] == [], obs
    assert obs["reported"] == [] and obs["scheduler"] is None, obs
    assert obs["after"]["done_recving"] == ["r-ok"], obs
    if version not in vllm_sites.NOTIFY_ONLY_UNFLAGGED:
        assert obs["awaiting_kvs"] is False and not obs["metadata_left"], obs
        assert obs["callback_errors"] == [], obs


@pytest.mark.parametrize("name", SCENARIOS)
def test_full_hit_dead_peer_installed_is_clean(name, fresh_pdpatch):
    obs = rw.SCENARIOS[name]()
    assert obs["hma"] is name.endswith("_hma"), obs
    assert_clean(obs, robust_matrix.INSTALLED)
    fresh_pdpatch.install()
    assert (f"handshake_failure_guard (vLLM {robust_matrix.INSTALLED} outside <0.30,>=0.19: "
            "fixed upstream" in fresh_pdpatch.summary_line())


def test_scheduler_stops_on_a_report_of_a_running_request():
    """The judge of ``reported``: the release's real scheduler, one running request that
    a worker lists as finished receiving (what 0.22-0.29 HMA workers do)."""
    assert rw.scheduler_takes_report("r-hit", []) is None
    assert rw.scheduler_takes_report("r-hit", ["r-hit"]).startswith("AssertionError")


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_full_hit_dead_peer_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    v = Version(ver)
    rep = robust_matrix.report(ver)
    stock = robust_matrix.scenario(ver, "stock", "full_hit_dead_peer")
    stock_hma = robust_matrix.scenario(ver, "stock", "full_hit_dead_peer_hma")
    assert stock_hma["hma"] is True and stock["hma"] is False
    if v in vllm_sites.NOTIFY_ONLY_UNFLAGGED:
        assert rep["status"]["handshake_failure_guard"] == "active", rep["summary"]
        # one group: IndexError inside the failure callback, swallowed; nothing reported
        assert_clean(stock, v)
        assert any("IndexError" in e for e in stock["callback_errors"]), stock
        assert stock["metadata_left"], stock
        # HMA: the request is reported, and the worker or the engine core dies
        if v in vllm_sites.FAILED_RECV_LOOKUP:
            assert stock_hma["crash"] == "KeyError: 'prefill-dead'", stock_hma
        else:
            assert stock_hma["crash"] is None, stock_hma
            assert stock_hma["reported"] == ["r-hit"], stock_hma
            assert stock_hma["scheduler"].startswith("AssertionError"), stock_hma
        patched_hma = robust_matrix.scenario(ver, "patched", "full_hit_dead_peer_hma")
        assert_clean(patched_hma, v)
        assert not patched_hma["metadata_left"], patched_hma
        # one group: the release's own outcome, unchanged
        patched = robust_matrix.scenario(ver, "patched", "full_hit_dead_peer")
        assert_clean(patched, v)
        assert patched["callback_errors"] == stock["callback_errors"], patched
        assert patched["metadata_left"], patched
    else:
        assert_clean(stock, v)
        assert_clean(stock_hma, v)
        assert rep["status"]["handshake_failure_guard"] == "skipped", rep["summary"]
        assert "notify-only receives are never stored from vLLM 0.30.0" in rep["summary"]
        for name in SCENARIOS:
            assert_clean(robust_matrix.scenario(ver, "patched", name), v)


def test_guard_skips_its_work_only_when_no_receive_failed():
    """``get_finished`` runs every engine step; the guard returns the release's own call at
    once only when its failed-receive collection (a set up to 0.21, a queue from 0.22) is
    empty: one failed receive, in either, takes the guard's full path (the scenarios above)."""
    from pdpatch.patches.handshake_failure_guard.wrappers import _none_failed

    pending: queue.Queue[str] = queue.Queue()
    assert _none_failed(set()) and _none_failed(pending)
    pending.put("r-dead")
    assert not _none_failed(pending) and not _none_failed({"r-dead"})
    assert not _none_failed(None)          # not the release's state: the guard's checks decide
