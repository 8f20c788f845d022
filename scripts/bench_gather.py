"""Benchmark a staged READ's gather planning, fused copy vs index ops, per number of copies.

From the checkout root: ``.venv/bin/python -m scripts.bench_gather --help``; the logic:
``lab/bench/gather.py``.
"""

import sys

from lab.bench.gather import main

if __name__ == "__main__":
    sys.exit(main())
