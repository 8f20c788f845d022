"""The code of patch ``readback_guard``, loaded when vLLM imports the connector's scheduler half
(the patch and why it exists: :mod:`pdpatch.patches.readback_guard`)."""

from __future__ import annotations

from typing import Any

from pdpatch import metrics, vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.readback_guard import NAME


def why_not_queued(scheduler: Any, params: dict) -> str:
    """The setting that keeps the release from starting this readback."""
    if getattr(scheduler, "use_host_buffer", False):
        return "this engine stages KV in a host buffer (kv_buffer_device), which takes " \
               "do_remote_decode requests first"
    if params.get("_remote_blocks_processed"):
        return "its readback was already queued once (the request was preempted)"
    return "kv_connector_extra_config.bidirectional_kv_xfer is off on this engine"


def guard_readback(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    request = arg(args, kwargs, 0, "request", None)
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not params.get("do_remote_decode") or \
            params.get("do_remote_prefill") or not allowed(NAME, instance):
        return result
    count, load_async = result
    if not (load_async and count) or vllm_sites.readback_receive_queued(instance, params):
        return result
    metrics.count(instance, metrics.REFUSALS, NAME)
    kv_role = getattr(getattr(getattr(instance, "vllm_config", None), "kv_transfer_config",
                              None), "kv_role", None)
    logger.warning(
        "pdpatch: request %s asks to read back %d cached tokens from engine %r, which this "
        "engine (kv_role=%s) would never start: %s. Computing its prompt locally instead of "
        "waiting forever [readback_guard]", getattr(request, "request_id", "?"), count,
        params.get("remote_engine_id"), kv_role, why_not_queued(instance, params))
    return vllm_sites.NO_EXTERNAL_TOKENS
