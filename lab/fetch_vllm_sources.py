"""The ``.py`` and ``.json`` tree of vLLM releases' wheels, for the version-matrix tests.

    python3 lab/fetch_vllm_sources.py ROOT VERSION...

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import release_files


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


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    for version in argv[1:]:
        fetch(root, version)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
