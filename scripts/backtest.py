"""The backtest of fingerprint turn-ons over vLLM's releases (docs/backtest.md).

From the checkout root: ``.venv/bin/python -m scripts.backtest [--judge] [--write]``; the logic:
``lab/backtest.py``.
"""

import sys

from lab.backtest import main

if __name__ == "__main__":
    sys.exit(main())
