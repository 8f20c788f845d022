"""Every measured GPU figure of the README and ``docs/``, written from the raw records.

``python -m lab.report`` prints the report; ``--write`` puts each block into the pages whose
marker comments name it (``<!-- BEGIN generated: NAME (python -m lab.report) -->``, see
:mod:`lab.generated`); ``--check`` changes nothing and exits 1 where a page differs from what
would be written (``tests/test_report.py`` runs it).  The parts: :mod:`.records` (the raw files),
:mod:`.epochs` (which runs measured the same code, a reviewed table), :mod:`.cells` (the
pooling), :mod:`.stats` (what a cell says), :mod:`.tables` (the blocks), :mod:`.cli`.
"""
