"""Patch ``read_guard``: an exception on the KV read path fails that request, not the worker.

``_read_blocks_for_req`` runs on the model-runner thread outside any ``try``; its asserts
(``num_local_blocks <= len(remote)`` and relatives, present through 0.33) and any unexpected
error there kill the worker and with it the engine.  Wrapped, the request's KV load is recorded
as failed with the release's own bookkeeping, so the scheduler recomputes or fails just that
request and the engine keeps serving others.
"""

from __future__ import annotations

import threading
from typing import Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.log import logger
from pdpatch.registry import Patch, Target

_counter_lock = threading.Lock()
failures_contained = 0


def _req_id(args: tuple, kwargs: dict) -> str:
    return kwargs["req_id"] if "req_id" in kwargs else args[0]


def guard_read(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    global failures_contained
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:
        req_id = _req_id(args, kwargs)
        with _counter_lock:
            failures_contained += 1
        logger.error(
            "pdpatch: KV load of request %s failed (%s: %s); failing this request instead of "
            "the worker [read_guard, %d so far]", req_id, type(exc).__name__, exc,
            failures_contained, exc_info=logger.isEnabledFor(10))
        vllm_sites.record_recv_failure(instance, req_id)
        return None


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.READ_BLOCKS_FOR_REQ, version)
    return [] if site is None else [Target(site.module, site.qualname, guard_read)]


PATCH = Patch(
    name="read_guard",
    summary="exceptions on the NIXL read path fail one request instead of killing the worker",
    versions=">=0.33,<0.34",
    why_version="not yet verified on this release",
    targets=_targets,
)
