"""Patch ``params_guard``: a decode request whose ``kv_transfer_params`` the release's NIXL
connector cannot use is not loaded from (or released on) a prefill engine, instead of killing
EngineCore on its way out.

Found on vLLM 0.33 (issue 25, case 1): a non-streaming ``/v1/completions`` to D whose
``kv_transfer_params`` lack ``remote_engine_id`` is answered 400 (``params_check``), and D's
EngineCore then dies with ``KeyError: 'remote_engine_id'``.  From 0.21 the API server hands
every request it rejects after reading ``do_remote_prefill`` to the engine core anyway
(``_with_kv_transfer_rejection_cleanup`` -> ``notify_kv_transfer_request_rejected``: an
``abort_immediately`` request carrying the params), so that the connector can tell P to free
the blocks it holds for it.  The scheduler half's ``request_finished`` sees ``do_remote_prefill``
still set (``update_state_after_alloc`` never ran) and queues a notification-only receive;
``build_connector_meta`` then passes the params to ``add_new_req_to_recv``, which indexes
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host`` and
``remote_port`` (every release 0.19-0.34; 0.34.0 ``pull_scheduler.py`` L222-233 queues it,
``base_scheduler.py`` L485-505 builds it, ``metadata.py`` L341-345 indexes): one missing, and
the scheduler step raises.  A request aborted while it waits (a client disconnect) takes the
same path on every release.  An unhashable ``remote_engine_id`` or ``remote_request_id`` (a
list) raises ``TypeError`` one step earlier, in ``on_new_request``'s heartbeat tables (0.22+;
0.34.0 ``base_scheduler.py`` L228, L237), or in the decode worker's engine lookup.

The release's own rule for such params is in ``update_state_after_alloc``: without the remote
fields it "will not utilize KVTransfer" (and turns ``do_remote_prefill`` off).  This patch
applies it where the release forgot to, each check where the release would raise: before the
facade's ``request_finished[_all_groups]`` (the receive is queued there), params that lack a key
the receive path indexes (minus what that scheduler seeds itself: ``remote_block_ids`` in the
push scheduler from 0.26) or carry an unhashable engine or request id; before its
``on_new_request`` (0.22+, every request), only the unhashable ids -- a missing key does not
raise there, and a push request (0.24-0.25) legitimately lacks ``remote_block_ids`` until its
allocation.  Such params get ``do_remote_prefill = False``, with a warning.  Params the release
can use -- an empty ``remote_block_ids`` included, whose notification still frees P's blocks --
are left to it.  Nothing can tell P to free blocks for a request whose peer is not named
usably: they stay pinned there until P's own timeout, and the warning says so.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from packaging.version import Version

from pdpatch import metrics, vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg, targets_at
from pdpatch.registry import Patch, Target, Wrapper

NAME = "params_guard"


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


def _targets(version: Version) -> list[Target]:
    finished = make_guard(version, receive=True)
    return targets_at(version, (vllm_sites.ON_NEW_REQUEST, make_guard(version, receive=False)),
                      (vllm_sites.REQUEST_FINISHED, finished),
                      (vllm_sites.REQUEST_FINISHED_ALL_GROUPS, finished))


PATCH = Patch(
    name=NAME,
    summary="kv_transfer_params the NIXL receive path cannot use are dropped, not crashed on",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.SCHEDULER_REQUEST_FINISHED, vllm_sites.SCHEDULER_BUILD_META,
               vllm_sites.ADD_RECV_METADATA),
)
