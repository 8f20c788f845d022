"""lab.gpu.import_sweep names what a module lacks, and tells it apart from other failures."""

from __future__ import annotations

import sys

from lab.gpu import import_sweep


def test_sweep_names_the_missing_distribution_and_keeps_other_failures_apart(tmp_path,
                                                                           monkeypatch):
    pkg = tmp_path / "swept_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text("X = 1\n")
    (pkg / "needs.py").write_text("import absent_dist_zz.core\n")
    (pkg / "also_needs.py").write_text("from absent_dist_zz import thing\n")
    (pkg / "sub" / "__init__.py").write_text("from swept_pkg import no_such_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    report = import_sweep.sweep(["swept_pkg", "no_such_top_zz"])
    assert sorted(report["missing"]["absent_dist_zz"]) == ["swept_pkg.also_needs",
                                                           "swept_pkg.needs"]
    assert report["missing"]["no_such_top_zz"] == ["no_such_top_zz"]
    assert list(report["failed"]) == ["swept_pkg.sub"]
    assert "no_such_name" in report["failed"]["swept_pkg.sub"][0]
