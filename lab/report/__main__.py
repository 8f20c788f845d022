"""``python -m lab.report [--write | --check]``: see :mod:`lab.report`."""

import sys

from lab.report.cli import main

sys.exit(main())
