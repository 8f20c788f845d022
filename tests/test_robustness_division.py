"""Issue 7, bug 2: unchecked floor divisions in the descriptor maths.  A peer that claims TP 3
for a 4-KV-head model (decode TP 1) passes stock validation (which uses the same floor
arithmetic) and is read in ``L // 3``-byte slices (0.33: 16384 // 3 = 5461): bytes of every block
are never transferred, slice boundaries fall inside a KV head (0.33: inside a bf16 element), and
(0.24+) each remote slice runs past the peer's block into the next one.  With
``division_checks`` the handshake is rejected with the numbers, only that peer's request
fails, and a well-formed peer is still served.
Real code: ``tests/robust_worker.py::scenario_division``."""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.patches import division_checks


def assert_truncated(obs: dict, version: Version) -> None:
    assert obs["crash"] is None and obs["handshake_errors"] == [], obs
    length = obs["block_len"]
    # Three reads per request, one per claimed prefill rank, each length // 3 bytes.
    assert obs["reads_bad"] == 3, obs
    assert obs["local_split_lens"] == [length // 3] == obs["remote_read_lens"], obs
    assert length % 3 and 3 * (length // 3) < length          # bytes never written
    assert (length // 3) % (length // 4)                      # slices split a KV head
    if version >= Version("0.24"):
        # runs past the peer's block (or K half) into the next one
        assert obs["remote_read_lens"][0] > obs["peer_unit"], obs
    # ... and the request is reported as a successful load.
    assert "r-bad" in obs["results"]["done_recving"], obs
    assert not obs["results"]["failed_recving"] and not obs["results"]["invalid_blocks"], obs


def assert_rejected(obs: dict, version: Version) -> None:
    assert obs["crash"] is None, obs
    [err] = set(obs["handshake_errors"])
    assert err.startswith("GeometryNotDivisible: pdpatch: NIXL handshake rejected"), err
    assert "peer TP 3 does not divide the model's 4 KV heads" in err, err
    assert f"block length {obs['block_len']} B is not divisible" in err, err
    assert f"each read would cover {obs['block_len'] // 3} B" in err, err
    assert obs["reads_bad"] == 0 and obs["local_split_lens"] == [] == obs["remote_read_lens"]
    res = obs["results"]
    if vllm_sites.recv_failure_style(version) == "deferred":
        assert res["failed_recving"] == ["r-bad"], res
    else:
        assert "r-bad" in res["done_recving"], res
    assert {1, 2} <= set(res["invalid_blocks"]), res
    assert obs["reads_ok"] == 1 and obs["after"]["done_recving"] == ["r-ok"], obs


def test_stock_installed_reads_truncated_slices(fresh_pdpatch):
    assert_truncated(rw.scenario_division(), robust_matrix.INSTALLED)


def test_division_checks_installed_reject_the_peer(fresh_pdpatch):
    assert fresh_pdpatch.install()["division_checks"].status == "active"
    assert_rejected(rw.scenario_division(), robust_matrix.INSTALLED)


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_division_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "division", "division_checks")
    assert_truncated(stock, Version(ver))
    assert_rejected(patched, Version(ver))


def test_division_checks_on_a_newer_release_follow_its_code(fresh_pdpatch, monkeypatch,
                                                          tmp_path):
    """On a vLLM newer than pdpatch verified whose descriptor maths (``_compute_desc_ids``,
    which the check reasons about) changed, ``division_checks`` stays off, naming the function,
    and the release reads the truncated slices as stock does (where that code is unchanged the
    patch applies: ``tests/test_verified_sites.py``, ``test_robustness_read_guard.py``)."""
    site = vllm_sites.lookup(vllm_sites.DESC_IDS, robust_matrix.INSTALLED)
    newer = robust_matrix.pretend_newer(monkeypatch, tmp_path, (site.module, site.qualname))
    ps = fresh_pdpatch.install()["division_checks"]
    assert ps.status == "skipped" and ps.version_gated, ps.reason
    assert (f"division_checks (vLLM {newer} is newer than verified "
            f"({division_checks.PATCH.versions}) and changed {site.qualname}"
            ) in fresh_pdpatch.summary_line()
    assert_truncated(rw.scenario_division(), robust_matrix.INSTALLED)
