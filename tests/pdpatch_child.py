"""A child Python process with pdpatch enabled or not, whatever the test's own environment:
the activation tests' way to see what ``import vllm`` does in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_json(args: list[str], *, enable: bool, cwd: Path | None = None) -> tuple[dict, str]:
    """Run ``python ARGS`` on the CPU platform with no ``PDPATCH_*`` setting of the test's
    (``ENABLE_PDPATCH=true`` where ``enable``): the JSON its last stdout line holds, and its
    stderr."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PDPATCH_") and k != "ENABLE_PDPATCH"}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    if enable:
        env["ENABLE_PDPATCH"] = "true"
    out = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr
