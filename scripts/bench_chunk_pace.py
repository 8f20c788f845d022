"""Benchmark what sets the chunked READ's pace on the KV cache's own device (issue 24, item 2).

From the checkout root: ``.venv/bin/python -m scripts.bench_chunk_pace --help``; the logic:
``lab/bench/chunk_pace.py``.
"""

import sys

from lab.bench.chunk_pace import main

if __name__ == "__main__":
    sys.exit(main())
