"""Qualify a vLLM release for pdpatch: static checks, vLLM's own connector tests stock vs pdpatch,
pdpatch's per-release tests, one table per patch into docs/qualify/<release>.md.

From the checkout root: ``.venv/bin/python -m scripts.qualify RELEASE [--against OLDER]``; the
logic: ``lab/qualify.py``.
"""

import sys

from lab.qualify import main

if __name__ == "__main__":
    sys.exit(main())
