"""The benchmarks behind ``scripts/bench_*.py`` (run as ``python -m scripts.bench_NAME``)."""
