#!/usr/bin/env python
"""P/D demo: two real vLLM engines doing prefill/decode over real NIXL with pdpatch active.

Run from a fresh clone: ``bash scripts/setup_env.sh && .venv/bin/python scripts/pd_demo.py``.
The logic lives in :mod:`pdpatch.rig.demo`; this wrapper only makes the checkout importable.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdpatch.rig.demo import main

if __name__ == "__main__":
    sys.exit(main())
