"""Issue 54: prefill engines that restart, are replaced or stall, on each release's real NIXL
decode worker (``tests/peer_worker.py``): the installed release in process, every older one in
a subprocess on its source tree (``tests/versions_harness.py``).  Stock observations first
(each test fails where stock does not show the fault), then with ``peer_restart``.

* ``restart`` / ``restart_no_tokens``: P killed and back under the same engine id and address.
  Stock reads every later request through the dead agent (each fails).  Patched: with P's
  incarnation tokens every request after the restart reads from the new agent; without them
  (P without pdpatch) the first one meets the dead agent and fails, the rest read from the new
  one; a request carrying the dead incarnation's params is failed unread either way.
* ``restarts`` / ``restarts_new_id``: twenty incarnations; what the worker holds at the end.
* ``stall``: a READ to a stopped P outlasts the peer deadline: failed, its handle released.
* ``handshake_stall``: a handshake outlasts the deadline: the request fails, and is not READ
  when the handshake completes.
* ``geometry``: P comes back under the same id with another KV layout: the release's own
  handshake check refuses it, and no READ is posted with either incarnation's geometry.
"""

from __future__ import annotations

import functools
from typing import Any

import peer_worker as pw
import pytest
from packaging.version import Version
from versions_harness import releases_in, run_in_release

from pdpatch import vllm_sites
from pdpatch.patches import hma_failed_recv

NAMES = list(pw.SCENARIOS)
OLD = releases_in(vllm_sites.SUPPORTED)


@functools.cache
def old_report(version: str) -> dict[str, Any]:
    run = run_in_release(version, f"import peer_worker as pw\nemit(pw.release_report({NAMES!r}))",
                         timeout=900)
    return run.check()


@pytest.fixture(scope="module")
def installed_report() -> dict[str, Any]:
    from pdpatch import installer

    installer.uninstall()
    installer.reset_state()
    try:
        yield pw.release_report(NAMES)
    finally:
        installer.uninstall()
        installer.reset_state()


def observed(report: dict[str, Any], phase: str, name: str) -> dict[str, Any]:
    data = report[phase][name]
    if "error" in data:
        raise AssertionError(f"{name} ({phase}) could not run:\n{data['error']}")
    return data


def release_of(report: dict[str, Any], ver: str | None) -> Version:
    return Version(ver) if ver else pw.rw.version_of()


def outcomes(obs: dict[str, Any], *reqs: str) -> list[str]:
    return [obs[r]["outcome"] for r in reqs]


def check_restart(stock: dict, patched: dict, tokens: bool) -> None:
    reqs = ("r2", "r3", "r4", "r4b")
    assert stock["r1"]["outcome"] == "ok", stock
    # stock: the dead agent is kept and read through, request after request
    assert outcomes(stock, *reqs) == ["failed"] * 4, stock
    assert all(stock[r]["read_from"] == ["P1-0"] for r in reqs), stock
    assert stock["held"]["agents"] == ["P1-0"], stock["held"]
    for obs in (stock, patched):
        assert all(obs[r]["crash"] is None for r in ("r1", *reqs, "r5_stale")), obs
    if tokens:
        check_read_from_p2(patched, reqs)
    else:
        # the first meets the dead agent; one that reached D within P's lease of the restart
        # may be the dead incarnation's: failed unread; later ones are read from P2
        assert patched["r2"] == {"outcome": "failed", "crash": None, "read_from": ["P1-0"]}
        assert patched["r3"] == {"outcome": "failed", "crash": None, "read_from": []}
        assert outcomes(patched, "r4", "r4b") == ["ok"] * 2, patched
        assert all(patched[r]["read_from"] == ["P2-0"] for r in ("r4", "r4b")), patched
    check_dead_forgotten(patched)


def check_read_from_p2(patched: dict, reqs: tuple[str, ...]) -> None:
    assert outcomes(patched, *reqs) == ["ok"] * len(reqs), patched
    assert all(patched[r]["read_from"] == ["P2-0"] for r in reqs), patched


def check_dead_forgotten(patched: dict) -> None:
    # params of the dead incarnation: failed, and never read from the new one
    assert patched["r5_stale"] == {"outcome": "failed", "crash": None, "read_from": []}
    assert patched["held"]["agents"] == ["P2-0"] and patched["held"]["nixl_knows"] == ["P2-0"]
    assert "P1-0" in patched["removed"], patched
    assert any("[peer_restart]" in w for w in patched["warnings"]), patched["warnings"]


