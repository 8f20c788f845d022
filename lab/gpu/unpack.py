"""Restore a stage written by ``stage.py`` into a site directory (device side, stdlib only)."""

from __future__ import annotations

import hashlib
import lzma
import shutil
import sys
import tarfile
import time
from pathlib import Path

KERNELS = {"vllm_C.so.xz": "vllm/_C_stable_libtorch.abi3.so",
           "fa3.so.xz": "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"}

#: In a site: the digest of the stage unpacked there.
MARK = ".pdpatch-stage"


def site_release(site: Path) -> str:
    """The vLLM release unpacked in ``site`` (from its dist-info's name), or ``"?"``."""
    found = sorted(site.glob("vllm-*.dist-info"))
    return found[0].name.removeprefix("vllm-").removesuffix(".dist-info") if found else "?"


def stage_digest(stage: Path) -> str:
    """sha256 over the stage's archives (~60 MB, a fraction of a second)."""
    h = hashlib.sha256()
    for name in ["site.tar.xz", *KERNELS]:
        h.update(name.encode())
        with (stage / name).open("rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
    return h.hexdigest()


def ensure(stage: Path, site: Path) -> float | None:
    """Unpack ``stage`` into ``site`` unless ``site`` holds exactly this stage already: the
    seconds it took, or None.  A warm device machine keeps ``/tmp`` between calls, and a site
    left by another stage once ran in place of the one carried (run bz: 0.30.0's engines for
    a 0.33.0 run), so anything else there is removed first."""
    digest = stage_digest(stage)
    mark = site / MARK
    if mark.is_file() and mark.read_text() == digest:
        return None
    shutil.rmtree(site, ignore_errors=True)
    took = unpack(stage, site)
    mark.write_text(digest)
    return took


def unpack(stage: Path, site: Path) -> float:
    t0 = time.time()
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(stage / "site.tar.xz", "r:xz") as tf:
        tf.extractall(site, filter="tar")
    for name, rel in KERNELS.items():
        with lzma.open(stage / name) as src, (site / rel).open("wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        (site / rel).chmod(0o755)
    return time.time() - t0


if __name__ == "__main__":
    print(f"unpacked in {unpack(Path(sys.argv[1]), Path(sys.argv[2])):.1f}s")
