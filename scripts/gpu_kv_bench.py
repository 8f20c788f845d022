#!/usr/bin/env python
"""KV over real NIXL between two processes, planned by pdpatch's own code, on GPU or host memory:
the command line of the bench in ``lab/gpu_bench/`` (see its docstring, or ``--help``).

Run from the checkout root on the GPU machine: ``python3 -m scripts.gpu_kv_bench --device cuda
--json out.json``; on CPU: ``.venv/bin/python -m scripts.gpu_kv_bench --device cpu --quick``.
"""

import os
import sys

from lab.gpu_bench.cli import main

if __name__ == "__main__":
    if os.environ.get("PDLAB_BENCH_NO_IPC_DEFAULT") == "1":
        os.environ.pop("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", None)
    sys.exit(main())
