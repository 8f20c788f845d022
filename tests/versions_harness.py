"""Run a check against an OLD vLLM release's real source tree, in a subprocess.

Why a subprocess: the venv has one vLLM installed; an older release's ``.py`` tree (extracted by
``scripts/fetch_vllm_sources.sh`` into ``~/.cache/pdpatch/vllm-src/<ver>/``) can only shadow it
in a fresh interpreter whose ``sys.path`` starts with that tree.  There the compiled ``vllm._C``
is absent (fine on CPU) and ``importlib.metadata`` still reports the venv's, so the child replaces
``pdpatch.versions.vllm_version`` to report the release under test before anything in pdpatch
asks (``versions.py`` itself is not changed).

Usage (any test module)::

    from versions_harness import release_versions, run_in_release

    @pytest.mark.parametrize("ver", release_versions(">=0.24"))
    def test_something(ver):
        run = run_in_release(ver, '''
            import vllm
            emit({"file": vllm.__file__})
        ''')
        assert run.result["file"].startswith(str(source_tree(ver)))

Inside the snippet: ``VERSION`` (the release string), ``TREE`` (its source root) and
``emit(obj)`` (JSON-serialisable; the last call wins and becomes ``run.result``) are predefined;
``tests/`` and the repository root are importable.  A snippet exception makes ``run.result``
None and its traceback lands in ``run.stderr``; ``run.check()`` raises with the output tail.

The child also sees a ``vllm-<ver>+cpu`` distribution record (:func:`dist_info_dir`) ahead of
the venv's: releases up to 0.24 pick their platform from the installed distribution's version
string (``"cpu" in version("vllm")``), and this declares what the child really runs -- that
release's Python code on the CPU platform, with no compiled ops.

Releases before 0.24 import ``gguf`` at ``import vllm`` time, which the venv's release does not need
and lacks; :func:`extras_dir` installs the real package (``pip install --target``, no deps) once
into ``~/.cache/pdpatch/old-vllm-deps`` (``scripts/fetch_test_extras.sh`` does it at setup) and
appends it to the child's path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from xdist_groups import grouped

from lab import cpu_platform
from lab.env import cache_dir, path_var
from lab.fetch_vllm_sources import dist_info_dir
from pdpatch.versions import release_of, vllm_version

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
SOURCES_ROOT = path_var("PDLAB_VLLM_SOURCES", cache_dir() / "vllm-src")
EXTRAS_ROOT = path_var("PDLAB_OLD_VLLM_DEPS", cache_dir() / "old-vllm-deps")
# vLLM's own cache (VLLM_CACHE_ROOT), one per release.  Its model-info cache is one file per
# model class whatever the release, keyed by the hash of that release's model file: releases
# sharing it overwrite each other's entry, and every miss costs a subprocess that imports the
# model (15-30 s on the 2-core machine) in each child.
VLLM_CACHES_ROOT = path_var("PDLAB_VLLM_CACHES", cache_dir() / "vllm-cache")
# Third-party modules older releases import eagerly but vLLM 0.33 no longer needs.
EXTRA_PACKAGES = ("gguf",)
RESULT_MARK = "@@PDPATCH-RESULT@@"
# The venv's vLLM (its release, local parts dropped); older releases run from their source trees.
INSTALLED = str(release_of(vllm_version())) if vllm_version() else "0"
FULL_MATRIX_VAR = "PDLAB_FULL_MATRIX"            # lab.env: survives tests/conftest.py
QUALIFY_VAR = "PDLAB_QUALIFY_RELEASE"
"""A release newer than pdpatch verified (``scripts.qualify``): the per-release tests run on it
alone, with the patches forced on there (``PDPATCH_ALLOW_UNTESTED_VLLM=1``)."""
"""``1``: the per-release tests run on every fetched release (``scripts/release_matrix.sh``);
otherwise on the oldest, the newest and the :func:`change_points` of those in range (the test
command, to keep CI within its time)."""
# Where pdpatch keys a fact on the vLLM version: a range's bound or a Version literal.
_BOUND = re.compile(r'(?:[<>]=?|==|!=)\s*(\d+\.\d+(?:\.\d+)?)\b|Version\("(\d+\.\d+(?:\.\d+)?)"\)')

_extras_lock = threading.Lock()


def source_tree(version: str) -> Path:
    return SOURCES_ROOT / version


def listed_releases() -> list[str]:
    """The releases ``scripts/fetch_vllm_sources.sh`` fetches (``lab/vllm_releases.txt``)."""
    lines = (REPO / "lab" / "vllm_releases.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def available_versions() -> list[str]:
    """The newest fetched release of each minor (trees with the ``.complete`` marker), oldest
    first: a leftover older patch release in the cache does not run twice.  Below the installed
    release (whose own code runs in process), and the release ``scripts.qualify`` names
    (:data:`QUALIFY_VAR`): a tree it fetched is not tested otherwise."""
    if not SOURCES_ROOT.is_dir():
        return []
    qualifying = os.environ.get(QUALIFY_VAR)
    found = sorted(Version(d.name) for d in SOURCES_ROOT.iterdir()
                    if (d / ".complete").exists() and (d / "vllm" / "__init__.py").exists()
                    and (Version(d.name) < Version(INSTALLED) or d.name == qualifying))
    newest = {v.release[:2]: v for v in found}
    return [str(v) for v in sorted(newest.values())]


def version_bounds() -> set[Version]:
    """Every release number at which a fact pdpatch keys on the vLLM version changes: the
    bounds of the ranges and the Version literals in ``vllm_sites`` and the patch modules."""
    pkg = REPO / "pdpatch"
    files = [pkg / "vllm_sites.py", *sorted((pkg / "patches").glob("*.py"))]
    return {Version(a or b) for f in files for a, b in _BOUND.findall(f.read_text())}


def change_points(releases: list[str], bounds: set[Version]) -> list[str]:
    """The oldest and the newest of ``releases`` and each one that is the first at or past a
    bound: releases between two change points run the same version-keyed code paths as the
    change point below them."""
    vs = [Version(r) for r in releases]
    keep = {0, len(vs) - 1} if vs else set()
    keep |= {i for i in range(1, len(vs)) if any(vs[i - 1] < b <= vs[i] for b in bounds)}
    return [releases[i] for i in sorted(keep)]


def release_versions(spec: str = "") -> list[str]:
    """Fetched releases matching ``spec`` (e.g. ``">=0.19,<0.21"``), for parametrize.

    An empty match is returned as one ``"<none>"`` entry so that the test is reported as
    skipped with a reason instead of silently vanishing from the run.
    """
    wanted = SpecifierSet(spec)
    vs = [v for v in available_versions() if wanted.contains(Version(v), prereleases=True)]
    return vs or ["<none>"]


def releases_in(versions: Any) -> list[str]:
    """The fetched releases below the installed one inside ``versions`` (a patch's declared
    ``VersionRange``, or ``vllm_sites.SUPPORTED``) -- all of them, or their change points (see
    :data:`FULL_MATRIX_VAR`) -- for parametrize (``["<none>"]`` if none).  The release
    ``scripts.qualify`` names is in every range that reaches the newest supported release."""
    qualifying = os.environ.get(QUALIFY_VAR)
    found = [v for v in available_versions()
             if Version(v) in versions or (v == qualifying and reaches_newest(versions))]
    if os.environ.get(FULL_MATRIX_VAR) != "1" and not qualifying:
        found = change_points(found, version_bounds())
    return found or ["<none>"]


def reaches_newest(versions: Any) -> bool:
    from pdpatch.vllm_sites import SUPPORTED

    return versions.upper() == SUPPORTED.upper()


def require_tree(version: str) -> Path:
    tree = source_tree(version)
    if version == "<none>" or not (tree / ".complete").exists():
        pytest.skip(f"vLLM {version} source tree not extracted under {SOURCES_ROOT}; run "
                    "scripts/fetch_vllm_sources.sh [VERSION...]")
    return tree


def extras_dir() -> Path:
    """The real third-party packages old releases need (see module docstring)."""
    with _extras_lock:
        missing = [p for p in EXTRA_PACKAGES if not (EXTRAS_ROOT / p).exists()]
        if missing:
            EXTRAS_ROOT.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                 str(EXTRAS_ROOT), *missing], capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                pytest.skip(f"could not install {missing} for old vLLM trees: "
                            f"{proc.stderr[-500:]}")
    return EXTRAS_ROOT


@dataclass
class ReleaseRun:
    version: str
    returncode: int
    result: Any
    stdout: str
    stderr: str

    def tail(self, n: int = 4000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"

    def check(self) -> Any:
        if self.returncode != 0 or self.result is None:
            raise AssertionError(
                f"snippet under vLLM {self.version} failed (rc={self.returncode})\n{self.tail()}")
        return self.result


_PRELUDE = """
import json as _json, sys as _sys
from packaging.version import Version as _V
import pdpatch.versions as _pv
VERSION = {version!r}
TREE = {tree!r}
_pv.vllm_version = lambda: _V(VERSION)
import importlib.metadata as _md
if not _md.version("vllm").startswith(VERSION):
    raise RuntimeError(f"distribution version {{_md.version('vllm')}} is not {{VERSION}}")
