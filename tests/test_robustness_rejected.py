"""Issue 25: requests the scheduler never allocated must fail alone, not take the engine down
or wait forever.

* Case 1 (``params_guard``): a decode request rejected after its ``kv_transfer_params`` were
  read reaches the connector as an abort carrying them (0.21+:
  ``notify_kv_transfer_request_rejected``; any release: an abort before allocation).  Params
  without ``remote_engine_id`` or ``remote_block_ids`` raise ``KeyError`` in the scheduler step
  (EngineCore dies, and every later request with it), an unhashable engine id ``TypeError`` in
  ``on_new_request`` (0.22+) or in the decode worker (0.19-0.21).  With pdpatch they are
  dropped with a warning and the next requests are served; params the release can use (an
  empty ``remote_block_ids`` too; in push mode, 0.26+, no ``remote_block_ids`` at all, which
  the push scheduler seeds) still notify P, as stock does.
* Case 3 (``readback_guard``): ``do_remote_decode`` with the remote fields asks for a KV
  readback; from 0.21 the scheduler promises it on every engine but starts it only with
  ``bidirectional_kv_xfer`` on, so the request waits forever.  With pdpatch it is computed
  locally; with the setting on, the release's readback runs untouched.

``robust_worker.scenario_rejected`` / ``scenario_rejected_push`` / ``scenario_readback`` on
each release's real scheduler facade and decode worker: the installed release in process, older
releases through the robustness matrix."""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

UNUSABLE = ("engine-id-list", "no-engine-id", "no-block-ids")


def assert_rejected_stock(obs: dict, version: Version) -> None:
    where = "scheduler" if version >= Version("0.22") else "worker"
    assert obs["engine-id-list"]["crash"] == f"{where}: TypeError: unhashable type: 'list'", obs
    assert obs["no-engine-id"]["crash"] == "scheduler: KeyError: 'remote_engine_id'", obs
    # EngineCore is dead: the well-formed requests after it fail too.
    assert obs["good"]["crash"] == "scheduler: KeyError: 'remote_engine_id'", obs
    assert all(not o["warnings"] for o in obs.values()), obs


def assert_rejected_patched(obs: dict) -> None:
    assert all(o["crash"] is None for o in obs.values()), obs
    for name in UNUSABLE:
        o = obs[name]
        assert o["recv"] == [] and o["notifs"] == [] and len(o["warnings"]) == 1, o
        assert f"request r-{name}: kv_transfer_params unusable" in o["warnings"][0], o
        assert "stay pinned until that engine's own timeout" in o["warnings"][0], o
    assert "remote_engine_id ['prefill-engine'] is not hashable" in \
        obs["engine-id-list"]["warnings"][0]
    assert "(missing remote_engine_id)" in obs["no-engine-id"]["warnings"][0]
    assert "(missing remote_block_ids)" in obs["no-block-ids"]["warnings"][0]
    # What the release can use it still does: P is told to free the blocks, and the worker
    # reports no receive for a request the scheduler no longer holds.
    for name in ("empty-block-ids", "good"):
        o = obs[name]
        assert o["recv"] == [f"r-{name}"] and o["warnings"] == [] and o["reported"] == [], o
        assert [m.rsplit(":", 1)[0] for m in o["notifs"]] == [f"p-{name}"], o


def assert_rejected_push(stock: dict, patched: dict, version: Version) -> None:
    """Push mode (0.24+): a push request names no blocks.  From 0.26 the release seeds them
    and notifies P, untouched by pdpatch; 0.24-0.25 raise, pdpatch drops the params."""
    assert stock["no-engine-id"]["crash"] is not None, stock
    if version >= Version("0.26"):
        assert stock["push-form"] == patched["push-form"] == {
            "crash": None, "recv": ["r-push-form"], "warnings": []}, (stock, patched)
    else:
        assert stock["push-form"]["crash"] == "scheduler: KeyError: 'remote_block_ids'", stock
        assert patched["push-form"]["recv"] == [] and patched["push-form"]["warnings"], patched
        assert "(missing remote_block_ids)" in patched["push-form"]["warnings"][0]
    assert patched["no-engine-id"]["crash"] is None and patched["no-engine-id"]["recv"] == []
    assert "missing remote_" in patched["no-engine-id"]["warnings"][0], patched


