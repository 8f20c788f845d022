"""pdpatch's lab: the harness around pdpatch, never shipped in its wheel (``pyproject.toml``
packages ``pdpatch`` only).

A package of the checkout root: its commands run as modules from there (``python -m
scripts.pd_demo``, ``python -m lab.gpu.stage``), which puts the root on ``sys.path`` with any
interpreter (the venv, the device machine's ``python3``); in the venv the editable pdpatch install
also puts the root there, so ``.venv/bin/python scripts/pd_demo.py`` works too.  Its environment
variables: :mod:`lab.env`.
"""
