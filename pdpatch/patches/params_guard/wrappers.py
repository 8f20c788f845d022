"""The code of patch ``params_guard``, loaded when vLLM imports the connector's scheduler half (the
patch and why it exists: :mod:`pdpatch.patches.params_guard`)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from packaging.version import Version

from pdpatch import metrics, vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.params_guard import NAME
from pdpatch.registry import Wrapper


def problems(params: Mapping, seeded: tuple[str, ...] | None) -> list[str]:
    """Why the release would raise on ``params``: the unhashable ids, and with ``seeded`` (the
    keys the scheduler fills in itself) the keys its receive path indexes that are missing."""
    out = []
    if seeded is not None:
        missing = [k for k in vllm_sites.RECV_PARAMS_INDEXED
                   if k not in params and k not in seeded]
        out += [f"missing {', '.join(missing)}"] if missing else []
    out += [f"{k} {params[k]!r} is not hashable" for k in vllm_sites.HASHED_PARAMS
            if k in params and not isinstance(params[k], Hashable)]
    return out


def make_guard(version: Version, receive: bool) -> Wrapper:
    """The pre-hook; ``receive``: on the hook that queues the receive (keys checked too)."""

    def guard_params(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        request = arg(args, kwargs, 0, "request", None)
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and params.get("do_remote_prefill") and \
                allowed(NAME, instance):
            seeded = vllm_sites.seeded_recv_params(
                getattr(instance, "connector_scheduler", None), version) if receive else None
            found = problems(params, seeded)
            if found:
                params["do_remote_prefill"] = False
                metrics.count(instance, metrics.REFUSALS, NAME)
                metrics.count(instance, metrics.KV_REQUESTS, *metrics.REFUSED_PARAMS)
                logger.warning(
                    "pdpatch: request %s: kv_transfer_params unusable by vLLM %s's NIXL "
                    "connector (%s): no KV is loaded for it and no prefill engine is told "
                    "to free blocks for it (blocks a prefill engine holds for it stay pinned "
                    "until that engine's own timeout) [params_guard]",
                    getattr(request, "request_id", "?"), version, "; ".join(found))
        return wrapped(*args, **kwargs)

    return guard_params
