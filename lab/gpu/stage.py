"""Build the folder that carries real vLLM GPU engines to the device machine in one run.

The device machine has Python 3.12, torch 2.11.0+cu130, triton, transformers and nvcc, but no
package registry, and a run carries at most 64 MiB (the repository included).  vLLM 0.22-0.26
pin exactly torch 2.11 and are CUDA 13 builds, so their compiled kernels load there; 0.33's
import nothing 2.11 lacks (:mod:`lab.gpu.abi_check`) and its engines serve there, see
:data:`RELEASES`.  The stage holds, each xz-compressed:

* ``vllm_C.so.xz`` -- ``_C_stable_libtorch.abi3.so`` with its CUDA fat binary pruned to sm_90
  (:mod:`fatbin_prune`);
* ``fa3.so.xz`` -- FlashAttention 3 (sm_90 only already);
* ``site.tar.xz`` -- the rest of the vLLM wheel's Python tree (no other compiled kernels, no C++
  headers), NIXL with its UCX plugin only, and the wheels vLLM imports at serve time that the
  device lacks (:data:`WHEELS`, as pip resolves vLLM next to the device's packages);
* ``cutlass.tar.xz`` and ``cutlass_ir.so.xz`` (0.34.0, :data:`CUTLASS_DSL`) -- NVIDIA's CUTLASS
  DSL with its CUDA 13 flavor, the ``cuda-bindings`` it imports and quack: 0.34.0's kernel
  warmup imports MiniMax-M3's CuTe DSL kernels on every CUDA platform, whatever the model (GPU
  run dn: "No module named 'cutlass'").  Its MLIR library (193 MB) is an archive of its own,
  the rest of the DSL the other; they unpack into the site beside vLLM, the DSL's packages in
  ``nvidia_cutlass_dsl/dsl_packages``, which the engines put on their path
  (:func:`lab.gpu.unpack.python_path`: the wheels' ``.pth`` is not read from a PYTHONPATH
  folder);
* ``kvcached/`` -- kvcached's sdist and the ``posix_ipc`` wheel it imports, uncompressed: the
  device builds kvcached against its own torch and CUDA (``scripts/gpu_pd.py --kvcached``; about
  20 s there), so no CUDA toolkit is needed here.

Everything comes from the package index pip is configured with; the vLLM wheel's members are
range-read (:mod:`release_files`), not downloaded whole.  ``unpack.py`` (standard library only)
restores the tree on the device.
"""

from __future__ import annotations

import io
import lzma
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from lab import release_files
from lab.gpu import fatbin_prune, unpack

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

