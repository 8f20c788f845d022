"""The code of patch ``hma_failed_recv``, loaded when vLLM imports the decode worker, the
connector or the scheduler it wraps (the patch and why it exists:
:mod:`pdpatch.patches.hma_failed_recv`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from pdpatch import attached, vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.hma_failed_recv import NAME

SENTINEL = -1
"""Added to ``invalid_block_ids`` so that the release calls ``_handle_invalid_blocks`` (which
it does only when some id is there); no block has a negative id, and the wrapper takes it out
before the release's code sees the set."""


@dataclass
class FailedReceives:
    """The worker meta: request ids whose KV receive failed, from every worker (``aggregate``:
    their union).  Duck-typed as vLLM's ``KVConnectorWorkerMetadata`` (vLLM's aggregation and
    transport call only ``aggregate`` and pickle it), so pdpatch imports no vLLM class here."""

    req_ids: frozenset[str] = frozenset()

    def aggregate(self, other: Any) -> Any:
        if isinstance(other, FailedReceives):
            return FailedReceives(self.req_ids | other.req_ids)
        return self


@dataclass
class WorkerFailures:
    """A decode worker's HMA requests it failed (written by the handshake thread too) and those
    its ``get_finished`` reported, to hand to the scheduler."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    failed: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)


@dataclass
class SchedulerFailures:
    """A scheduler's failed receives of the step being processed."""

    req_ids: set[str] = field(default_factory=set)


def _hma(worker: Any) -> bool:
    return bool(getattr(worker, "_is_hma_required", False))


