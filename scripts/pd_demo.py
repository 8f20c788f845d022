#!/usr/bin/env python
"""P/D demo: two real vLLM engines doing prefill/decode over real NIXL with pdpatch active.

Run from a fresh clone: ``bash scripts/setup_env.sh && .venv/bin/python -m scripts.pd_demo``
(``.venv/bin/python scripts/pd_demo.py`` too: the venv's editable install puts the checkout on
``sys.path``).  ``--vllm RELEASE`` runs the engines on that release's own CPU build.  The logic:
``lab/rig/demo.py``.
"""

import sys

from lab.rig.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
