"""``scripts.qualify``: what it refuses before it writes anything, and what its static checks
find between two real releases (vLLM 0.33.0 and 0.34.0's sources: the change that moved
pdpatch's supported range)."""

from __future__ import annotations

import pytest
from packaging.version import Version

from lab import qualify
from pdpatch.patches import all_patches, mla_notif, read_guard, side_channel_listen
from pdpatch.site_sources import SourceTree
from pdpatch.vllm_sites import SUPPORTED

OLD, NEW = Version("0.33.0"), Version("0.34.0")
PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"


@pytest.mark.parametrize("text,says", [
    ("latest", "'latest' is not a vLLM release"),
    ("0.34.0+cpu", "qualify the release it was built from, 0.34.0"),
])
def test_what_is_no_release_is_refused_naming_it(text, says):
    with pytest.raises(qualify.BadInput, match=says):
        qualify.check_release(text)


def test_bad_input_exits_2_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(qualify, "DOCS", tmp_path / "qualify")
    assert qualify.main(["0.34.0+cpu"]) == 2
    assert qualify.main(["0.35.0", "--against", "0.35.0"]) == 2
    assert "is not older than" in capsys.readouterr().err
    assert not (tmp_path / "qualify").exists()


def test_a_release_the_index_lacks_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(qualify, "SOURCES_ROOT", tmp_path)
    with pytest.raises(qualify.BadInput, match=r"vLLM 0\.99\.0: .*no wheel or sdist of it"):
        qualify.fetch("0.99.0")


@pytest.fixture(scope="module")
def trees() -> tuple[SourceTree, SourceTree]:
    return SourceTree(qualify.tree_of(OLD)), SourceTree(qualify.tree_of(NEW))


def test_unchanged_sites_apply_by_themselves(trees):
    result = qualify.static_result(side_channel_listen.PATCH, OLD, *trees)
    assert result.by_itself and result.targets and \
        all(status == "wraps" for _, status in result.targets)


def test_a_changed_site_is_shown_as_a_diff(trees):
    result = qualify.static_result(read_guard.PATCH, OLD, *trees)
    assert not result.by_itself
    [read] = [s for s in result.sites if s.label.endswith("._read_blocks_for_req")]
    assert read.status == "changed"
    # 0.34 declines a read between different block sizes without remote_num_tokens
    assert "+" in read.diff and "remote_num_tokens" in read.diff


def test_a_patch_vllm_made_unneeded_is_not_applicable():
    newer = Version(f"{SUPPORTED.upper()}.0")
    reference, note = qualify.reference_of(mla_notif.PATCH, newer, None)
    assert reference is None and "fixed upstream in vLLM 0.21.0" in note
    reference, _ = qualify.reference_of(read_guard.PATCH, newer, None)
    assert reference is not None and reference in read_guard.PATCH.versions


def test_every_per_release_test_module_names_its_patches():
    names = [p.name for p in all_patches()]
    for module, owners in qualify.SCENARIO_PATCHES.items():
        assert owners == ("(every patch)",) or set(owners) <= set(names), module
    assert qualify.scenario_owner("test_robustness_lease", names) == ["lease_guard"]
    assert qualify.scenario_owner("test_kv_segments_workers", names) == ["kv_segments"]
    assert qualify.scenario_owner("test_hashing_releases", names) == []
