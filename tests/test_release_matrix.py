"""The release matrix itself: every listed vLLM release is fetched and tested, one per minor
from 0.19 to the installed release, and on each of them every patch that applies wraps every
target it declares (a target that did not resolve would leave its patch silently inert)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import robust_matrix
from packaging.version import Version
from versions_harness import (
    FULL_MATRIX_VAR,
    INSTALLED,
    SOURCES_ROOT,
    available_versions,
    change_points,
    listed_releases,
    version_bounds,
)

from pdpatch.vllm_sites import SUPPORTED


def test_every_listed_release_is_fetched():
    missing = [v for v in listed_releases() if not (SOURCES_ROOT / v / ".complete").exists()]
    assert missing == [], f"run scripts/fetch_vllm_sources.sh (missing under {SOURCES_ROOT})"


def test_one_release_per_minor_from_0_19_to_the_installed_one():
    minors = [Version(v).release[:2] for v in listed_releases()]
    first, last = min(minors), Version(INSTALLED).release[:2]
    assert minors == [(0, m) for m in range(first[1], last[1])], minors
    assert Version(listed_releases()[0]) in SUPPORTED and Version(INSTALLED) in SUPPORTED


def _installed_targets() -> dict[str, dict[str, list[str]]]:
    from pdpatch import installer

    installer.uninstall()
    try:
        installer.install()
        for ps in installer.status()["patches"].values():
            for label in ps["targets"]:
                importlib.import_module(label.split(":")[0])
        st = installer.status()["patches"]
        return {n: {t: list(v) for t, v in s["targets"].items()} for n, s in st.items()
                if s["status"] == "active"}
    finally:
        installer.uninstall()


@pytest.mark.parametrize("ver", [INSTALLED, *robust_matrix.OLD_RELEASES])
def test_every_active_patch_wraps_every_target(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    if ver == INSTALLED:
        targets = _installed_targets()
    else:
        report = robust_matrix.report(ver)
        targets = {n: t for n, t in report["targets"].items()
                   if report["status"][n] == "active"}
    assert targets, ver
    unwrapped = {n: {t: s for t, s in ts.items() if s[0] != "wrapped"}
                 for n, ts in targets.items()}
    assert {n: u for n, u in unwrapped.items() if u} == {}
    assert all(ts for ts in targets.values()), targets        # no active patch without targets


def test_the_full_matrix_switch_reaches_the_collection():
    """``scripts/release_matrix.sh`` sets the switch for pytest: tests/conftest.py clears every
    ``PDPATCH_*`` setting, and the harness's ``PDLAB_*`` switch must survive it (under one prefix,
    the "full" matrix collected the subset).  Collected with the switch on, the per-release test
    of this file lists every fetched release, also those the subset leaves out."""
    every = [v for v in available_versions() if Version(v) in SUPPORTED
             and Version(v) < Version(INSTALLED)]
    left_out = set(every) - set(change_points(every, version_bounds()))
    if not left_out:
        pytest.skip("the fetched releases are all change points: the subset is the full matrix")
    test_id = f"{__file__}::{test_every_active_patch_wraps_every_target.__name__}"
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", test_id],
                       capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parent.parent, env={**os.environ, FULL_MATRIX_VAR: "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    assert set(re.findall(r"\[(\d+\.\d+\.\d+)\]", p.stdout)) == {*every, INSTALLED}


def test_ci_keeps_the_oldest_the_newest_and_every_change_point():
    rels = ["0.19.1", "0.20.2", "0.21.0", "0.23.0", "0.24.0", "0.25.1"]
    bounds = {Version("0.20"), Version("0.24"), Version("0.34")}
    assert change_points(rels, bounds) == ["0.19.1", "0.20.2", "0.24.0", "0.25.1"]
    assert change_points(["0.30.0"], set()) == ["0.30.0"]
    assert change_points([], bounds) == []


def test_every_version_bound_of_the_site_table_is_seen():
    """A bound that only a Version literal holds (not a declared range) is a change point too."""
    from pdpatch import vllm_sites

    bounds = version_bounds()
    assert {Version("0.26"), Version("0.30"), vllm_sites.SUPPORTED.upper()} <= bounds
    assert Version("0.20") in bounds and Version("0.29") in bounds   # vllm_sites' literals
