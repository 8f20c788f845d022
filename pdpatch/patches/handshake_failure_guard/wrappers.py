"""The code of patch ``handshake_failure_guard``, loaded when vLLM imports the NIXL worker (the
patch and why it exists: :mod:`pdpatch.patches.handshake_failure_guard`)."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed
from pdpatch.patches.handshake_failure_guard import NAME
from pdpatch.registry import Wrapper


def _take_failed(failed: set | queue.Queue, keep: Callable[[str], bool]) -> set[str]:
    """Remove from the release's failed-receive collection (a set up to 0.21, a queue from
    0.22) the requests ``keep`` rejects; returns them.  The handshake thread's callbacks add
    to it concurrently: the set is read through one snapshot (``list`` copies it under the
    GIL), the queue drained and refilled."""
    if isinstance(failed, set):
        taken = {req_id for req_id in list(failed) if not keep(req_id)}
        failed -= taken
        return taken
    drained = []
    while True:
        try:
            drained.append(failed.get_nowait())
        except queue.Empty:
            break
    taken = set()
    for req_id in drained:
        if keep(req_id):
            failed.put(req_id)
        else:
            taken.add(req_id)
    return taken


def _none_failed(failed: Any) -> bool:
    """Whether the release's failed-receive collection is empty: the guard has nothing to take
    then, on every engine step but the few after a failed handshake.  Read without the queue's
    lock: a handshake thread's failure added after this read reaches the release's own call
    unguarded, as one added just after the guard's drain always could (a window of
    microseconds, against the handshake's 5 s timeout)."""
    if isinstance(failed, set):
        return not failed
    return isinstance(failed, queue.Queue) and not failed.queue


def _some(req_ids: list[str], shown: int = 4) -> str:
    """Request ids for a log line: the first few, and how many more."""
    more = len(req_ids) - shown
    return ", ".join(req_ids[:shown]) + (f" and {more} more" if more > 0 else "")


def make_guard(version: Version) -> Wrapper:
    lookup_fault = version in vllm_sites.FAILED_RECV_LOOKUP

    def guard_get_finished(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        failed = getattr(instance, "_failed_recv_reqs", None)
        if _none_failed(failed):
            return wrapped(*args, **kwargs)        # nothing failed: what the guard returns then
        recving = getattr(instance, "_recving_metadata", None)
        if not allowed(NAME, instance) or not isinstance(failed, (set, queue.Queue)) \
                or not isinstance(recving, dict):
            return wrapped(*args, **kwargs)        # not the release's worker state: its own code
        notify_only = _take_failed(
            failed, lambda req_id: not vllm_sites.is_notify_only(recving.get(req_id)))
        for req_id in notify_only:
            recving.pop(req_id, None)
            logger.warning(
                "pdpatch: the handshake for request %s failed, but that request only had to "
                "notify its prefill engine (no KV to receive: a full local prefix hit or an "
                "abort); not reporting it to the scheduler, which never waited for it and "
                "would stop the engine (vLLM 0.30+ does the same); the prefill engine frees "
                "its blocks after its own timeout [handshake_failure_guard]", req_id)
        if not lookup_fault:
            return wrapped(*args, **kwargs)

        def engine_known(req_id: str) -> bool:
            remote = getattr(recving.get(req_id), "remote", None)
            return remote is None or vllm_sites.remote_engine_known(
                instance, remote.engine_id, version)

        if not vllm_sites.failure_recordable(instance, version):
            unknown = sorted(r for r in list(failed) if not engine_known(r))
            if unknown:
                logger.error(
                    "pdpatch: requests %s failed before their prefill engine was known, on a "
                    "hybrid (HMA) KV-cache layout, which vLLM %s cannot report as failed: "
                    "reporting them would let the scheduler decode from KV that never "
                    "arrived (vllm#52234), so the release's own KeyError stands; vLLM 0.30+ "
                    "fails them alone [handshake_failure_guard]", unknown, version)
            return wrapped(*args, **kwargs)
        taken = sorted(_take_failed(failed, lambda req_id: False))
        done_sending, done_recving = wrapped(*args, **kwargs)
        if not taken:
            return done_sending, done_recving
        known: list[str] = []
        unknown: list[str] = []
        for req_id in taken:
            (known if engine_known(req_id) else unknown).append(req_id)
            recving.pop(req_id, None)
            done_recving.add(req_id)
        # one line per engine step, not per request: a refused handshake fails every request
        # queued for that engine at once, and the release logs each of them itself
        logger.warning("pdpatch: %d request(s) failed their handshake (%s); reported as "
                       "failed without vLLM's receive post-processing, as vLLM 0.22+ does "
                       "[handshake_failure_guard]", len(taken), "; ".join(
                           f"{_some(ids)} {when} their prefill engine was known"
                           for ids, when in ((known, "after"), (unknown, "before")) if ids))
        return done_sending, done_recving

    return guard_get_finished
