"""The code of patch ``lease_guard``, loaded when vLLM imports the connector's scheduler half or
its worker (the patch and why it exists: :mod:`pdpatch.patches.lease_guard`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from packaging.version import Version

from pdpatch import attached, metrics, vllm_sites
from pdpatch.installer import object_state
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.lease_guard import NAME

PARAMS_KEY = "pdpatch_kv_lease_expiry"
"""The entry P adds to ``kv_transfer_params`` (D's ``add_new_req_to_recv`` ignores extras)."""


@dataclass
class Lease:
    """What ``lease_guard`` keeps on a vLLM object: on a receive's ``ReqMeta``, P's expiry for
    it (``expiry``, in P's clock; it travels with the metadata to the workers); on a decode
    worker, when it first sent a heartbeat for each P request it still sends them for
    (``first_sent``: P's request id -> the worker's ``perf_counter``)."""

    expiry: float | None = None
    first_sent: dict[str, float] = field(default_factory=dict)

    def sent(self, by_engine: Any, met: Any, now: float) -> None:
        """One heartbeat round: requests no longer in it are done (read, or aborted)."""
        self.first_sent = {rid: self.first_sent.get(rid, now)
                           for engine, info in by_engine.items() if engine in met
                           for rid in getattr(info, "req_ids", ())}


def lease_expiry(sched: Any, request_id: str) -> float | None:
    """The expiry P's scheduler half set for a request it holds for D, if any."""
    expiry = getattr(sched, "_reqs_need_send", {}).get(request_id)
    return float(expiry) if isinstance(expiry, (int, float)) and not isinstance(expiry, bool) \
        else None


def add_lease(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """P: the params for D carry the lease's expiry."""
    result = wrapped(*args, **kwargs)
    try:
        params = result[1]
        sched = getattr(instance, "connector_scheduler", None)
        if not isinstance(params, dict) or not params.get("do_remote_prefill") or \
                sched is None or not allowed(NAME, sched):
            return result
        request = arg(args, kwargs, 0, "request")
        expiry = lease_expiry(sched, request.request_id)
        if expiry is not None:
            params[PARAMS_KEY] = expiry
    except Exception as exc:        # never fail a finished request over its lease's expiry
        logger.warning("pdpatch: could not add the KV lease's expiry to a finished request "
                       "(%s: %s); D cannot check it [lease_guard]", type(exc).__name__, exc)
    return result


def expiry_in(params: Any) -> float | None:
    """P's expiry in a request's params, if it is a finite number (a client's JSON may hold
    any value there, an integer too large for a float included)."""
    value = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        expiry = float(value)
    except OverflowError:
        return None
    return expiry if math.isfinite(expiry) else None


def carry_lease(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """D's scheduler half: the receive's ``ReqMeta`` carries P's expiry to the workers."""
    result = wrapped(*args, **kwargs)
    expiry = expiry_in(arg(args, kwargs, 2, "kv_transfer_params", None))
    if expiry is not None:
        meta = getattr(instance, "reqs_to_recv", {}).get(arg(args, kwargs, 0, "request_id"))
        if meta is not None:
            attached.put(meta, NAME, Lease(expiry=expiry))
    return result


def note_heartbeats(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """D's worker: when it first heartbeats each P request (only rounds that send any)."""
    by_engine = getattr(arg(args, kwargs, 0, "metadata", None), "heartbeat_by_engine", None)
    if by_engine and allowed(NAME, instance):
        object_state(NAME, instance).sent(
            by_engine, getattr(instance, "_remote_agents", {}), time.perf_counter())
    return wrapped(*args, **kwargs)


def lease_left(worker: Any, meta: Any, expiry: float) -> float | None:
    """Seconds P's lease has left (negative: ran out) when the release would decline a
    readback -- within its safety margin -- and no heartbeat reached P that margin before the
    lease ran out; None where the lease is known to hold or cannot be told."""
    remote = meta.remote
    offset = getattr(worker, "_engine_clock_offset", {}).get(remote.engine_id)
    if offset is None or not meta.local_physical_block_ids:
        return None
    ends = expiry - offset
    deadline = ends - vllm_sites.expiry_margin()
    now = time.perf_counter()
    if now < deadline:
        return None
    mine = attached.peek(worker, NAME)
    first = None if mine is None else mine.first_sent.get(remote.request_id)
    if first is not None and first < deadline:
        return None
    return ends - now


def make_read_guard(version: Version) -> Any:
    def guard_read(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        meta = arg(args, kwargs, 1, "meta", None)
        lease = None if meta is None else attached.peek(meta, NAME)
        expiry = None if lease is None else lease.expiry
        if expiry is None or getattr(meta, "remote", None) is None or \
                not allowed(NAME, instance):
            return wrapped(*args, **kwargs)
        left = lease_left(instance, meta, expiry)
        if left is None:
            return wrapped(*args, **kwargs)
        req_id = arg(args, kwargs, 0, "req_id")
        metrics.count(instance, metrics.REFUSALS, NAME)
        when = f"ran out {-left:.1f} s ago" if left < 0 else \
            f"runs out in {left:.1f} s, inside vLLM's {vllm_sites.expiry_margin():.0f} s margin"
        logger.warning(
            "pdpatch: request %s: prefill engine %s's lease on its KV blocks "
            "(kv_lease_duration) %s, and no heartbeat from this engine reached it in time: "
            "they may hold another request's KV. Declining the READ as vLLM declines an "
            "expired readback; kv_load_failure_policy fails or recomputes the request "
            "[lease_guard]", req_id, meta.remote.engine_id, when)
        vllm_sites.decline_expired_read(instance, req_id, version)
        return None

    return guard_read
