"""Issue 27: pdpatch's counters on vLLM's own ``/metrics``, through each release's real NIXL
statistics channel (worker -> scheduler -> API server), stock then patched.

The installed release in process; older ones from their source trees
(``tests/robust_matrix.py``).  The
scenario is ``tests/metrics_scenarios.py``; end to end on real engines:
``tests/e2e/test_block_keys_e2e.py``."""

from __future__ import annotations

import metrics_scenarios
import pytest
import robust_matrix
from packaging.version import Version

from pdpatch import metrics, vllm_sites

PULLED = 'pdpatch:kv_requests_total{cause="",engine="0",outcome="pulled"}'
FAILED = 'pdpatch:kv_requests_total{cause="failure",engine="0",outcome="recomputed"}'
MISMATCH = 'pdpatch:kv_requests_total{cause="key_mismatch",engine="0",outcome="recomputed"}'
STAGED = 'pdpatch:staged_reads_total{engine="0"}'
STAGED_BYTES = 'pdpatch:staged_read_bytes_total{engine="0"}'
PARAMS_CHECK = 'pdpatch:refusals_total{engine="0",patch="params_check"}'
CONTAINED = 'pdpatch:failures_contained_total{engine="0",patch="read_guard"}'
NIXL_FAILED = 'vllm:nixl_num_failed_transfers_total{engine="0"}'


def assert_stock(obs: dict) -> None:
    assert obs["waiting"] == [True, True], obs
    assert obs["worker_records"] is None and obs["records"] is None, obs
    assert not obs["staging_agent"], obs
    assert obs["failed_transfers"] == [1], obs
    assert obs["exported"] == {NIXL_FAILED: 1.0}, obs
    assert obs["cli"], obs          # the interval's line (a failed transfer), to compare with


def assert_exported(obs: dict, stock: dict, version: Version) -> None:
    assert obs["waiting"] == [True, True], obs
    assert obs["staging_agent"] == (version in vllm_sites.KV_SPLIT_DESCRIPTORS), obs
    assert "WAITING_FOR_REMOTE_KVS" not in obs["promoted"], obs
    # the worker's counts ride its stats; the scheduler's join them in make_stats
    assert obs["worker_records"] == [["staged_reads", [], 1], ["staged_read_bytes", [], 4096]]
    assert sorted(map(str, obs["records"])) == sorted(map(str, [
        *obs["worker_records"], ["kv_requests", ["pulled", ""], 1],
        ["kv_requests", ["recomputed", "failure"], 1]])), obs
    # stock's own keys and metrics untouched, its CLI line unchanged
    assert obs["payload_keys"] == sorted([*stock["payload_keys"], metrics.RECORDS_KEY]), obs
    assert obs["failed_transfers"] == [1], obs
    assert obs["cli"] == stock["cli"], obs
    got = obs["exported"]
    assert {k: got.get(k) for k in (PULLED, FAILED, MISMATCH, STAGED, STAGED_BYTES,
                                    PARAMS_CHECK, CONTAINED, NIXL_FAILED)} == {
        PULLED: 1.0, FAILED: 1.0, MISMATCH: 0.0, STAGED: 1.0, STAGED_BYTES: 4096.0,
        PARAMS_CHECK: 1.0, CONTAINED: 0.0, NIXL_FAILED: 1.0}, got
    # every metric and preset label set is on /metrics from the start (Grafana sees zeros)
    assert len([k for k in got if k.startswith("pdpatch:")]) == sum(
        len(m.preset) for m in metrics.METRICS.values()), sorted(got)


def test_counts_reach_metrics_installed(fresh_pdpatch):
    stock = metrics_scenarios.scenario_metrics()
    assert_stock(stock)
    assert fresh_pdpatch.install()["metrics"].status == "active"
    assert_exported(metrics_scenarios.scenario_metrics(), stock, robust_matrix.INSTALLED)


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_counts_reach_metrics_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "metrics", "metrics")
    assert_stock(stock)
    assert_exported(patched, stock, Version(ver))


