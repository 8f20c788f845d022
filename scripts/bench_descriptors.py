"""Benchmark pdpatch's KV descriptor planning and converted transfers (issue 6).

From the checkout root: ``.venv/bin/python -m scripts.bench_descriptors --help``; the logic:
``lab/bench/descriptors.py``.  ``--record`` keeps the run's raw
result file in ``docs/bench/`` (``lab/bench/record.py``), which ``python -m lab.report`` pools.
"""

import sys

from lab.bench.descriptors import main

if __name__ == "__main__":
    sys.exit(main())
