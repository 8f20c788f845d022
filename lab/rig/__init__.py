"""The P/D proof rig: real vLLM engines on CPU, a P/D proxy, the demo (``scripts/pd_demo.py``).

Lab code, not in the wheel: ``from lab.rig import proxy`` (see ``lab/__init__.py``).  The
engines it starts need no ``lab/``: they import vLLM and the pdpatch installed next to it,
nothing of the rig.
"""