def note_failure(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Worker (``_handle_failed_transfer``): an HMA request the release fails."""
    if _hma(instance) and allowed(NAME, instance) and not vllm_sites.pushes(instance, _v()):
        req_id = arg(args, kwargs, 0, "req_id", None)
        if isinstance(req_id, str) and req_id in getattr(instance, "_recving_metadata", {}):
            mine = attached.entry(instance, NAME, WorkerFailures)
            with mine.lock:
                mine.failed.add(req_id)
    return wrapped(*args, **kwargs)


def serves(worker: Any) -> bool:
    """Whether this patch's channel serves ``worker``: an HMA pull-mode decode worker whose
    ``_handle_failed_transfer`` its live wrapper notes, allowed by the deployment's toggle."""
    from pdpatch import installer

    return (_hma(worker) and allowed(NAME, worker)
            and installer.wraps(NAME, type(worker), "_handle_failed_transfer")
            and not vllm_sites.pushes(worker, _v()))


def fail_alone(worker: Any, req_id: str) -> bool:
    """Fail one HMA request's KV load through this channel for another patch (``read_guard``:
    an error on its read path; ``peer_restart``: a request of a peer D stopped reading from),
    where the release itself could only crash or report it loaded.  True when taken: not
    being read, the release's own ``_handle_failed_transfer`` queues it (``note_failure``
    notes it); READs still posted, it is noted now and reported failed when they finish.
    False where this channel does not serve the worker (:func:`serves`) or nothing awaits the
    request: the caller keeps the release's behaviour."""
    if not serves(worker) or req_id not in getattr(worker, "_recving_metadata", {}):
        return False
    if getattr(worker, "_recving_transfers", {}).get(req_id):
        mine = attached.entry(worker, NAME, WorkerFailures)
        with mine.lock:
            mine.failed.add(req_id)
    else:
        worker._handle_failed_transfer(req_id, None)
    return True


def record_failure(worker: Any, req_id: str, version: Version,
                   release_way: Any = None) -> None:
    """Fail one request's KV load with the release's own bookkeeping (``release_way``:
    :func:`~pdpatch.vllm_sites.record_recv_failure` or :func:`~pdpatch.vllm_sites.fail_unread`),
    or, where that cannot take an HMA request (before 0.30), through this channel
    (:func:`fail_alone`); raises the release's :class:`~pdpatch.vllm_sites.FailureNotRecordable`
    where neither can."""
    try:
        (release_way or vllm_sites.record_recv_failure)(worker, req_id, version)
    except vllm_sites.FailureNotRecordable:
        if not fail_alone(worker, req_id):
            raise


def collect_reported(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Worker (``get_finished``): the failed requests it reports done this step."""
    result = wrapped(*args, **kwargs)
    mine = attached.peek(instance, NAME)
    if mine is not None and mine.failed:
        try:
            done = set(result[1] or ())
        except (TypeError, IndexError):
            return result
        with mine.lock:
            now = mine.failed & done
            mine.failed -= now
            mine.reported |= now
    return result


def send_reported(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Connector facade (``build_connector_worker_meta``, right after ``get_finished``): the
    reported failures go to the scheduler with this step's output."""
    result = wrapped(*args, **kwargs)
    worker = getattr(instance, "connector_worker", None)
    mine = None if worker is None else attached.peek(worker, NAME)
    if result is None and mine is not None and mine.reported:
        with mine.lock:
            ids, mine.reported = frozenset(mine.reported), set()
        return FailedReceives(ids)
    return result


def _failed_in(meta: Any) -> set[str]:
    if isinstance(meta, FailedReceives):
        return set(meta.req_ids)
    inner = getattr(meta, "metadata", None)           # MultiConnector's tuple of metas
    if isinstance(inner, tuple):
        return set().union(*(_failed_in(m) for m in inner)) if inner else set()
    return set()


def take_failures(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Scheduler (``update_from_output``): failed receives of requests still waiting for their
    KV go down the release's invalid-block path (the sentinel makes it run)."""
    output = arg(args, kwargs, 1, "model_runner_output", None)
    kv_out = getattr(output, "kv_connector_output", None)
    ids = _failed_in(getattr(kv_out, "kv_connector_worker_meta", None))
    waiting = _waiting_status()
    ids = {i for i in ids if getattr(instance.requests.get(i), "status", None) == waiting}
    if not ids or not allowed(NAME, instance):
        return wrapped(*args, **kwargs)
    attached.entry(instance, NAME, SchedulerFailures).req_ids = ids
    before = kv_out.invalid_block_ids
    kv_out.invalid_block_ids = set(before or ()) | {SENTINEL}
    try:
        return wrapped(*args, **kwargs)
    finally:
        kv_out.invalid_block_ids = before
        attached.entry(instance, NAME, SchedulerFailures).req_ids = set()


def fail_waiting(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Scheduler (``_handle_invalid_blocks``): the release's own handling of the real invalid
    blocks, then the failed HMA receives as it treats a failed one-group receive."""
    invalid = arg(args, kwargs, 0, "invalid_block_ids", None)
    mine = attached.peek(instance, NAME)
    ids = set(mine.req_ids) if mine is not None else set()
    if not isinstance(invalid, set) or SENTINEL not in invalid:
        return wrapped(*args, **kwargs)
    real = invalid - {SENTINEL}
    rest = list(args[1:]) if args else []
    result = set(wrapped(real, *rest, **{k: v for k, v in kwargs.items()
                                         if k != "invalid_block_ids"})) if real else set()
    if not ids:
        return result
    if getattr(instance, "recompute_kv_load_failures", True):
        for req_id in ids:
            instance.requests[req_id].num_computed_tokens = 0
        instance.failed_recving_kv_req_ids |= ids
        logger.warning("pdpatch: %d request(s) of a hybrid (HMA) model failed to receive their "
                       "KV and are computed again (kv_load_failure_policy=recompute): %s "
                       "[hma_failed_recv]", len(ids), sorted(ids))
        return result
    logger.error("pdpatch: failing %d request(s) of a hybrid (HMA) model whose KV receive "
                 "failed (kv_load_failure_policy=fail): %s [hma_failed_recv]", len(ids),
                 sorted(ids))
    return result | ids


def _waiting_status() -> Any:
    from vllm.v1.request import RequestStatus

    return RequestStatus.WAITING_FOR_REMOTE_KVS


def _v() -> Version:
    return vllm_sites.running_release()
