"""Cost of pdpatch on `python -c "import vllm"`: not installed vs installed-but-disabled vs enabled.

From the checkout root: ``.venv/bin/python -m scripts.bench_activation --help``; the logic:
``lab/bench/activation.py``.  ``--record`` keeps the run's raw
result file in ``docs/bench/`` (``lab/bench/record.py``), which ``python -m lab.report`` pools.
"""

import sys

from lab.bench.activation import main

if __name__ == "__main__":
    sys.exit(main())