LIMIT = 64 << 20
"""What one device run carries: the stage and the repository's tracked files together."""
VLLM = "0.25.1"
# 0.22-0.26 pin the device's torch (2.11).  0.27-0.32 pin torch 2.13 and 0.33 torch 2.14, whose
# CUDA wheels cannot travel in 64 MiB runs; but from 0.30 the two kernels kept here ask torch
# for no symbol that 2.11's libraries lack (0.27's FlashAttention 3 still does: two C++
# symbols), so 0.30 and 0.33 are staged for the device's torch 2.11; 0.33's engines serve
# there (GPU runs bs-bw), with the packages :data:`WHEEL_PINS` adds.
# 0.34.0 pins torch 2.14 too; its two kept kernels import exactly the 88 and 63 torch symbols
# 0.33.0's do (none new, compared with binutils' nm: docs/gpu_plan.md), so they load where
# 0.33.0's did; its wheel list is 0.33.0's (its METADATA raises only the floors of packages the
# device has or the stage does not carry: huggingface_hub>=2.0 against the device's 1.33, which
# the first 0.34.0 call's import sweep checks).
RELEASES = ("0.25.1", "0.26.0", "0.30.0", "0.33.0", "0.34.0")
# What a release needs instead of a :data:`WHEELS` entry, by that entry's name (its METADATA's
# pins; another distribution of the same module), or besides them (a name not in WHEELS):
# 0.30 and 0.33 import compressed_tensors (which imports loguru) loading any model, 0.33 also
# orjson serving and openai_harmony from oss-harmony.  0.30 is the newest release kvcached 0.1.6
# runs with (its Model Runner V2 adapter covers 0.29-0.30; it refuses 0.33, GPU run bu).
WHEEL_PINS = {
    "0.26.0": {"apache-tvm-ffi": "apache-tvm-ffi==0.1.10"},
    "0.30.0": {"apache-tvm-ffi": "apache-tvm-ffi==0.1.11",
               "compressed-tensors": "compressed-tensors==0.17.0", "loguru": "loguru==0.7.3"},
    "0.33.0": {"apache-tvm-ffi": "apache-tvm-ffi==0.1.11", "xgrammar": "xgrammar==0.2.8",
               "openai-harmony": "oss-harmony==0.0.11", "orjson": "orjson==3.13.0",
               "compressed-tensors": "compressed-tensors==0.17.0", "loguru": "loguru==0.7.3"},
}
WHEEL_PINS["0.34.0"] = dict(WHEEL_PINS["0.33.0"])
CUTLASS_DSL = {
    "0.34.0": ["nvidia-cutlass-dsl==4.8.0", "nvidia-cutlass-dsl-libs-base==4.8.0",
               "nvidia-cutlass-dsl-libs-core==4.8.0", "nvidia-cutlass-dsl-libs-cu13==4.8.0",
               "cuda-bindings==13.5.0", "cuda-pathfinder==1.9.1", "quack-kernels==0.6.5"],
}
"""What a release's engines import from NVIDIA's CUTLASS DSL, installed apart from the site's
wheels: 0.34.0's ``kernel_warmup`` imports ``minimax_m3_msa_warmup`` on every CUDA platform
(kernel_warmup.py:366-372), which imports vllm.models.minimax_m3 (its NVIDIA modules at import
time: ``cutlass``, ``cuda.bindings.driver``, ``quack.compile_utils``, all three outside any
``try``; the fmha_sm100 kernels only inside the functions a MiniMax-M3 model calls).  vLLM pins
``nvidia-cutlass-dsl[cu13]==4.8.0`` and ``quack-kernels==0.6.5``; the DSL's wheels ask for
``cuda-bindings>=12.8`` (the newest, 13.5.0, with the ``cuda-pathfinder`` it imports: whether
the device's torch 2.11 brings its own is not known, and this one comes first on the engines'
path), typing-extensions and protobuf (the device's; neither is imported with ``cutlass``).
Without the cu13 flavor ``import cutlass`` raises "No CTK flavor installed"; cu12's library,
which ``nvidia-cutlass-dsl`` 4.8.0 also asks for, is left out (the device's driver is CUDA 13,
and the DSL picks the newest flavor the driver takes)."""
CUTLASS_IR = unpack.OPTIONAL["cutlass_ir.so.xz"]
"""The DSL's MLIR library: 193 MB, about 49 MiB in xz, so an archive (and a call) of its own."""
CUTLASS_DROP = ("nvidia_cutlass_dsl/cu13/lib/stubs", "bin")
"""Link-time stubs for cross-compiling (aarch64, QNX) and pip's console scripts."""
KEPT_KERNELS = {
    "vllm/_C_stable_libtorch.abi3.so": "vllm_C.so.xz",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": "fa3.so.xz",
}
SMALL_LIBS = {"vllm/cumem_allocator.abi3.so", "vllm/fs_io_C.abi3.so", "vllm/spinloop.abi3.so"}
WHEELS = [
    "fastapi==0.136.3", "starlette==1.10.0", "pydantic==2.14.4", "pydantic-core==2.50.5",
    "typing-inspection==0.4.5", "annotated-types==0.8.0", "uvicorn==0.54.0",
    "watchfiles==1.3.0", "msgspec==0.22.0", "pyzmq==27.3.0", "pybase64==1.5.1",
    "cbor2==6.3.0", "cachetools==8.0.2", "openai==3.57.0", "httpx2==2.16.2",
    "httpcore2==2.16.2", "sniffio==1.3.1", "jiter==0.19.0", "distro==1.9.0",
    "openai-harmony==0.0.8", "llguidance==1.7.6", "xgrammar==0.2.3", "apache-tvm-ffi==0.1.9",
    "partial-json-parser==0.2.1.1.post7", "model-hosting-container-standards==0.1.16",
    "jmespath==1.1.0", "prometheus-fastapi-instrumentator==8.1.0", "setproctitle==1.3.8",
    # pdpatch's own needs, and NIXL
    "wrapt==2.5.2", "xxhash==4.1.0", "nixl==1.5.1", "nixl-cu13==1.5.1",
]
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 *[a for tag in ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
                                 "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                 "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
                                 "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                 "manylinux1_x86_64", "any")
                   for a in ("--platform", tag)]]
KVCACHED = "0.1.6"
KVCACHED_WHEELS = ["posix-ipc==1.3.2"]
NIXL_DROP_DIRS = ("nixl_ep_cu13",)
UNUSED_VLLM_DIRS = ("vllm/third_party/fmha_sm100/", "vllm/third_party/tml_fa4/")
"""Python and JIT sources of Blackwell-only attention kernels (SM100 FMHA, FlashAttention 4),
which only models the engines never serve import (MiniMax-M3, Inkling; 0.33+): 4.9 MB that put
0.33.0's stage and the working tree over 64 MiB together."""
UCX_MODULE_DROP = ("_ib", "perftest", "rdmacm", "mlx5", "efa", "gda")


