"""Real vLLM GPU engines doing P/D over NIXL on the device machine, stock vs pdpatch (the logic:
``lab/gpu/pd.py``).  From the checkout root, with the stage carried::

    python3 -m scripts.gpu_pd --stage .gpu_stage/vllm-0.25.1 --out "$OUT" ref fa-triton ...
"""

import sys

from lab.gpu.pd import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
