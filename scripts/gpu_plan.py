"""The GPU runs still owed, as device calls in order, each dry-run against the device's limits
(the logic: ``lab/gpu/plan.py``)::

    python3 -m scripts.gpu_plan [--call ID | --write | --check]
"""

import sys

from lab.gpu.plan import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
