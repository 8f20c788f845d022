"""Run vLLM's own NIXL connector tests with pdpatch disabled and enabled, and compare.

From the checkout root: ``.venv/bin/python -m scripts.upstream_suites --help``; the logic:
``lab/upstream/cli.py``.
"""

import sys

from lab.upstream.cli import main

if __name__ == "__main__":
    sys.exit(main())
