"""The three ways into ``pdpatch.install()``: the ``.pth`` hook, vLLM's plugin entry point,
and ``sitecustomize`` (``pdpatch-run``)."""
