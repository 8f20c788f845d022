"""The robustness scenarios (``tests/robust_worker.py``) on every extracted old vLLM release,
one subprocess per release (``tests/versions_harness.py``), cached for the test session so
the per-bug test modules share it.  The installed release (:data:`INSTALLED`) runs in process
in each test module instead."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from versions_harness import INSTALLED as INSTALLED_RELEASE
from versions_harness import releases_in, run_in_release

from pdpatch.patches import hma_failed_recv
from pdpatch.vllm_sites import SUPPORTED

#: The venv's vLLM release, whose code the in-process tests run.
INSTALLED = Version(INSTALLED_RELEASE)
#: Old releases under test: every fetched release pdpatch supports, below the installed one.
OLD_RELEASES = releases_in(SUPPORTED)


#: Releases whose own receive post-process for a smaller peer block (``kv_postprocess_blksize``,
#: a 4-D permute) cannot handle the blocks-first ``(N, 2, H, bs, D)`` cache the rig allocates
#: there (FlashAttention's 0.23-0.25 shape): stock's ``get_finished`` raises on the first read
#: from such a peer, so the block-size-ratio scenario has nothing to compare.
BLOCK_RATIO_RIG_UNSUPPORTED = SpecifierSet(">=0.23,<0.26")


def scenarios_for(version: str) -> list[str]:
    v = Version(version)
    names = ["read_assert", "read_assert_hma", "division", "dead_peer", "dead_peer_hma",
             "full_hit_dead_peer", "full_hit_dead_peer_hma", "stand_in", "metadata",
             "metadata_padded", "hetero_tp", "transport", "side_channel", "rejected",
             "readback", "block_ids", "metrics"]
    if v not in BLOCK_RATIO_RIG_UNSUPPORTED:
        names.append("block_ids_ratio")
    if v < Version("0.22"):
        names.append("mla_notif")          # bug in 0.19/0.20; 0.21.0 is the fixed control
        names.append("dead_peer_queued")   # where handshake_failure_guard takes failed requests
    if v >= Version("0.21"):
        names += ["spec_types", "readback_bidirectional"]
    if v in hma_failed_recv.PATCH.versions:
        names += ["read_assert_hma_no_channel", "hma_fail_in_flight"]
    if v >= Version("0.24"):
        names.append("rejected_push")      # the push connector exists from 0.24
    if v >= Version("0.26"):
        names.append("lease")              # the handshake measures the peer's clock from 0.26
    return names


@functools.cache
def report(version: str) -> dict[str, Any]:
    """``robust_worker.release_report`` under ``version``: stock results, then patched."""
    run = run_in_release(
        version,
        f"import robust_worker as rw\nemit(rw.release_report({scenarios_for(version)!r}))",
        timeout=900)
    return run.check()


def scenario(version: str, phase: str, name: str) -> dict[str, Any]:
    """One scenario's observations; a scenario that could not run fails the test with its
    traceback (never a silent pass)."""
    data = report(version)[phase][name]
    if "error" in data:
        raise AssertionError(f"{name} ({phase}) could not run on vLLM {version}:\n"
                             f"{data['error']}")
    return data


def stock_and_patched(ver: str, name: str, patch: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Scenario ``name`` on old release ``ver``: its stock observations, and those with
    pdpatch installed, where ``patch`` must be active."""
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    stock = scenario(ver, "stock", name)
    rep = report(ver)
    assert rep["status"][patch] == "active", rep["summary"]
    return stock, scenario(ver, "patched", name)


def pretend_newer(monkeypatch: pytest.MonkeyPatch, root: Any,
                  edit: tuple[str, str] | None = None) -> Version:
    """pdpatch sees a vLLM newer than every release it verified (``newer_release.NEXT``) whose
    sources are the installed release's modules under ``root`` (a fresh directory), with
    ``edit`` = (module, qualname): that function's code changed (one statement added).  The
    code that runs stays the installed release's: what pdpatch decides is what changes.
    Returns the release pdpatch sees."""
    from newer_release import NEXT, newer_release

    from pdpatch import verified, versions

    tree = newer_release(root, edit, "_pdpatch_edit = 1")
    monkeypatch.setattr(versions, "vllm_version", lambda: NEXT)
    monkeypatch.setattr(verified, "installed_root", lambda: tree)
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "cache"))
    return NEXT
