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
CUTLASS_DSL = "nvidia_cutlass_dsl/dsl_packages"
#: A stage's archives only some releases have (0.34.0: NVIDIA's CUTLASS DSL, ``stage.py``):
#: a tree unpacked into the site, or one library decompressed to its place there.
OPTIONAL = {"cutlass.tar.xz": None,
            "cutlass_ir.so.xz": f"{CUTLASS_DSL}/cutlass/_mlir/_mlir_libs/"
                                "_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so"}

#: In a site: the digest of the stage unpacked there.
MARK = ".pdpatch-stage"
#: In ``site.tar.xz``: the names of all the stage's archives, one a line (``stage.py`` writes
#: it), so that a stage carried in several calls is not unpacked with one of them missing.
NEEDS = ".pdpatch-archives"


def site_release(site: Path) -> str:
    """The vLLM release unpacked in ``site`` (from its dist-info's name), or ``"?"``."""
    found = sorted(site.glob("vllm-*.dist-info"))
    return found[0].name.removeprefix("vllm-").removesuffix(".dist-info") if found else "?"


def python_path(site: Path) -> list[Path]:
    """What an engine puts on PYTHONPATH for ``site``: the site, and the CUTLASS DSL's packages
    where the stage had them (its wheels add that folder with a ``.pth`` file, which Python
    reads only in a site directory, not in a PYTHONPATH folder)."""
    return [site, *([site / CUTLASS_DSL] if (site / CUTLASS_DSL).is_dir() else [])]


def archives(stage: Path) -> list[str]:
    """The stage's archives: the three every stage has, and the optional ones it holds."""
    return ["site.tar.xz", *KERNELS, *[n for n in OPTIONAL if (stage / n).is_file()]]


def stage_digest(stage: Path) -> str:
    """sha256 over the stage's archives (~60-130 MB, a fraction of a second)."""
    h = hashlib.sha256()
    for name in archives(stage):
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
    needs = (site / NEEDS).read_text().split() if (site / NEEDS).is_file() else []
    missing = [n for n in needs if not (stage / n).is_file()]
    if missing:
        shutil.rmtree(site, ignore_errors=True)
        raise FileNotFoundError(f"{stage} lacks {', '.join(missing)}: a stage carried in "
                                "several calls needs them all on one warm machine")
    optional = {n: OPTIONAL[n] for n in archives(stage) if n in OPTIONAL}
    for name in [n for n, rel in optional.items() if rel is None]:
        with tarfile.open(stage / name, "r:xz") as tf:
            tf.extractall(site, filter="tar")
    libs = {**KERNELS, **{n: rel for n, rel in optional.items() if rel is not None}}
    for name, rel in libs.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        with lzma.open(stage / name) as src, (site / rel).open("wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        (site / rel).chmod(0o755)
    return time.time() - t0


if __name__ == "__main__":
    print(f"unpacked in {unpack(Path(sys.argv[1]), Path(sys.argv[2])):.1f}s")
