#!/usr/bin/env python
"""KV over real NIXL between two processes, planned by pdpatch's own code, on GPU or host memory:
the command line of the bench in ``lab/gpu_bench/`` (see its docstring, or ``--help``).

Run on the GPU machine: ``python3 scripts/gpu_kv_bench.py --device cuda --json out.json``;
on CPU: ``.venv/bin/python scripts/gpu_kv_bench.py --device cpu --quick``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(sys.path[0], "lab"))

from gpu_bench.cli import main

if __name__ == "__main__":
    if os.environ.get("PDPATCH_BENCH_NO_IPC_DEFAULT") == "1":
        os.environ.pop("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", None)
    sys.exit(main())