def wheels_for(release: str) -> list[str]:
    """:data:`WHEELS` with ``release``'s own entries (:data:`WHEEL_PINS`)."""
    pins = WHEEL_PINS.get(release, {})
    names = [w.split("==")[0] for w in WHEELS]
    return [pins.get(n, w) for n, w in zip(names, WHEELS, strict=True)] + \
        [req for n, req in pins.items() if n not in names]


def wanted_vllm_member(name: str, release: str = VLLM) -> bool:
    """The vLLM wheel members the engines need: Python and data files, the two kept kernels
    and the small helper libraries; no other kernel, no C++ source or header."""
    if name in KEPT_KERNELS or name in SMALL_LIBS:
        return True
    if name.endswith((".so", ".h", ".hpp", ".cuh", ".cu", ".cpp", ".c", ".jpg", ".png")):
        return False
    if name == "vllm/vllm-rs":       # the Rust front end's binary, not used here
        return False
    if name.startswith(UNUSED_VLLM_DIRS):
        return False
    return name.startswith(("vllm/", f"vllm-{release}.dist-info/"))


def archives(release: str) -> list[str]:
    """The files a built stage of ``release`` holds, each needed on the device (kvcached's
    folder aside)."""
    extra = list(unpack.OPTIONAL) if release in CUTLASS_DSL else []
    return ["site.tar.xz", *KEPT_KERNELS.values(), *extra]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].split("]", 1)[0] for line in out.splitlines()
            if "(NEEDED)" in line]


def prune_nixl(site: Path) -> None:
    """Keep NIXL's Python bindings, its UCX plugin and what they link, nothing else: the other
    plugins (object stores, GDS, DOCA) and their SDKs are most of the wheel."""
    for d in NIXL_DROP_DIRS:
        shutil.rmtree(site / d, ignore_errors=True)
    libdirs = [site / "nixl_cu13.libs", site / ".nixl_cu13.mesonpy.libs"]
    for plugdir in (site / "nixl_cu13.libs" / "nixl", site / ".nixl_cu13.mesonpy.libs" / "plugins"):
        for f in plugdir.glob("*.so"):
            if f.name != "libplugin_UCX.so":
                f.unlink()
    for f in (site / "nixl_cu13.libs" / "ucx").glob("*"):
        if any(k in f.name for k in UCX_MODULE_DROP) or f.suffix == ".la":
            f.unlink()
    by_name = {f.name: f for d in libdirs for f in d.rglob("*.so*") if f.is_file()}
    roots = [f for f in site.joinpath("nixl_cu13").glob("*.so")]
    roots += [f for d in libdirs for f in d.rglob("*.so*")
              if f.is_file() and (f.parent.name in ("ucx", "nixl", "plugins"))]
    keep: set[Path] = set()
    todo = list(roots)
    while todo:
        lib = todo.pop()
        if lib in keep:
            continue
        keep.add(lib)
        todo += [by_name[n] for n in needed(lib) if n in by_name]
    for f in by_name.values():
        if f not in keep:
            f.unlink()
        else:   # debug sections only (symbols stay): ~4 of 37.6 MB
            subprocess.run(["strip", "--strip-debug", str(f)], check=True)
    shutil.rmtree(site / "include", ignore_errors=True)
    shutil.rmtree(site / "nixl_cu13.scripts", ignore_errors=True)


def prune_xgrammar(site: Path) -> None:
    """xgrammar's static library is never loaded; its bindings carry debug sections."""
    for f in site.joinpath("xgrammar").rglob("*.a"):
        f.unlink()
    for f in site.joinpath("xgrammar").rglob("*.so"):
        subprocess.run(["strip", "--strip-debug", str(f)], check=True)


def xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=9)