def check_restart_hma(stock: dict, patched: dict, version: Version) -> None:
    """The same restart on a hybrid model's workers (full attention + sliding window)."""
    reqs = ("r2", "r3", "r4", "r4b", "r5_stale")
    # stock reads every later request through the dead agent; before 0.30 it reports each
    # loaded (vllm#52234: decoded from blocks that never received anything)
    assert all(stock[r]["read_from"] == ["P1-0"] for r in reqs), stock
    recorded = vllm_sites.recv_failure_style(version) == "deferred"
    assert outcomes(stock, *reqs) == ["failed" if recorded else "ok"] * 5, stock
    if not recorded and version not in hma_failed_recv.PATCH.versions:
        # 0.19-0.21 (the hybrid manager on, off by default there with a connector) have no
        # worker -> scheduler channel: peer_restart stays off, the release's behaviour stands
        assert all(patched[r] == stock[r] for r in reqs), patched
        return
    # patched (0.22-0.29 through hma_failed_recv's channel): recovered as a one-group model
    assert patched["r1"]["outcome"] == "ok", patched
    check_read_from_p2(patched, reqs[:-1])
    check_dead_forgotten(patched)


def check_restarts(stock: dict, patched: dict, version: Version) -> None:
    assert stock["outcomes"][0] == "ok" and set(stock["outcomes"][1:]) == {"failed/failed"}
    assert stock["held"]["nixl_knows"] == ["P0-0"], stock["held"]
    assert patched["outcomes"] == ["ok"] * 20, patched["outcomes"]
    held = patched["held"]
    assert held["engines"] == [pw.ENGINE] and held["agents"] == ["P19-0"], held
    assert held["nixl_knows"] == ["P19-0"], held
    assert patched["removed"] == 19 and patched["lists_released"] == 19, patched
    assert all(v <= 1 for k, v in held.items() if isinstance(v, int)), held


def check_restarts_new_id(stock: dict, patched: dict, version: Version) -> None:
    assert stock["outcomes"] == patched["outcomes"] == ["ok"] * 20
    kept = len(stock["held"]["nixl_knows"])
    if version >= vllm_sites.ADDRESS_REPLACEMENT_FROM:
        assert kept == 1, stock["held"]            # 0.31+ forget a replaced address's engine
    else:
        assert kept == 20, stock["held"]           # every dead engine kept
    if "_remote_registration_generations" in stock["held"]:      # 0.33+: never freed
        assert stock["held"]["_remote_registration_generations"] == 20, stock["held"]
    held = patched["held"]
    assert held["engines"] == [f"{pw.ENGINE}-19"] and held["nixl_knows"] == ["P19-0"], held
    assert all(v <= 1 for k, v in held.items() if isinstance(v, int)), held
    assert patched["removed"] == 19, patched


def check_stall(stock: dict, patched: dict) -> None:
    assert stock["during"]["outcome"] == "pending", stock      # no bound: waits as P stalls
    assert patched["during"]["outcome"] == "failed", patched
    assert patched["during"]["ended_after_s"] < 3.0, patched
    assert patched["released"], patched                       # its READ handle released
    assert stock["after"]["outcome"] == patched["after"]["outcome"] == "ok"


def check_handshake_stall(stock: dict, patched: dict) -> None:
    # stock waits as long as the handshake does (3 s here), then reads
    assert stock["r1"]["outcome"] == "ok" and stock["r1"]["ended_after_s"] >= 2.9, stock
    # patched: failed at the deadline (1 s), and never READ once the handshake completed
    assert patched["r1"]["outcome"] == "failed" and patched["r1"]["ended_after_s"] < 2.5
    assert patched["r1"]["read_from_after"] == [], patched
    assert stock["r2"]["outcome"] == patched["r2"]["outcome"] == "ok"


def check_geometry(stock: dict, patched: dict) -> None:
    assert outcomes(stock, "r2", "r3") == ["failed"] * 2, stock
    assert outcomes(patched, "r2", "r3") == ["failed"] * 2, patched
    assert patched["r2"]["read_from"] == patched["r3"]["read_from"] == [], patched
    assert patched["handshake_errors"], patched
    held = patched["held"]
    assert held["engines"] == [] and held["nixl_knows"] == [], held
    assert all(v == 0 for k, v in held.items() if isinstance(v, int)), held


def check_all(report: dict[str, Any], version: Version) -> None:
    assert report["status"]["peer_restart"] == "active", report["status"]

    def both(name: str) -> tuple[dict, dict]:
        return observed(report, "stock", name), observed(report, "patched", name)

    check_restart(*both("restart"), tokens=True)
    check_restart(*both("restart_no_tokens"), tokens=False)
    check_restart_hma(*both("restart_hma"), version)
    check_restarts(*both("restarts"), version)
    check_restarts_new_id(*both("restarts_new_id"), version)
    check_stall(*both("stall"))
    check_handshake_stall(*both("handshake_stall"))
    check_geometry(*both("geometry"))


def test_peer_restart_installed(installed_report):
    check_all(installed_report, pw.rw.version_of())


@pytest.mark.parametrize("ver", OLD)
def test_peer_restart_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    check_all(old_report(ver), Version(ver))
