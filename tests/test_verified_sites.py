"""Patches on a vLLM newer than pdpatch verified: on by themselves where the vLLM code they rest
on is unchanged, off (naming what changed) where it is not, never on for an older release or one
past a fix upstream.  Against real vLLM sources: the shipped fingerprints against the release
trees, a newer release as the installed one's modules with one site edited."""

from __future__ import annotations

import importlib
import logging

import pytest
import wrapt
from newer_release import NEXT, insert_line, newer_release
from packaging.version import Version

from lab import site_fingerprints
from pdpatch import verified, versions
from pdpatch.installer import decide
from pdpatch.patches import all_patches, mla_notif, read_guard, read_settings
from pdpatch.site_sources import SourceTree, module_file

PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
READ = "NixlPullConnectorWorker._read_blocks_for_req"


def test_shipped_fingerprints_are_the_release_trees():
    """pdpatch/verified_sites.json is what the verified releases' real sources give; every
    site every patch declares for a release it covers exists there."""
    assert verified.SHIPPED.read_text() == site_fingerprints.render(site_fingerprints.generate())


def test_every_release_a_patch_covers_has_fingerprints():
    shipped = {Version(r) for r in verified.shipped()}
    for patch in all_patches():
        assert verified.newest_verified(patch) is not None, patch.name
    assert verified.newest_verified(read_guard.PATCH) == max(shipped)


@pytest.fixture
def pull_source(tmp_path):
    """A copy of the installed pull worker module, alone in a tree."""
    src = module_file(verified.installed_root(), PULL)
    dest = tmp_path / "pull_worker.py"
    dest.write_text(src.read_text())
    return dest


def test_fingerprint_ignores_comments_docstrings_and_layout(pull_source):
    tree = SourceTree(pull_source.parent)
    before = tree.fingerprint("pull_worker", READ)
    insert_line(pull_source, READ, "# a comment changes nothing")
    text = pull_source.read_text().replace("\n\n", "\n\n\n", 3)      # blank lines
    pull_source.write_text(text)
    assert SourceTree(pull_source.parent).fingerprint("pull_worker", READ) == before
    insert_line(pull_source, READ, "_pdpatch_edit = 1")
    assert SourceTree(pull_source.parent).fingerprint("pull_worker", READ) != before


def test_a_site_that_is_gone_has_no_fingerprint(pull_source):
    tree = SourceTree(pull_source.parent)
    assert tree.fingerprint("pull_worker", "NixlPullConnectorWorker.no_such_method") is None
    assert tree.fingerprint("no_such_module", "f") is None


@pytest.fixture
def newer(monkeypatch, tmp_path):
    """vLLM reports NEXT; its sources are the ones ``make`` builds (``make(edit, line)``)."""
    monkeypatch.setattr(versions, "vllm_version", lambda: NEXT)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def make(edit=None, line=""):
        root = newer_release(tmp_path / "vllm-next", edit, line)
        monkeypatch.setattr(verified, "installed_root", lambda: root)
        return root
    return make


def read_attr():
    return importlib.import_module(PULL).NixlPullConnectorWorker.__dict__["_read_blocks_for_req"]


def test_a_newer_release_with_unchanged_sites_applies_the_patch(fresh_pdpatch, newer):
    newer()
    original = read_attr()
    states = fresh_pdpatch.install()
    ref = verified.newest_verified(read_guard.PATCH)
    assert states["read_guard"].status == "active"
    assert f"identical to {ref}'s" in states["read_guard"].reason
    assert isinstance(read_attr(), wrapt.FunctionWrapper)
    fresh_pdpatch.uninstall()
    assert read_attr() is original


def test_a_newer_release_that_changed_a_site_keeps_the_patch_off(fresh_pdpatch, newer,
                                                                 monkeypatch):
    newer((PULL, READ), "_pdpatch_edit = 1")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    from pdpatch.log import logger
    logger.addHandler(handler)
    try:
        original = read_attr()
        states = fresh_pdpatch.install()
    finally:
        logger.removeHandler(handler)
    ps = states["read_guard"]
    assert ps.status == "skipped" and ps.version_gated
    assert ps.changed == (verified.label(PULL, READ),)
    assert "changed NixlPullConnectorWorker._read_blocks_for_req" in ps.reason
    assert read_attr() is original
    # a patch that does not rest on that function is still on
    assert states["peer_check"].status == "active"
    [warning] = [r.getMessage() for r in seen]
    assert "read_guard (NixlPullConnectorWorker._read_blocks_for_req)" in warning
    assert "peer_check" not in warning and "PDPATCH_ALLOW_UNTESTED_VLLM=1" in warning
    fresh_pdpatch.uninstall()
    monkeypatch.setenv("PDPATCH_ALLOW_UNTESTED_VLLM", "1")
    forced = fresh_pdpatch.install()["read_guard"]
    assert forced.status == "active" and "applied because PDPATCH_ALLOW_UNTESTED_VLLM=1" in \
        forced.reason
    assert isinstance(read_attr(), wrapt.FunctionWrapper)


def test_untested_means_newer_never_older_nor_past_an_upstream_fix(monkeypatch, newer):
    """PDPATCH_ALLOW_UNTESTED_VLLM=1 forces only patches whose range reaches the newest
    supported release: on an older vLLM nothing, and never a patch vLLM made unneeded."""
    newer()
    monkeypatch.setenv("PDPATCH_ALLOW_UNTESTED_VLLM", "1")
    settings = read_settings()
    older = Version("0.18.1")
    for patch in all_patches():
        assert decide(patch, settings, older).status == "skipped", patch.name
    fixed = decide(mla_notif.PATCH, settings, NEXT)
    assert fixed.status == "skipped" and "fixed upstream in vLLM 0.21.0" in fixed.reason
    assert decide(read_guard.PATCH, settings, NEXT).status == "active"


def test_a_newer_release_is_read_once_then_from_the_cache(newer, monkeypatch):
    root = newer()
    first = verified.compare(read_guard.PATCH)
    monkeypatch.setattr(SourceTree, "fingerprint", lambda *a: pytest.fail("parsed again"))
    assert verified.compare(read_guard.PATCH) == first
    monkeypatch.undo()
    monkeypatch.setattr(verified, "installed_root", lambda: root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(root.parent / "cache"))
    insert_line(module_file(root, PULL), READ, "_pdpatch_edit = 1")   # a new mtime and size
    assert verified.compare(read_guard.PATCH).changed == (verified.label(PULL, READ),)
