"""The P/D proof rig: real vLLM engines on CPU, a P/D proxy, the demo (``scripts/pd_demo.py``).

Lab code, not in the wheel.  Like the rest of ``lab/``, it is imported with ``lab/`` on
``sys.path`` (the scripts put it there, pytest's ``pythonpath`` setting does for the tests):
``from rig import proxy``.  The engines it starts need no ``lab/``: they import vLLM and the
pdpatch installed next to it, nothing of the rig.
"""
