"""Issue 7, bug 1: the read-path assert kills the decode worker; with ``read_guard`` the request
fails alone (recorded the way each release records KV-load failures) and the worker serves on.

Real code everywhere: vLLM's worker, handshake, ``start_load_kv`` and result reporting, with a
recording NIXL agent (``tests/robust_worker.py``).  The installed release in process; older
ones from their source trees (``tests/robust_matrix.py``)."""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version
from versions_harness import releases_in

from pdpatch import vllm_sites
from pdpatch.patches import hma_failed_recv, read_guard

BAD_BLOCKS = [1, 2, 3]


def assert_stock_crash(obs: dict) -> None:
    # The assert escaped start_load_kv: on the model-runner thread this kills the worker,
    # and the engine with it.  The healthy request of the same batch was never read.
    assert obs["crash"] is not None and obs["crash"].startswith("AssertionError"), obs
    assert "good" not in obs["reads"], obs


def assert_contained(obs: dict, version: Version) -> None:
    assert obs["crash"] is None, obs
    res = obs["results"]
    style = vllm_sites.recv_failure_style(version)
    assert obs["failure_style"] == style
    if style == "deferred":
        # 0.30+: reported in failed_recving (the scheduler recomputes or fails it and frees
        # its blocks), its blocks marked invalid (non-HMA).
        assert res["failed_recving"] == ["bad"], res
    else:
        # <=0.29: a finished recv whose blocks are all invalid is how these releases fail a
        # load (their own handshake/transfer failures do the same).
        assert res["failed_recving"] == [], res
        assert "bad" in res["done_recving"], res
    assert set(BAD_BLOCKS) <= set(res["invalid_blocks"]), res
    assert "good" in res["done_recving"] and "good" not in res["failed_recving"], res
    # The healthy request of the same batch and a later one were really read.
    assert obs["reads"]["good"] and obs["reads"]["after"], obs["reads"]
    assert "bad" not in obs["reads"], obs["reads"]
    assert obs["after"]["done_recving"] == ["after"] and not obs["after"]["failed_recving"]
    assert not set(obs["after"]["invalid_blocks"]), obs["after"]


def test_stock_installed_read_assert_kills_the_worker(fresh_pdpatch):
    assert_stock_crash(rw.scenario_read_assert())


def test_read_guard_installed_fails_only_that_request(fresh_pdpatch):
    states = fresh_pdpatch.install()
    assert states["read_guard"].status == "active"
    assert_contained(rw.scenario_read_assert(), robust_matrix.INSTALLED)


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_read_assert_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "read_assert", "read_guard")
    assert_stock_crash(stock)
    assert_contained(patched, Version(ver))


def assert_hma(obs: dict, version: Version) -> None:
    """Hybrid KV layout (full + sliding window).  Before 0.30 a release reports a failed load
    only as invalid blocks, which it skips for HMA: read_guard fails the request through
    ``hma_failed_recv``'s worker -> scheduler channel (0.22-0.29: reported done by the worker,
    named failed in the step's worker meta, which the scheduler fails or recomputes); where no
    such channel serves the worker it keeps the crash (failing the request alone would let the
    scheduler decode from garbage KV)."""
    if not obs["hma"]:
        # 0.19-0.21 switch the hybrid KV-cache manager off when a KV connector is configured
        # ("Turning off hybrid kv cache manager because `--kv-transfer-config` is set"), so
        # the two groups are not HMA there and the failure is recordable as invalid blocks.
        assert version < Version("0.22"), obs
        assert obs["crash"] is None and "bad" in obs["results"]["done_recving"], obs
        assert set(BAD_BLOCKS) <= set(obs["results"]["invalid_blocks"]), obs
        assert obs["reads"]["good"] and obs["reads"]["after"], obs
        return
    assert obs["crash"] is None, obs
    assert obs["reads"]["good"] and obs["reads"]["after"], obs
    assert "bad" not in obs["reads"], obs["reads"]
    if vllm_sites.recv_failure_style(version) == "deferred":
        assert obs["results"]["failed_recving"] == ["bad"], obs
        assert obs["worker_meta"] is None, obs
    else:
        assert version in hma_failed_recv.PATCH.versions, version
        assert "bad" in obs["results"]["done_recving"], obs
        # no block marked invalid (the release's HMA path cannot take them); the channel
        # names the request instead, and only it
        assert not set(obs["results"]["invalid_blocks"]), obs
        assert obs["worker_meta"] == ["bad"], obs


def test_read_guard_installed_hma_fails_only_that_request(fresh_pdpatch):
    assert_stock_crash(rw.scenario_read_assert(hma=True))
    fresh_pdpatch.install()
    assert_hma(rw.scenario_read_assert(hma=True), robust_matrix.INSTALLED)


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_read_assert_hma_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    assert_stock_crash(robust_matrix.scenario(ver, "stock", "read_assert_hma"))
    assert_hma(robust_matrix.scenario(ver, "patched", "read_assert_hma"), Version(ver))


@pytest.mark.parametrize("ver", releases_in(hma_failed_recv.PATCH.versions))
def test_read_assert_hma_without_the_channel_keeps_the_crash(ver):
    """``hma_failed_recv`` switched off for the engine: read_guard has no way to fail an HMA
    request alone there, and leaves the release's crash (never a request reported loaded)."""
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    obs = robust_matrix.scenario(ver, "patched", "read_assert_hma_no_channel")
    assert_stock_crash(obs)
    assert obs["worker_meta"] is None, obs


def test_failure_styles_cover_every_release_with_the_bug():
    for minor in range(19, 35):
        assert vllm_sites.recv_failure_style(Version(f"0.{minor}.0")) is not None, minor
    assert vllm_sites.recv_failure_style(Version("0.18.1")) is None


def test_read_guard_on_a_newer_release_follows_its_code(fresh_pdpatch, monkeypatch, tmp_path):
    """On a vLLM newer than pdpatch verified, ``read_guard`` applies where the code it rests
    on is the newest verified release's, and contains the failure; where its read path
    changed it stays off, naming the function, and the release's own crash stands."""
    newer = robust_matrix.pretend_newer(monkeypatch, tmp_path / "same")
    ps = fresh_pdpatch.install()["read_guard"]
    assert ps.status == "active", ps.reason
    assert f"identical to {robust_matrix.INSTALLED}'s" in ps.reason
    assert_contained(rw.scenario_read_assert(), robust_matrix.INSTALLED)
    fresh_pdpatch.uninstall()
    fresh_pdpatch.reset_state()

    site = vllm_sites.lookup(vllm_sites.READ_BLOCKS_FOR_REQ, robust_matrix.INSTALLED)
    robust_matrix.pretend_newer(monkeypatch, tmp_path / "edited", (site.module, site.qualname))
    ps = fresh_pdpatch.install()["read_guard"]
    assert ps.status == "skipped" and ps.version_gated, ps.reason
    assert (f"read_guard (vLLM {newer} is newer than verified ({read_guard.PATCH.versions}) "
            f"and changed {site.qualname}"
            ) in fresh_pdpatch.summary_line()
    assert_stock_crash(rw.scenario_read_assert())
