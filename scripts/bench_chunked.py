"""Benchmark staged READs larger than the staging buffer (issue 24, item 2).

From the checkout root: ``.venv/bin/python -m scripts.bench_chunked --help``; the logic:
``lab/bench/chunked.py``.  ``--record`` keeps the run's raw
result file in ``docs/bench/`` (``lab/bench/record.py``), which ``python -m lab.report`` pools.
"""

import sys

from lab.bench.chunked import main

if __name__ == "__main__":
    sys.exit(main())