def test_exporter_skips_what_it_does_not_know():
    """A record of another pdpatch version (a mixed upgrade) is logged once, never raised."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()

    def counter(**kw):
        return Counter(registry=registry, **kw)

    exp = metrics.Exporter(counter, ["model_name", "engine"], {0: ["m", "0"], 3: ["m", "3"]})
    exp.export([["nonesuch", [], 1], ["refusals", [], 1], ["peers_converted", [], 2]], 3)
    exp.export([["peers_converted", [], 1]], 9)      # an engine this server does not front
    text = generate_latest(registry).decode()
    assert 'pdpatch:peers_converted_total{engine="3",model_name="m"} 2.0' in text
    assert 'pdpatch:peers_converted_total{engine="0",model_name="m"} 0.0' in text


def test_several_api_servers_sum_like_vllm_own(tmp_path):
    """With several API servers vLLM collects ``/metrics`` from Prometheus multiprocess files
    (``PROMETHEUS_MULTIPROC_DIR``): two API server processes record the scenario's stats, and
    the collection over both adds pdpatch's counters up as it adds vLLM's ``vllm:nixl_*``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    code = f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}]\n" \
        "import conftest, metrics_scenarios\nmetrics_scenarios.api_server_alone()"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    got = metrics_scenarios.exposition(generate_latest(registry).decode())
    assert {k: got.get(k) for k in (PULLED, FAILED, STAGED_BYTES, PARAMS_CHECK, NIXL_FAILED)} \
        == {PULLED: 2.0, FAILED: 2.0, STAGED_BYTES: 8192.0, PARAMS_CHECK: 2.0,
            NIXL_FAILED: 2.0}, got


class _Owner:
    """An object counts are made for, as vLLM's schedulers and workers are (a ``__dict__``
    and weak references)."""


def test_one_call_counts_an_event_once_for_status_and_metrics(fresh_pdpatch):
    """One book per event: ``metrics.count`` is the only call, and ``status()`` and the
    records for ``/metrics`` both show it once (read_guard's contained failure counted in a
    patch's own state besides was a second book)."""
    owner = _Owner()
    metrics.drain(owner)
    assert metrics.count(owner, metrics.FAILURES_CONTAINED, "read_guard") == 1
    status = fresh_pdpatch.status()["counters"]
    assert status['pdpatch:failures_contained_total{patch=read_guard}'] == 1
    assert [k for k, v in status.items() if v and "failures_contained" in k] == \
        ['pdpatch:failures_contained_total{patch=read_guard}']
    assert metrics.drain(owner) == [["failures_contained", ["read_guard"], 1]]
    assert metrics.total(metrics.FAILURES_CONTAINED, "read_guard") == 1


def test_drain_returns_at_once_only_when_no_object_holds_counts():
    """Every engine step drains; ``pending`` lets a step with nothing counted skip the work,
    and never while one object still holds counts another's drain did not take."""
    a, b = _Owner(), _Owner()
    metrics.drain(a, b)
    before = len(metrics._undrained)
    metrics.count(a, metrics.KV_REQUESTS, *metrics.PULLED)
    metrics.count(a, metrics.KV_REQUESTS, *metrics.PULLED)
    metrics.count(b, metrics.STAGED_READS)
    assert metrics.pending() and len(metrics._undrained) == before + 2
    assert metrics.drain(b) == [["staged_reads", [], 1]]
    assert metrics.pending() and metrics.drain(b) == []
    assert metrics.drain(a) == [["kv_requests", ["pulled", ""], 2]]
    assert len(metrics._undrained) == before


def test_an_object_collected_with_counts_leaves_the_fast_path_on():
    """An object garbage-collected before any drain took its counts (an engine torn down
    mid-request) must not keep every later step of the process on the full path."""
    import gc

    metrics.drain(*list(metrics._undrained.values()))
    gone = _Owner()
    metrics.count(gone, metrics.STAGED_READS)
    assert metrics.pending()
    del gone
    gc.collect()
    assert not metrics.pending()
