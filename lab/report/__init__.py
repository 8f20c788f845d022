"""Every measured figure of the README and ``docs/``, written from the raw records: the GPU runs'
(``docs/gpu/``, ``docs/gpu_runs/``) and the CPU benches' (``docs/bench/``).

``python -m lab.report`` prints the report; ``--write`` puts each block into the pages whose
marker comments name it (``<!-- BEGIN generated: NAME (python -m lab.report) -->``, see
:mod:`lab.generated`); ``--check`` changes nothing and exits 1 where a page differs from what
would be written (``tests/test_report.py`` runs it).  The parts: :mod:`.records` (the GPU raw
files), :mod:`.epochs` (which GPU runs measured the same code, a reviewed table), :mod:`.cells`
(the pooling), :mod:`.bench` (the CPU benches' records, their reviewed epochs and cells),
:mod:`.stats` (what a cell says), :mod:`.tables` (the blocks), :mod:`.cli`.
"""
