"""The fingerprints pdpatch ships for the releases it verified (``pdpatch/verified_sites.json``),
made from the real source trees of those releases.

    .venv/bin/python -m scripts.site_fingerprints            # rewrite the shipped file
    .venv/bin/python -m scripts.site_fingerprints --check    # exit 1 if it has drifted

A verified release is the newest patch release of each minor in ``lab/vllm_releases.txt`` and the
installed one, inside ``vllm_sites.SUPPORTED``; the trees are the fetched wheels' sources
(``scripts/fetch_vllm_sources.sh``), the installed release's is the venv's own package.  For each
release, every site each patch declared for it (:meth:`pdpatch.registry.Patch.sites`).  A site a
patch declares that the release does not have is an error in the declaration, not data.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from packaging.version import Version

from lab.env import cache_dir, path_var
from pdpatch import verified
from pdpatch.patches import all_patches
from pdpatch.site_sources import SourceTree
from pdpatch.versions import vllm_version
from pdpatch.vllm_sites import SUPPORTED

ROOT = Path(__file__).resolve().parents[1]
SOURCES_ROOT = path_var("PDLAB_VLLM_SOURCES", cache_dir() / "vllm-src")


def listed_releases() -> list[str]:
    lines = (ROOT / "lab" / "vllm_releases.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def verified_trees() -> dict[str, Path]:
    """release -> the directory holding its ``vllm`` package, oldest first."""
    trees = {r: SOURCES_ROOT / r for r in listed_releases() if Version(r) in SUPPORTED}
    installed = vllm_version()
    if installed is not None and installed in SUPPORTED:
        trees[str(installed.public)] = verified.installed_root()
    return dict(sorted(trees.items(), key=lambda kv: Version(kv[0])))


def release_sites(release: str, root: Path) -> dict[str, str]:
    """label -> fingerprint of every site a patch declares for ``release``."""
    tree, out, missing = SourceTree(root), {}, []
    version = Version(release)
    for patch in all_patches():
        if version not in patch.versions:
            continue
        for module, qualname in patch.sites(version):
            fp = tree.fingerprint(module, qualname)
            if fp is None:
                missing.append(f"{patch.name}: {verified.label(module, qualname)}")
            out[verified.label(module, qualname)] = fp
    if missing:
        raise LookupError(f"vLLM {release} ({root}) lacks sites its patches declare:\n  "
                          + "\n  ".join(missing))
    return dict(sorted(out.items()))


def generate() -> dict[str, dict[str, str]]:
    trees = verified_trees()
    absent = [r for r, root in trees.items() if not (root / "vllm" / "__init__.py").exists()]
    if absent:
        raise FileNotFoundError(f"no source tree for {', '.join(absent)} under {SOURCES_ROOT}: "
                                "run scripts/fetch_vllm_sources.sh")
    return {r: release_sites(r, root) for r, root in trees.items()}


def render(data: dict[str, dict[str, str]]) -> str:
    return json.dumps(data, indent=1, sort_keys=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the shipped file differs")
    args = ap.parse_args(argv)
    text = render(generate())
    if args.check:
        same = verified.SHIPPED.exists() and verified.SHIPPED.read_text() == text
        print(f"{verified.SHIPPED}: {'up to date' if same else 'DIFFERS from the source trees'}")
        return 0 if same else 1
    verified.SHIPPED.write_text(text)
    print(f"wrote {verified.SHIPPED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
