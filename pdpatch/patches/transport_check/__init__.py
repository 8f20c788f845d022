"""Patch ``transport_check``: after KV registration, say when NIXL/UCX will move KV slowly.

UCX picks its transport silently; measured on an H200 (docs/gpu_results.md), READs of kvcached's
CUDA-VMM pages and UCX's default cuda_ipc GET setting each turned a same-node KV pull into TCP
loopback at ~0.5 GB/s.  Nothing fails, so without this the operator only sees slow TTFT.  The
check runs once per worker, on the tensors just registered, and only logs (``pdpatch.transport``
holds the rules).  The worker's role and transfer mode say whether peers map its memory: a
decode worker's READs into its own kvcached pool are not slowed (runs z, ce, cn).

vLLM 0.34's own extensible KV cache is CUDA VMM memory too (``ExtensibleKVCache``,
``v1/worker/extensible_kv_cache.py``).  vLLM keeps it off by default for NIXL where no IMEX
channel is open (``config/vllm.py`` L3247-3262) and gives its pages a FABRIC handle, which
cuda_ipc maps, where one is (``utils/vmm_driver.py`` L327-348); forced on without one
(``--enable-extensible-kv-cache``), or where the FABRIC allocation fails (L351-368), its pages
are the slow case above, and the finding names the extensible cache and its two settings
(:func:`pdpatch.vllm_sites.extensible_kv_cache_on`).  The rules hold unchanged through 0.34:
the worker registers in ``register_kv_caches`` (0.34.0 base_worker.py L1558-2011) and the
push worker overrides it calling ``super()`` (push_worker.py L157-158).
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "transport_check"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.REGISTER_KV_CACHES, _code("check_after_register")))


PATCH = Patch(
    name=NAME,
    summary="warn when NIXL/UCX will move KV over a slow transport (VMM memory peers map, "
            "cuda_ipc READ off) and say what to set",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.PUSH_WORKER, vllm_sites.KV_ROLE_PREDICATES),
    state=_code("TransportCheckState"),
)
