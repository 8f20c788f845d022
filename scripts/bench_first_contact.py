"""Benchmark a decode worker's first contact with a prefill peer, stock vLLM vs pdpatch (issue
24, item 3).

From the checkout root: ``.venv/bin/python -m scripts.bench_first_contact --help``; the logic:
``lab/bench/first_contact.py``.  ``--record`` keeps the run's raw
result file in ``docs/bench/`` (``lab/bench/record.py``), which ``python -m lab.report`` pools.
"""

import sys

from lab.bench.first_contact import main

if __name__ == "__main__":
    sys.exit(main())
