"""Block keys of a 32k-token request: pdpatch.hashing vs vLLM's own ``hash_block_tokens`` chain.

From the checkout root: ``.venv/bin/python -m scripts.bench_block_keys --help``; the logic:
``lab/bench/block_keys.py``.  ``--record`` keeps the run's raw
result file in ``docs/bench/`` (``lab/bench/record.py``), which ``python -m lab.report`` pools.
"""

import sys

from lab.bench.block_keys import main

if __name__ == "__main__":
    sys.exit(main())
