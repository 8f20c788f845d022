"""The code of patch ``transport_check``, loaded when vLLM imports the NIXL worker (the patch and
why it exists: :mod:`pdpatch.patches.transport_check`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdpatch import vllm_sites
from pdpatch.installer import state_of
from pdpatch.log import logger
from pdpatch.patches.transport_check import NAME
from pdpatch.state import State

if TYPE_CHECKING:          # the rules are imported when a worker registers its KV, not earlier
    from pdpatch import transport


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
