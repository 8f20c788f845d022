"""Test-only: make a real CPU vLLM engine allocate its KV cache the way kvcached does.

kvcached (CUDA virtual memory) hands vLLM per-layer views over a reservation with more blocks
than vLLM planned.  This CPU stand-in does the same to vLLM 0.33's own allocator
(``vllm.v1.worker.utils.allocate_kv_cache``): it allocates ``factor`` x the planned blocks and
returns vLLM's own views over that larger buffer, so the model runner and the NIXL worker see
``as_strided`` views with ``shape[0] > kv_cache_config.num_blocks`` while the scheduler still
hands out only the planned block ids.

Active only when ``KVC_E2E_OVERALLOCATE`` (a factor, e.g. ``2.5``) is set in the engine's
environment; the variable is deliberately not ``PDPATCH_``-prefixed, because pdpatch rejects
unknown ``PDPATCH_*`` names.  Put this directory on ``PYTHONPATH``: Python imports
``sitecustomize`` in every process of the engine (API server, EngineCore, workers).
"""

from __future__ import annotations

import os
import sys

FACTOR_VAR = "KVC_E2E_OVERALLOCATE"


def _over_allocate(wrapped, instance, args, kwargs):
    import dataclasses
    import math

    factor = float(os.environ[FACTOR_VAR])
    if "kv_cache_config" in kwargs:
        kwargs = dict(kwargs)
        kv_cache_config, rest = kwargs.pop("kv_cache_config"), args
    else:
        kv_cache_config, rest = args[0], args[1:]
    planned = kv_cache_config.num_blocks
    virtual = math.ceil(planned * factor)
    tensors = []
    for t in kv_cache_config.kv_cache_tensors:
        layer_outermost = t.layer_stride == t.block_stride * planned   # LB* layouts
        tensors.append(dataclasses.replace(
            t,
            size=-(-t.size * virtual // planned),
            layer_stride=t.block_stride * virtual if layer_outermost else t.layer_stride))
    bigger = dataclasses.replace(kv_cache_config, num_blocks=virtual, kv_cache_tensors=tensors)
    caches = wrapped(bigger, *rest, **kwargs)
    shapes = {tuple(v.shape) for v in caches.values() if hasattr(v, "shape")}
    print(f"[kvc-e2e] pid {os.getpid()}: over-allocated KV cache: planned {planned} blocks, "
          f"views hold {virtual} ({sorted(shapes)})", file=sys.stderr, flush=True)
    return caches


def _install() -> None:
    if not os.environ.get(FACTOR_VAR):
        return
    import wrapt

    @wrapt.when_imported("vllm.v1.worker.utils")
    def _hook(module):
        wrapt.wrap_function_wrapper(module, "allocate_kv_cache", _over_allocate)


_install()
