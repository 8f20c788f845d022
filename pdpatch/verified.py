"""Where each patch was verified, and whether a newer vLLM's code at the patch's sites is the same.

pdpatch ships ``verified_sites.json``: for every release it was verified on (the newest patch
release of each minor in :data:`pdpatch.vllm_sites.SUPPORTED`), the fingerprint of every vLLM
site a patch rests on there (:meth:`pdpatch.registry.Patch.sites`; made by
``python -m scripts.site_fingerprints``, checked against the real source trees by
``tests/test_verified_sites.py``).

On a release *newer* than every release a patch was verified on -- and only there: never an older
one, never past a range that ended because vLLM fixed the fault itself
(:func:`pdpatch.vllm_sites.newer_than_verified`) -- the patch applies by
itself where each of its sites, as declared for its newest verified release, is identical in the
installed vLLM; otherwise it stays off, naming what changed.  Reading a release's sources costs
tens of milliseconds, so the fingerprints of an installed release are kept in a cache file per
vLLM installation; on a verified release nothing here runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from packaging.version import Version

from pdpatch.site_sources import SourceTree, digest, module_file

if TYPE_CHECKING:
    from pdpatch.registry import Patch

SHIPPED = Path(__file__).with_name("verified_sites.json")


def label(module: str, qualname: str) -> str:
    return f"{module}:{qualname}"


@lru_cache(maxsize=1)
def shipped() -> dict[str, dict[str, str]]:
    """release -> {site label -> fingerprint}, as shipped with pdpatch."""
    return json.loads(SHIPPED.read_text())


def newest_verified(patch: Patch, releases: dict[str, dict[str, str]] | None = None
                    ) -> Version | None:
    """The newest release with shipped fingerprints inside the patch's declared range."""
    found = [Version(r) for r in (shipped() if releases is None else releases)
             if Version(r) in patch.versions]
    return max(found, default=None)


class Verdict(NamedTuple):
    """A newer release's sites against the patch's newest verified release ``reference``."""

    reference: Version | None
    changed: tuple[str, ...]     # labels of sites whose code differs there, or is missing

    @property
    def identical(self) -> bool:
        return self.reference is not None and not self.changed


def compare(patch: Patch, root: Path | None = None) -> Verdict:
    """The installed vLLM's code at ``patch``'s sites against its newest verified release
    (``root``: the directory holding the ``vllm`` package; default: where it is installed)."""
    reference = newest_verified(patch)
    if reference is None:
        return Verdict(None, ("no verified release recorded",))
    expected = shipped()[str(reference)]
    sites = patch.sites(reference)
    found = fingerprints(root or installed_root(), sites)
    changed = tuple(label(m, q) for m, q in sites
                    if found.get(label(m, q)) is None
                    or found[label(m, q)] != expected.get(label(m, q)))
    return Verdict(reference, changed)


def installed_root() -> Path:
    """The directory holding the importable ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("no vllm package is importable")
    return Path(next(iter(spec.submodule_search_locations))).parent


def fingerprints(root: Path, sites: list[tuple[str, str]]) -> dict[str, str | None]:
    """Fingerprints of ``sites`` in the tree at ``root``, through the cache file of that tree
    (one entry per module, valid while the module file's size and mtime are unchanged)."""
    cache_file = _cache_dir() / f"{digest(str(root.resolve()))}.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    tree, dirty, out = SourceTree(root), False, {}
    for module, qualname in sites:
        path = module_file(root, module)
        stat = None if path is None else [path.stat().st_size, path.stat().st_mtime_ns]
        entry = cache.get(module)
        if entry is None or entry.get("stat") != stat:
            entry = cache[module] = {"stat": stat, "sites": {}}
        if qualname not in entry["sites"]:
            entry["sites"][qualname] = tree.fingerprint(module, qualname)
            dirty = True
        out[label(module, qualname)] = entry["sites"][qualname]
    if dirty:
        _write(cache_file, cache)
    return out


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdpatch" / "site-fingerprints"


def _write(path: Path, data: dict) -> None:
    """Atomically (several vLLM processes start at once); a cache that cannot be written only
    costs the next process the same parse."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
