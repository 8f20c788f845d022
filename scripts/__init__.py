"""The commands: thin entry points over ``lab``, run from the checkout root as
``python -m scripts.NAME`` (see ``lab/__init__.py``)."""
