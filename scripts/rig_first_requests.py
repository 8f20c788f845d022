"""Time a decode engine's first P/D requests on the CPU rig; the logic and the options:
``lab/rig/first_requests.py``.

From the checkout root: ``.venv/bin/python -m scripts.rig_first_requests [--rounds N]``.
"""

import sys

from lab.rig.first_requests import main

if __name__ == "__main__":
    sys.exit(main())
