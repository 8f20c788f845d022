"""Golden block-key fixtures, produced by REAL vLLM's own hashing code, one file per release.

From the checkout root: ``.venv/bin/python -m scripts.make_hash_fixtures --help``; the logic:
``lab/hash_fixtures.py``.
"""

import sys

from lab.hash_fixtures import main

if __name__ == "__main__":
    sys.exit(main())
