"""Patch ``handshake_failure_guard``: on vLLM 0.19-0.29 a failed handshake no longer kills the
decode worker or the engine core through ``get_finished``.

Found by fault injection (bad peers).  Two faults of the release's own failure path:

* **Unknown engine (0.19-0.21).**  When the handshake with a prefill engine fails before
  ``add_remote_agent`` registered it -- the prefill engine is dead (ZMQ times out after 5 s),
  the compatibility hash differs, the peer's metadata is rejected -- the release marks the
  waiting requests failed, and its ``get_finished`` then runs the heterogeneous-block-size
  post-processing for them too, looking the unknown engine up: ``KeyError`` on the
  model-runner thread, the worker dies (0.19.0 ``nixl_connector.py`` L2302, 0.20.2
  ``nixl/worker.py`` L1685, same in 0.21.0).  0.22 skips failed requests there ("Skip KV sync
  and post-processing for failed requests").  The wrapper does what 0.22 does: requests
  listed as failed whose remote engine is unknown are taken out of ``_failed_recv_reqs``
  before the original runs and added to its ``done_recving`` afterwards, with their metadata
  dropped.  Their blocks were already marked invalid by the release's own handshake-failure
  callback, so the scheduler recomputes or fails them.  The same is done for failed requests
  whose engine *is* known (a handshake refused after registration, as by ``layout``'s
  blocks-first guard): the post-processing would reorder blocks that never arrived, and on a
  blocks-first cache with a block-size ratio that reorder raises ``ValueError`` -- the worker
  dies the same way.  On a hybrid (HMA) layout the callback marks nothing (those releases
  cannot express the failure) and a report would have the scheduler decode from KV that never
  arrived (vllm#52234): there the release's own error stands, as ``read_guard`` leaves it.
* **Notify-only receive of an HMA model (0.19-0.29).**  A full local prefix hit (or a request
  aborted before it was scheduled) still queues a receive, with no local blocks: the worker
  only owes P the notification that frees P's blocks, and the scheduler never parks the
  request on it.  When that receive's handshake fails, an HMA model's failure path lists the
  request as failed (the others raise IndexError inside the callback first, before listing
  it), ``get_finished`` reports it as done receiving, and the scheduler's
  ``_update_from_kv_xfer_finished`` asserts the request is parked or finished: the engine
  core dies (see :data:`pdpatch.vllm_sites.NOTIFY_ONLY_UNFLAGGED`).  The wrapper does what 0.30
  does, which never stores such a receive: it is taken out of the failed requests and its
  metadata dropped, unreported.  Its KV is already local (the request runs on), and P frees
  its blocks after its own timeout -- what every release does when this notification fails.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed
from pdpatch.registry import Patch, Target, Wrapper

NAME = "handshake_failure_guard"


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


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.GET_FINISHED, version)
    return [] if site is None else [Target(site.module, site.qualname, make_guard(version))]


PATCH = Patch(
    name=NAME,
    summary="a failed handshake fails its requests without crashing get_finished (0.19-0.21) "
            "and leaves notify-only receives unreported (0.19-0.29)",
    versions=vllm_sites.supported_until("0.30"),
    why_version="fixed upstream: get_finished skips failed requests from vLLM 0.22.0, "
                "notify-only receives are never stored from vLLM 0.30.0",
    targets=_targets,
    relies_on=(vllm_sites.BACKGROUND_HANDSHAKE, vllm_sites.HANDLE_FAILED_TRANSFER,
               vllm_sites.START_LOAD_KV),
)
