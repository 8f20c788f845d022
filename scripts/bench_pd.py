"""Benchmark: P/D TTFT and decode throughput with pdpatch on vs off, in one run.

From the checkout root: ``.venv/bin/python -m scripts.bench_pd --help``; the logic:
``lab/bench/pd.py``.
"""

import sys

from lab.bench.pd import main

if __name__ == "__main__":
    sys.exit(main())
