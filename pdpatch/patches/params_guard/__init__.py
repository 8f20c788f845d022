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

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "params_guard"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    finished = _code("make_guard", version, True)
    return targets_at(version, (vllm_sites.ON_NEW_REQUEST, _code("make_guard", version, False)),
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