def assert_readback(stock: dict, patched: dict, version: Version) -> None:
    if version < Version("0.21"):
        # No readback: the request is computed locally, stock and patched.
        assert stock == patched == {"promised": [0, False], "queued": [], "warnings": []}
        return
    # Stock promises 100 tokens and never queues their receive: the request waits forever.
    assert stock == {"promised": [100, True], "queued": [], "warnings": []}, stock
    assert patched["promised"] == [0, False] and patched["queued"] == [], patched
    [warning] = patched["warnings"]
    assert "asks to read back 100 cached tokens from engine 'decode-peer'" in warning
    assert "kv_role=kv_consumer" in warning and "bidirectional_kv_xfer is off" in warning


def assert_readback_served(stock: dict, patched: dict) -> None:
    assert stock == patched == {"promised": [100, True], "queued": ["r-readback"],
                                "warnings": []}, (stock, patched)


@pytest.fixture(scope="module")
def report_installed() -> dict:
    from pdpatch import installer

    names = ("rejected", "rejected_push", "readback", "readback_bidirectional")
    installer.uninstall()
    try:
        stock = {n: rw.SCENARIOS[n]() for n in names}
        installer.install()
        patched = {n: rw.SCENARIOS[n]() for n in names}
    finally:
        installer.uninstall()
    return {"stock": stock, "patched": patched}


def test_rejected_installed(report_installed):
    assert_rejected_stock(report_installed["stock"]["rejected"], robust_matrix.INSTALLED)
    assert_rejected_patched(report_installed["patched"]["rejected"])


def test_rejected_push_installed(report_installed):
    assert_rejected_push(report_installed["stock"]["rejected_push"],
                         report_installed["patched"]["rejected_push"], robust_matrix.INSTALLED)


def test_readback_installed(report_installed):
    assert_readback(report_installed["stock"]["readback"], report_installed["patched"]["readback"],
                    robust_matrix.INSTALLED)
    assert_readback_served(report_installed["stock"]["readback_bidirectional"],
                           report_installed["patched"]["readback_bidirectional"])


def test_rejected_off_per_deployment(fresh_pdpatch):
    """``kv_connector_extra_config["pdpatch"]`` switches the guard off: the release's code."""
    fresh_pdpatch.install()
    obs = rw.scenario_rejected({"pdpatch": {"disable": ["params_guard"]}})
    assert_rejected_stock(obs, robust_matrix.INSTALLED)


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_rejected_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "rejected", "params_guard")
    assert_rejected_stock(stock, Version(ver))
    assert_rejected_patched(patched)


@pytest.mark.parametrize("ver", [v for v in robust_matrix.OLD_RELEASES
                                 if v == "<none>" or Version(v) >= Version("0.24")])
def test_rejected_push_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "rejected_push", "params_guard")
    assert_rejected_push(stock, patched, Version(ver))


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_readback_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    v = Version(ver)
    rep = robust_matrix.report(ver)
    if v < Version("0.21"):
        assert rep["status"]["readback_guard"] == "skipped", rep["summary"]
        assert "have no KV readback" in rep["summary"]
        stock = robust_matrix.scenario(ver, "stock", "readback")
        patched = robust_matrix.scenario(ver, "patched", "readback")
    else:
        stock, patched = robust_matrix.stock_and_patched(ver, "readback", "readback_guard")
        assert_readback_served(robust_matrix.scenario(ver, "stock", "readback_bidirectional"),
                               robust_matrix.scenario(ver, "patched",
                                                      "readback_bidirectional"))
    assert_readback(stock, patched, v)
