"""Which distribution this ``pdpatch`` package came from, and whether a foreign one shares its name.

pdpatch is distributed as ``vllm-pdpatch``; its import package and command are ``pdpatch``.  The
public index's ``pdpatch`` is an unrelated pandas library whose wheel also installs a top-level
``pdpatch`` package, so ``pip install pdpatch`` (or a dependency that pulls it in) overwrites our
files, or leaves its own modules next to ours.  Either way the result is neither package; this
module says so before an operator debugs the wrong thing.

Reads only this package's own directory and its site directory (no scan of ``sys.path``): the
startup summary line calls it in every vLLM process.
"""

from __future__ import annotations

import os
from pathlib import Path

DIST = "vllm-pdpatch"                 # our distribution name (pyproject.toml [project] name)
FOREIGN_DIST = "pdpatch"              # the unrelated public distribution of the same import name
PACKAGE_DIR = Path(__file__).resolve().parent


def _dist_infos(site_dir: Path) -> dict[str, list[Path]]:
    """Our and the foreign distribution's ``<name>-<version>.dist-info`` directories in
    ``site_dir``, by distribution name (one directory listing, of names: a ``Path`` for each of
    a site directory's hundreds of entries cost ~1 ms of every vLLM process's start)."""
    wanted = {name.replace("-", "_"): name for name in (DIST, FOREIGN_DIST)}
    found: dict[str, list[Path]] = {DIST: [], FOREIGN_DIST: []}
    try:
        entries = sorted(os.listdir(site_dir))
    except OSError:
        return found
    for entry in entries:
        if entry.endswith(".dist-info"):
            name = wanted.get(entry.removesuffix(".dist-info").rsplit("-", 1)[0].lower())
            if name:
                found[name].append(site_dir / entry)
    return found


def _version(dist_info: Path) -> str:
    return dist_info.name.removesuffix(".dist-info").rsplit("-", 1)[-1]


def _editable_root(direct_url: str | None) -> Path | None:
    """The source directory of an editable install, from its PEP 610 ``direct_url.json``."""
    import json

    try:
        info = json.loads(direct_url or "")
    except ValueError:
        return None
    url = info.get("url", "") if isinstance(info, dict) else ""
    if info.get("dir_info", {}).get("editable") and url.startswith("file://"):
        return Path(url.removeprefix("file://")).resolve()
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _record_mismatch(dist_info: Path, site_dir: Path, only: str = "") -> str:
    """The first of our installed files (or just ``only``) whose bytes differ from our RECORD
    ("" if none)."""
    import base64
    import hashlib

    record = _read(dist_info / "RECORD") or ""
    # RECORD is CSV (path,sha256=digest,size); our paths hold no comma or quote, so a split
    # reads them (the csv module would be one more import in every vLLM process)
    for line in record.splitlines():
        name, _, rest = line.partition(",")
        digest = rest.partition(",")[0]
        if not name.startswith("pdpatch/") or not digest.startswith("sha256=") or \
                (only and name != only):
            continue
        try:
            data = (site_dir / name).read_bytes()
        except OSError:
            return f"{name} is missing"
        actual = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        if actual != digest.removeprefix("sha256="):
            return f"{name} was overwritten"
    return ""


def foreign_pdpatch(package_dir: Path = PACKAGE_DIR, deep: bool = True) -> list[str]:
    """Sentences naming what makes the imported ``pdpatch`` not (only) ours; [] when it is ours.

    Checks: the unrelated ``pdpatch`` distribution installed in the same site directory (its
    files share our package directory), and, for a regular install, our RECORD's hashes of the
    files in ``pdpatch/`` (another wheel overwrote them; ``deep=False``: only
    ``pdpatch/__init__.py``, which every wheel of a ``pdpatch`` package writes, so that the
    startup line costs one small file's hash).  A source tree on ``sys.path`` with no
    distribution at all is not foreign, only not installed: see :func:`installed_as`.
    """
    site_dir = package_dir.parent
    infos = _dist_infos(site_dir)
    found = []
    for info in infos[FOREIGN_DIST]:
        found.append(f"the unrelated '{FOREIGN_DIST}' {_version(info)} (a pandas library from the "
                     f"public index) is installed in {site_dir} and shares the import name "
                     f"pdpatch: `pip uninstall {FOREIGN_DIST} {DIST}`, then reinstall {DIST}")
    for info in infos[DIST]:
        if _editable_root(_read(info / "direct_url.json")) is None:
            bad = _record_mismatch(info, site_dir, "" if deep else "pdpatch/__init__.py")
            if bad:
                found.append(f"{bad}, not as {DIST} {_version(info)} installed it: another "
                             f"package wrote into pdpatch/; reinstall {DIST}")
    return found


def installed_as(package_dir: Path = PACKAGE_DIR) -> str:
    """How this package is installed: ``"vllm-pdpatch 0.1.0"``, ``"vllm-pdpatch 0.1.0
    (editable: /src)"``, or ``""`` (a source tree on ``sys.path``, or an editable install whose
    metadata lives in another site directory)."""
    import importlib.metadata as md

    try:
        dist = md.distribution(DIST)
    except md.PackageNotFoundError:
        return ""
    root = _editable_root(dist.read_text("direct_url.json"))
    if root is not None:
        inside = package_dir == root or root in package_dir.parents
        return f"{DIST} {dist.version} (editable: {root})" if inside else ""
    site_dir = Path(str(dist.locate_file(""))).resolve()
    return f"{DIST} {dist.version}" if site_dir == package_dir.parent else ""