def build(stage: Path, cache: Path, release: str = VLLM) -> dict[str, int]:
    """Write the stage of vLLM ``release`` under ``stage``; return each file's size."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip("download", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels), *wheels_for(release))
    work = cache / "site"
    shutil.rmtree(work, ignore_errors=True)
    pip("install", "--no-deps", "--no-index", "--no-compile", *PLATFORM_ARGS,
        "--target", str(work), *[str(w) for w in sorted(wheels.glob("*.whl"))])
    prune_nixl(work)
    prune_xgrammar(work)
    shutil.rmtree(work / "bin", ignore_errors=True)

    name, url, _sha = release_files.release_file(
        "vllm", lambda n: n.startswith(f"vllm-{release}-") and n.endswith("x86_64.whl"))
    print(f"gpu_stage: range-reading {name}", flush=True)
    release_files.extract_wheel_sources(url, work,
                                        lambda n: wanted_vllm_member(n, release))

    stage.mkdir(parents=True, exist_ok=True)
    for old in stage.glob("*.xz"):
        old.unlink()
    for member, out in KEPT_KERNELS.items():
        lib = work / member
        data = lib.read_bytes()
        if member.endswith("_C_stable_libtorch.abi3.so"):
            data, stats = fatbin_prune.prune(data, arch=90)
            print(f"gpu_stage: {member} fat binary pruned to sm_90: {stats}", flush=True)
        (stage / out).write_bytes(xz(data))
        lib.unlink()
    (work / unpack.NEEDS).write_text("\n".join(archives(release)) + "\n")
    (stage / "site.tar.xz").write_bytes(xz(tar(work)))
    if release in CUTLASS_DSL:
        build_cutlass_dsl(stage, cache, release)
    return {f.name: f.stat().st_size for f in sorted(stage.glob("*.xz"))}


def tar(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        tf.add(folder, arcname=".", filter=lambda ti: None if "__pycache__" in ti.name else ti)
    return buf.getvalue()


def build_cutlass_dsl(stage: Path, cache: Path, release: str) -> None:
    """``cutlass.tar.xz`` and ``cutlass_ir.so.xz``: :data:`CUTLASS_DSL`'s wheels installed into
    a folder of their own (unpacked into the site on the device), the MLIR library apart."""
    wheels = cache / "cutlass-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    pip("download", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels), *CUTLASS_DSL[release])
    work = cache / "cutlass"
    shutil.rmtree(work, ignore_errors=True)
    pip("install", "--no-deps", "--no-index", "--no-compile", *PLATFORM_ARGS,
        "--target", str(work), *[str(w) for w in sorted(wheels.glob("*.whl"))])
    for d in CUTLASS_DROP:
        shutil.rmtree(work / d, ignore_errors=True)
    lib = work / CUTLASS_IR
    print(f"gpu_stage: xz of the CUTLASS DSL's MLIR library ({lib.stat().st_size >> 20} MiB; "
          "about two minutes)", flush=True)
    (stage / "cutlass_ir.so.xz").write_bytes(xz(lib.read_bytes()))
    lib.unlink()
    (stage / "cutlass.tar.xz").write_bytes(xz(tar(work)))


def build_kvcached(stage: Path) -> dict[str, int]:
    """kvcached's sdist (checked against the index's sha256) and its runtime wheel under
    ``stage/kvcached``; return each file's size."""
    out = stage / "kvcached"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    name, url, sha = release_files.release_file(
        "kvcached", lambda n: n == f"kvcached-{KVCACHED}.tar.gz")
    release_files.download(url, out / name, sha)
    pip("download", "--no-deps", *PLATFORM_ARGS, "-d", str(out), *KVCACHED_WHEELS)
    return {f"kvcached/{f.name}": f.stat().st_size for f in sorted(out.iterdir())}


def tracked_bytes(repo: Path = REPO) -> int:
    files = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True,
                           check=True).stdout.split(b"\0")
    return sum((repo / f.decode()).stat().st_size for f in files
               if f and (repo / f.decode()).is_file())


def check_size(stage_sizes: dict[str, int], repo_bytes: int, limit: int = LIMIT) -> str:
    """One line saying what a run carries; ValueError when it exceeds what one run takes."""
    total = sum(stage_sizes.values()) + repo_bytes
    parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in stage_sizes.items())
    line = (f"a device run carries {total / 2**20:.1f} MiB of {limit / 2**20:g}: {parts}, "
            f"repository {repo_bytes / 2**20:.1f}")
    if total > limit:
        raise ValueError(line + " -- over the limit; prune more or split the run")
    return line


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", choices=RELEASES, default=VLLM,
                    help="the vLLM release to stage (default %(default)s)")
    ap.add_argument("--stage", type=Path, help="default: .gpu_stage/vllm-<release>")
    ap.add_argument("--cache", type=Path, help="default: ~/.cache/pdpatch/gpu-stage-<release>")
    ap.add_argument("--kvcached", action="store_true",
                    help=f"also stage kvcached {KVCACHED} (built on the device)")
    args = ap.parse_args()
    stage = args.stage or REPO / ".gpu_stage" / f"vllm-{args.vllm}"
    cache = args.cache or Path.home() / ".cache" / "pdpatch" / f"gpu-stage-{args.vllm}"
    sizes = build(stage, cache, args.vllm)
    if args.kvcached:
        sizes.update(build_kvcached(stage))
    repo = tracked_bytes()
    try:
        print("gpu_stage:", check_size(sizes, repo))
    except ValueError:  # too large for one call: it travels as the plan's calls carry it
        from lab.gpu import plan

        groups = plan.carry_groups(args.vllm)
        if not groups or {f for g in groups for f in g} != set(sizes):
            raise
        print(f"gpu_stage: in {len(groups)} calls:", " | ".join(
            check_size({f: sizes[f] for f in g}, repo, LIMIT - plan.HEADROOM) for g in groups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
