"""Benchmark: P/D TTFT and decode throughput with pdpatch on vs off, in one run.

From the checkout root: ``.venv/bin/python -m scripts.bench_pd --help``; the logic:
``lab/bench/pd.py``.  ``--record`` keeps the run's raw
result file in ``docs/bench/`` (``lab/bench/record.py``), which ``python -m lab.report`` pools.
"""

import sys

from lab.bench.pd import main

if __name__ == "__main__":
    sys.exit(main())
