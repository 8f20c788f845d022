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

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.installer import state_of
from pdpatch.log import logger
from pdpatch.registry import Patch, Target
from pdpatch.state import State

if TYPE_CHECKING:          # the rules are imported when a worker registers its KV, not earlier
    from pdpatch import transport

NAME = "transport_check"


@dataclass
class TransportCheckState(State):
    checked: bool = False      # the check ran (once per process: the first registration)


def findings_for(worker: Any, kv_caches: dict[str, Any]) -> list[transport.Finding]:
    from pdpatch import transport

    device = getattr(worker, "kv_buffer_device", "cuda")
    memory = []
    if device == "cuda" and kv_caches:
        first = next(iter(kv_caches.values()))
        memory.append(transport.probe_memory(first.data_ptr(), label="kv_caches"))
    version = vllm_sites.running_release()
    push = vllm_sites.pushes(worker, version)
    extensible = vllm_sites.extensible_kv_cache_on(getattr(worker, "vllm_config", None), version)
    return transport.check_transport(os.environ, memory=memory, kv_buffer_device=device,
                                     pull=not push,
                                     peers_map_memory=_peers_map_memory(worker, push),
                                     extensible_kv_cache=extensible)


def _peers_map_memory(worker: Any, push: bool) -> bool:
    """Whether peers transfer this worker's KV memory: P's in pull mode (D READs it), D's in
    push mode (P WRITEs into it); both for ``kv_both``, and where the role is not known."""
    config = getattr(worker, "kv_transfer_config", None)
    if config is None:
        return True
    return bool(config.is_kv_consumer if push else config.is_kv_producer)


def check_after_register(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    state = state_of(NAME)
    if not state.checked:
        state.checked = True
        kv_caches = kwargs.get("kv_caches", args[0] if args else {})
        try:
            found = findings_for(instance, kv_caches)
        except Exception as exc:       # a diagnostic must never break registration
            logger.debug("pdpatch transport_check failed: %r", exc)
            return result
        if found:
            from pdpatch.transport import format_findings

            logger.warning(format_findings(found))
    return result


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.REGISTER_KV_CACHES, version)
    return [] if site is None else [Target(site.module, site.qualname, check_after_register)]


PATCH = Patch(
    name=NAME,
    summary="warn when NIXL/UCX will move KV over a slow transport (VMM memory peers map, "
            "cuda_ipc READ off) and say what to set",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.PUSH_WORKER, vllm_sites.KV_ROLE_PREDICATES),
    state=TransportCheckState,
)
