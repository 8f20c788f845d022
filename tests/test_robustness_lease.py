"""A READ of blocks whose lease on the prefill engine has run out (found by this project's e2e
CI on 0.33: a test client stalled 27 s, P freed the blocks of requests prefilled ahead, and D
served wrong tokens with HTTP 200).  From 0.22 P holds a finished request's blocks for
``kv_lease_duration`` (30 s), extended by D's heartbeats once D holds the request; nothing
tells D that a lease ran out, so stock D reads whatever P's blocks hold by then.
``lease_guard`` (0.26+, where vLLM measures the peer's clock at the handshake) declines such a
READ the way the release declines an expired turn-2 readback: within the release's safety
margin of the lease's end, unless a heartbeat reached P that margin before it.

The scenario (``robust_worker.scenario_lease``) runs the release's real P scheduler half (the
params it answers with) and its real decode worker, the handshake scripted (one process: the
two clocks are the same, offset 0), over six leases (``robust_worker.LEASE_CASES``)."""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import vllm_sites

CASES = [rid for rid, _, _ in rw.LEASE_CASES]
DECLINED = ["p-expired", "p-in-margin", "p-late-heartbeat"]
READ = sorted(set(CASES) - set(DECLINED))


def d_ids(p_ids: list[str]) -> list[str]:
    return sorted(f"d-{p}" for p in p_ids)


def assert_stock(obs: dict) -> None:
    """Stock reads every lease, run out or not, and reports each as received."""
    assert obs["crash"] is None, obs
    assert obs["read"] == sorted(CASES), obs
    assert obs["results"]["failed_recving"] == [] and obs["results"]["invalid_blocks"] == [], obs
    assert obs["p_params_expiry"] is None, obs
    assert obs["heartbeats"] == ["HB:p-late-heartbeat,p-heartbeat"] or \
        obs["heartbeats"] == ["HB:p-heartbeat,p-late-heartbeat"], obs


def assert_patched(obs: dict, version: Version) -> None:
    """The three leases that ran out (or run out within the margin) with no heartbeat in time
    are declined -- no READ posted, the request failed as the release fails an expired
    readback, one warning each -- and the worker reads the three others, the last after them.
    P's params carry exactly the expiry its scheduler half holds the blocks to."""
    assert obs["crash"] is None, obs
    assert obs["read"] == READ, obs
    res = obs["results"]
    if vllm_sites.recv_failure_style(version) == "deferred":
        assert res["failed_recving"] == d_ids(DECLINED), res
    else:
        assert set(d_ids(DECLINED)) <= set(res["done_recving"]), res
    assert res["invalid_blocks"] == [1, 2, 3, 4, 5, 6], res
    assert set(d_ids(READ)) <= set(res["done_recving"]), res
    lines = [w for w in obs["warnings"] if "[lease_guard]" in w]
    assert sorted(w.split(":")[1].split()[1] for w in lines) == d_ids(DECLINED), lines
    assert obs["p_params_expiry"] == obs["p_lease"] is not None, obs


def test_lease_installed(fresh_pdpatch):
    assert_stock(rw.scenario_lease())
    fresh_pdpatch.install()
    assert_patched(rw.scenario_lease(), robust_matrix.INSTALLED)


@pytest.mark.parametrize("ver", [r for r in robust_matrix.OLD_RELEASES
                                 if r == "<none>" or Version(r) >= Version("0.26")])
def test_lease_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "lease", "lease_guard")
    assert_stock(stock)
    assert_patched(patched, Version(ver))


@pytest.mark.parametrize("ver", [r for r in robust_matrix.OLD_RELEASES
                                 if r != "<none>" and Version(r) < Version("0.26")][-1:])
def test_no_lease_guard_before_the_release_measures_peer_clocks(ver):
    """0.22-0.25 lease blocks for 30 s too, but their handshake measures no peer clock: there
    D cannot tell P's expiry in its own, and the patch stays out, saying why."""
    rep = robust_matrix.report(ver)
    assert rep["status"]["lease_guard"] == "skipped", rep["summary"]
    assert "measure no peer clock at the handshake" in rep["summary"]


def test_a_worker_remembers_each_requests_first_heartbeat_while_it_sends_them():
    """What a decode worker keeps: the first heartbeat it sent for each P request, from
    rounds to engines it has met (to another the release sends none), as long as the request
    is in the rounds; a request that leaves them has been read or aborted, and is forgotten."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo

    from pdpatch.patches.lease_guard.wrappers import Lease

    def beat(*ids: str) -> HeartbeatInfo:
        return HeartbeatInfo(req_ids=set(ids), host=rw.HOST, port=rw.PORT, tp_size=1)

    lease = Lease()
    lease.sent({"p": beat("a"), "q": beat("x")}, {"p"}, 1.0)
    assert lease.first_sent == {"a": 1.0}
    lease.sent({"p": beat("a", "b"), "q": beat("x")}, {"p", "q"}, 2.0)
    assert lease.first_sent == {"a": 1.0, "b": 2.0, "x": 2.0}
    lease.sent({"p": beat("b")}, {"p", "q"}, 3.0)
    assert lease.first_sent == {"b": 2.0}


@pytest.mark.parametrize(("value", "expiry"), [
    (12.5, 12.5), (12, 12.0), (10**400, None), (True, None), ("12.5", None), ([12.5], None),
    (None, None)])
def test_d_carries_only_a_finite_number_as_ps_expiry(value, expiry):
    """The params are a client's JSON: D's scheduler carries P's expiry only where it is a
    finite number, and never raises on the way (an integer too large for a float included:
    the scheduler step it runs in would take the engine down)."""
    from pdpatch.patches.lease_guard.wrappers import PARAMS_KEY, expiry_in

    assert expiry_in({PARAMS_KEY: value}) == expiry


class _Calls:
    """Records what ``decline_expired_read`` asks of a worker (the release scenarios above
    run the real workers of each release; this checks the version gate alone)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.xfer_stats = self
        self._recv_failures = "recv-failures"

    def record_kv_expired_req(self) -> None:
        self.calls.append(("expired",))

    def _handle_failed_transfer(self, *args, **kwargs) -> None:
        self.calls.append((args, kwargs))


@pytest.mark.parametrize(("version", "kwargs"), [
    ("0.30.0", {}), ("0.30.1.dev4", {}),
    ("0.31.0", {"record_failed_transfer": False}),
    ("0.31.0rc1", {"record_failed_transfer": False}),     # the new code, as every gate reads
    ("0.33.0+cpu", {"record_failed_transfer": False}),
    ("0.34.0", {"record_failed_transfer": False})])
def test_an_expired_read_is_failed_with_the_arguments_of_its_release(version: str,
                                                                     kwargs: dict) -> None:
    worker = _Calls()
    vllm_sites.decline_expired_read(worker, "r1", Version(version))
    assert worker.calls == [("expired",), (("r1", None, "recv-failures"), kwargs)]
