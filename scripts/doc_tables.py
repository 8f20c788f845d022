"""Write the README's patch and settings tables from the registry and the declared settings.

From the checkout root: ``.venv/bin/python -m scripts.doc_tables [--check]``; the logic:
``lab/doc_tables.py``.
"""

import sys

from lab.doc_tables import main

if __name__ == "__main__":
    sys.exit(main())