def emit(obj):
    _sys.stdout.write("\\n{mark}" + _json.dumps(obj, default=str) + "\\n")
    _sys.stdout.flush()
import vllm as _vllm
if not _vllm.__file__.startswith(TREE):
    raise RuntimeError(f"vllm resolved to {{_vllm.__file__}}, not the tree {{TREE}}")
"""


def vllm_cache_root(version: str) -> Path:
    return VLLM_CACHES_ROOT / version


def child_env(version: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the release tree first on PYTHONPATH, no inherited pdpatch
    settings (a test passes what it wants in ``env``), CPU platform."""
    tree = require_tree(version)
    path = [str(tree), str(dist_info_dir(version)), str(REPO), str(TESTS)]
    if Version(version) < Version("0.24"):
        path.append(str(extras_dir()))
    base = {k: v for k, v in os.environ.items()
            if not (k.startswith("PDPATCH_") or k in ("ENABLE_PDPATCH", "PYTHONPATH"))}
    base.update({"PYTHONPATH": os.pathsep.join(path), "VLLM_TARGET_DEVICE": "cpu",
                 "PYTHONDONTWRITEBYTECODE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(vllm_cache_root(version))})
    cpu_platform.apply(base, version)
    if version == os.environ.get(QUALIFY_VAR):
        base["PDPATCH_ALLOW_UNTESTED_VLLM"] = "1"
    base.update(env or {})
    return base


def _check_worker_group(version: str) -> None:
    """Under the test command's ``--dist loadgroup`` every test taking a release parameter
    runs in that release's group (``tests/xdist_groups.py``), where the callers cache their
    reports; a test outside the group would run the release's code again on the other worker
    (a test hard-coding 0.21.0 once cost CI 73 s that way).  Node ids carry the group only
    under loadgroup."""
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    if grouped(nodeid) and not nodeid.endswith(f"@vllm-{version}"):
        raise AssertionError(
            f"{nodeid} runs vLLM {version}'s code outside that release's worker group: "
            "give the test a `ver` parameter (tests/xdist_groups.py)")


def run_in_release(version: str, snippet: str, *, env: dict[str, str] | None = None,
                   timeout: float = 300) -> ReleaseRun:
    """Run ``snippet`` under vLLM ``version``'s source tree; see the module docstring."""
    _check_worker_group(version)
    tree = require_tree(version)
    code = _PRELUDE.format(version=version, tree=str(tree), mark=RESULT_MARK) \
        + textwrap.dedent(snippet)
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(version, env),
                          capture_output=True, text=True, timeout=timeout, cwd=str(REPO))
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            result = json.loads(line[len(RESULT_MARK):])
    return ReleaseRun(version, proc.returncode, result, proc.stdout, proc.stderr)
