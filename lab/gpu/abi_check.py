"""Whether a vLLM release's kept kernels can load on another torch: every symbol they import
from torch's libraries, looked up in that torch's exported symbols.

The device has torch 2.11 and no package index; 0.27-0.33 pin torch 2.13-2.14, whose CUDA
wheels cannot travel in 64 MiB runs.  The kernels a stage keeps (:data:`stage.KEPT_KERNELS`)
are the only compiled code it carries, so if none of their imports is missing from 2.11's
libraries, they can load there (then only the device can say whether vLLM's Python runs:
0.33.0's does, GPU runs bs-bw; :mod:`lab.gpu.import_sweep` names what a stage still lacks).
The kernels and torch's libraries are range-read from the index (:mod:`lab.release_files`);
symbols are read with binutils' ``nm``.

    python -m lab.gpu.abi_check --vllm 0.33.0 --torch 2.11.0
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from lab import release_files
from lab.gpu import stage

TORCH_LIBS = ("libtorch.so", "libtorch_cpu.so", "libtorch_cuda.so", "libc10.so",
              "libc10_cuda.so")
TORCH_NAMESPACES = ("_ZN3c10", "_ZNK3c10", "_ZN2at", "_ZNK2at", "_ZN5torch", "_ZNK5torch",
                    "_ZNR5torch", "aoti_torch_", "torch_")
"""Mangled prefixes of c10, at and torch, and the stable C shim's names: the symbols a kernel
can only find in torch's libraries."""


def symbols(lib: Path, *, defined: bool) -> set[str]:
    """A library's dynamic symbols it exports (``defined``) or imports, without versions."""
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, str(lib)], capture_output=True, text=True,
                         check=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.split()}


def missing(kernel_imports: set[str], torch_exports: set[str]) -> list[str]:
    """The kernel's imports from torch's namespaces that torch does not export."""
    return sorted(s for s in kernel_imports - torch_exports if s.startswith(TORCH_NAMESPACES))


def fetch(project: str, version: str, accept_suffix: str, members: set[str], dest: Path) -> None:
    name, url, _sha = release_files.release_file(
        project, lambda n: n.startswith(f"{project}-{version}-") and n.endswith(accept_suffix))
    print(f"abi_check: range-reading {name}", flush=True)
    release_files.extract_wheel_sources(url, dest, lambda n: n in members)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", action="append", help="vLLM release (repeatable)")
    ap.add_argument("--torch", default="2.11.0", help="the torch the kernels should load on")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fetch("torch", args.torch, "cp312-cp312-manylinux_2_28_x86_64.whl",
              {f"torch/lib/{lib}" for lib in TORCH_LIBS}, root / "torch")
        exports = set().union(*(symbols(root / "torch/torch/lib" / lib, defined=True)
                                for lib in TORCH_LIBS))
        worst = 0
        for release in args.vllm or [stage.VLLM]:
            fetch("vllm", release, "x86_64.whl", set(stage.KEPT_KERNELS), root / release)
            for member in stage.KEPT_KERNELS:
                gone = missing(symbols(root / release / member, defined=False), exports)
                worst = max(worst, len(gone))
                print(f"vLLM {release} {member}: {len(gone)} torch symbols missing from "
                      f"torch {args.torch}" + "".join(f"\n    {s}" for s in gone))
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
