"""Restore a stage written by ``stage.py`` into a site directory (device side, stdlib only)."""

from __future__ import annotations

import lzma
import shutil
import sys
import tarfile
import time
from pathlib import Path

KERNELS = {"vllm_C.so.xz": "vllm/_C_stable_libtorch.abi3.so",
           "fa3.so.xz": "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"}


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
