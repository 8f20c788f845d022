"""The backtest of fingerprint turn-ons (``lab/backtest.py``, ``docs/backtest.md``): across
every supported transition of vLLM's real sources, no patch is turned on by fingerprints where
its range ended -- and a declaration too narrow to see the release that ended it is caught."""

from __future__ import annotations

from lab import backtest, site_fingerprints
from pdpatch.patches import all_patches
from pdpatch.registry import Patch, Target
from pdpatch.versions import VersionRange


def test_no_patch_is_turned_on_where_its_range_ended():
    rows = backtest.transitions()
    assert len(rows) == len(site_fingerprints.verified_trees()) - 1 >= 15
    assert [t for t in rows if t.harmful] == []
    assert sum(len(t.kept) for t in rows) > 0       # the fingerprints keep some on


def test_a_declaration_that_misses_the_fix_is_caught(monkeypatch):
    """A patch ended at 0.21 (as mla_notif, fixed there) that declared only a site 0.21 left
    unchanged would be kept on over the fix: the backtest names it harmful."""
    unchanged = ("vllm.config.kv_transfer", "KVTransferConfig.is_kv_consumer")
    narrow = Patch(name="narrow", summary="probe", versions=VersionRange(">=0.19,<0.21"),
                   targets=lambda v: [Target(*unchanged, lambda w, i, a, k: w(*a, **k))])
    monkeypatch.setattr(backtest, "all_patches", lambda: [*all_patches(), narrow])
    [row] = [t for t in backtest.transitions() if (t.old, t.new) == ("0.20.2", "0.21.0")]
    assert row.harmful == ["narrow"]


def test_the_published_table_is_the_backtest():
    """docs/backtest.md's static columns are what the sources give today."""
    text = backtest.DOC.read_text()
    for t in backtest.transitions():
        assert f"| {t.old} -> {t.new} | {len(t.in_force)} | " in text
        assert f"| {len(t.kept)}/{len(t.in_force)} (" in text.split(f"| {t.old} -> {t.new} |")[1]
