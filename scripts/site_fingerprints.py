"""Write pdpatch/verified_sites.json from the verified releases' source trees.

From the checkout root: ``.venv/bin/python -m scripts.site_fingerprints [--check]``; the logic:
``lab/site_fingerprints.py``.
"""

import sys

from lab.site_fingerprints import main

if __name__ == "__main__":
    sys.exit(main())
