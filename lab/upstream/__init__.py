"""vLLM's own connector suites, stock vs pdpatch (``python -m scripts.upstream_suites``)."""
