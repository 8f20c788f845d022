"""A prefill engine that is gone before the decode side handshakes with it (found while testing
issue 7): the release's real ZMQ handshake to a closed port times out after 5 s (shortened in
the rig: ``robust_worker.closed_port_timeout``) and the waiting request is marked failed.  On
0.19-0.21 the next ``get_finished`` then looks the never-registered engine up for
post-processing and raises ``KeyError`` on the model-runner thread -- the decode worker dies.
``handshake_failure_guard`` (0.19-0.21 for this fault) reports such requests as failed without
the lookup; 0.22+ already does, and where the patch is still active for its
notify-only fault (0.22-0.29, ``test_robustness_full_hit.py``) this path runs as stock.  The
same path is taken when ``division_checks`` rejects a peer, so on 0.19-0.21 the two patches
work together."""

from __future__ import annotations

import re

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import vllm_sites


def assert_clean(obs: dict, version: Version) -> None:
    assert obs["crash"] is None, obs
    assert obs["handshake_errors"] and obs["handshake_errors"][0].startswith("Again"), obs
    res = obs["results"]
    if vllm_sites.recv_failure_style(version) == "deferred":
        assert res["failed_recving"] == ["r-dead"], res
    else:
        assert "r-dead" in res["done_recving"], res
    assert {1, 2} <= set(res["invalid_blocks"]), res
    assert "r-dead" not in obs["reads"] and obs["reads"]["r-ok"], obs
    assert obs["after"]["done_recving"] == ["r-ok"], obs


def test_the_rig_shortens_only_the_handshakes_reply_timeout():
    """Inside ``closed_port_timeout`` the release's ``RCVTIMEO`` of 5,000 ms reads as the rig's
    value and a closed port's reply times out as ``zmq.Again``; any other value or option is
    set as given, and outside it 5,000 ms is 5,000 ms again."""
    import time

    import zmq

    ctx = zmq.Context()
    try:
        with rw.closed_port_timeout():
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{rw.HOST}:{rw.free_port()}")
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            assert sock.getsockopt(zmq.SNDTIMEO) == 5000
            sock.setsockopt(zmq.RCVTIMEO, 1000)
            assert sock.getsockopt(zmq.RCVTIMEO) == 1000
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            assert sock.getsockopt(zmq.RCVTIMEO) == rw.CLOSED_PORT_RCVTIMEO_MS < 5000
            sock.send(b"query")
            t0 = time.monotonic()
            with pytest.raises(zmq.Again):
                sock.recv()
            assert time.monotonic() - t0 < 4.0
            sock.close()
        after = ctx.socket(zmq.REQ)
        after.setsockopt(zmq.LINGER, 0)
        after.setsockopt(zmq.RCVTIMEO, 5000)
        assert after.getsockopt(zmq.RCVTIMEO) == 5000
        after.close()
    finally:
        ctx.term()


def test_dead_peer_installed_fails_the_request_only(fresh_pdpatch):
    assert_clean(rw.scenario_dead_peer(), robust_matrix.INSTALLED)
    fresh_pdpatch.install()
    assert (f"handshake_failure_guard (vLLM {robust_matrix.INSTALLED} outside <0.30,>=0.19: "
            "fixed upstream: get_finished skips failed requests from vLLM 0.22.0"
            ) in fresh_pdpatch.summary_line()


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_dead_peer_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    v = Version(ver)
    stock = robust_matrix.scenario(ver, "stock", "dead_peer")
    rep = robust_matrix.report(ver)
    if v in vllm_sites.FAILED_RECV_LOOKUP:
        assert stock["crash"] == "KeyError: 'prefill-dead'", stock
    else:
        assert_clean(stock, v)
    if v in vllm_sites.NOTIFY_ONLY_UNFLAGGED:
        assert rep["status"]["handshake_failure_guard"] == "active", rep["summary"]
    else:
        assert rep["status"]["handshake_failure_guard"] == "skipped", rep["summary"]
        assert "get_finished skips failed requests from vLLM 0.22.0" in rep["summary"]
    assert_clean(robust_matrix.scenario(ver, "patched", "dead_peer"), v)


@pytest.mark.parametrize("ver", [r for r in robust_matrix.OLD_RELEASES
                                 if r == "<none>" or Version(r) in vllm_sites.FAILED_RECV_LOOKUP])
def test_requests_queued_for_a_dead_peer_fail_alone_with_one_line(ver):
    """Three requests queued for one dead prefill engine (0.19-0.21, where the guard takes
    failed requests out of the receive post-processing): each fails alone, the worker goes
    on serving, and pdpatch says so in one line per engine step for the requests it took
    out in that step, not one line per request (the release logs each request's failure
    itself).  The release's handshake thread marks the three failed one after the other, so
    an engine step may come between them (seen once in CI on a loaded machine): the lines
    then split the three between them, each named once."""
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    obs = robust_matrix.scenario(ver, "patched", "dead_peer_queued")
    queued = ["r-dead", "r-dead-2", "r-dead-3"]
    assert obs["crash"] is None and sorted(obs["results"]["done_recving"]) == queued, obs
    assert obs["after"]["done_recving"] == ["r-ok"], obs
    lines = [w for w in obs["warnings"] if "[handshake_failure_guard]" in w]
    named = []
    for line in lines:
        m = re.match(r"pdpatch: (\d) request\(s\) failed their handshake \(([^;)]*) before "
                     r"their prefill engine was known\)", line)
        assert m, line
        ids = m.group(2).split(", ")
        assert int(m.group(1)) == len(ids), line
        named += ids
    assert sorted(named) == queued, lines


def assert_hma_outcome(obs: dict, version: Version) -> None:
    """vllm#52234 on a hybrid (HMA) layout: where the release can express the failure (0.30+)
    the request fails alone; before, the release reports it as a finished load with no
    failure signal -- the scheduler then decodes from KV that never arrived (HTTP 200, wrong
    tokens) -- and pdpatch cannot do better through the release's bookkeeping."""
    assert obs["hma"] is True, obs
    res = obs["results"]
    if vllm_sites.recv_failure_style(version) == "deferred":
        assert obs["crash"] is None and res["failed_recving"] == ["r-dead"], obs
        assert obs["after"]["done_recving"] == ["r-ok"], obs
    elif version in vllm_sites.FAILED_RECV_LOOKUP:
        assert obs["crash"] == "KeyError: 'prefill-dead'", obs
    else:
        assert obs["crash"] is None and res["done_recving"] == ["r-dead"], obs
        assert res["failed_recving"] == [] and res["invalid_blocks"] == [], obs


def test_dead_peer_hma_installed_fails_the_request_only():
    assert_hma_outcome(rw.scenario_dead_peer(hma=True), robust_matrix.INSTALLED)


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_dead_peer_hma_on_old_release(ver):
    """0.19-0.21: ``handshake_failure_guard`` leaves the release's KeyError where reporting
    the request would hand the scheduler garbage KV; 0.22-0.29: vllm#52234 as stock."""
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    v = Version(ver)
    stock = robust_matrix.scenario(ver, "stock", "dead_peer_hma")
    patched = robust_matrix.scenario(ver, "patched", "dead_peer_hma")
    assert_hma_outcome(stock, v)
    assert_hma_outcome(patched, v)
    assert {k: patched[k] for k in ("crash", "results")} == \
        {k: stock[k] for k in ("crash", "results")}
