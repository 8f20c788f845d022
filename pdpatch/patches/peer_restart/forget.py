"""Forgetting a prefill engine on a decode worker, and failing the requests that were to read
from it: each release's own calls where it has them.

* 0.24+ have ``_cleanup_remote_engine(engine_id)`` (TTL eviction, shutdown, 0.31+ replaced
  peers): it releases the engine's prepared remote lists (``release_dlist_handle``), removes
  its agents (``remove_remote_agent``) and pops every per-engine table.  0.24-0.25 ``del``
  their tables: the entries a completed handshake makes are seeded first where missing.
* 0.19-0.23 have no such method: the same NIXL calls, then every per-engine table
  (:data:`pdpatch.vllm_sites.PER_ENGINE_TABLES`, the topology's entries).

Only an engine with no READ in flight and no handshake pending is forgotten (the caller's
rule); the next request for it handshakes anew through the release's own path.
"""

from __future__ import annotations

import time
from typing import Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.log import logger
from pdpatch.patches.hma_failed_recv import wrappers as hma_failed_recv
from pdpatch.versions import release_of


def held(worker: Any, engine: str) -> dict[Any, str]:
    """The agents the worker holds for ``engine`` (rank key -> name); ``_remote_agents`` is a
    ``defaultdict`` up to 0.25: never index it."""
    agents = getattr(worker, "_remote_agents", {}).get(engine)
    return dict(agents) if agents else {}


def prepared(worker: Any, engine: str) -> bool:
    """Whether the worker holds prepared READ lists for ``engine`` and no handshake with it is
    under way (``add_remote_agent`` makes them, rank by rank, during a handshake; forgetting
    the engine releases them)."""
    return bool(getattr(worker, "dst_xfer_side_handles", {}).get(engine)) \
        and engine not in getattr(worker, "_handshake_futures", {})


def busy(worker: Any, engine: str) -> bool:
    """Whether a READ of ``engine`` is in flight or a handshake with it pending."""
    if engine in getattr(worker, "_handshake_futures", {}):
        return True
    metas = getattr(worker, "_recving_metadata", {})
    for req_id, handles in list(getattr(worker, "_recving_transfers", {}).items()):
        meta = metas.get(req_id)
        if handles and meta is not None and getattr(meta.remote, "engine_id", None) == engine:
            return True
    return False


def _purge(worker: Any, engine: str, version: Version) -> None:
    """0.19-0.23 (and a fallback): the release's teardown, done by hand."""
    with worker._handshake_lock:
        agents = worker._remote_agents.pop(engine, None) or {}
    for handle in (worker.dst_xfer_side_handles.pop(engine, None) or {}).values():
        worker.nixl_wrapper.release_dlist_handle(handle)
    for name in agents.values():
        worker.nixl_wrapper.remove_remote_agent(name)
    for table in vllm_sites.PER_ENGINE_TABLES:
        found = getattr(worker, table, None)
        if isinstance(found, dict) and engine != getattr(worker, "engine_id", None):
            found.pop(engine, None)
    topo = vllm_sites.any_topology(worker)
    engines = getattr(topo, "_engines", None)
    if isinstance(engines, dict):
        for key in [k for k in engines
                    if k == engine or (isinstance(k, tuple) and k and k[0] == engine)]:
            del engines[key]


def forget(worker: Any, engine: str, version: Version, *, gone_for_good: bool = False) -> None:
    """Drop everything the worker holds for ``engine`` (its agents, prepared lists, tables).
    ``gone_for_good``: the engine id will not come back (another answers at its address), so
    0.33+'s registration generation of it goes too."""
    if release_of(version) >= vllm_sites.CLEANUP_REMOTE_ENGINE_FROM and \
            engine in getattr(worker, "_remote_agents", {}):
        # 0.24-0.25 `del` these: a completed handshake made them all; seed any that is not.
        for table, empty in (("dst_xfer_side_handles", dict), ("kv_caches_base_addr", dict),
                             ("dst_num_blocks", int), ("tp_mappings", lambda: None)):
            found = getattr(worker, table, None)
            if isinstance(found, dict) and engine not in found:
                found[engine] = empty()
        last = getattr(worker, "_engine_last_active", None)
        if isinstance(last, dict):
            last.setdefault(engine, time.perf_counter())
        try:
            worker._cleanup_remote_engine(engine, log_eviction=False)
        except Exception as exc:
            logger.warning("pdpatch: vLLM's teardown of remote engine %s failed (%s: %s); "
                           "dropping its state directly [peer_restart]", engine,
                           type(exc).__name__, exc)
            _purge(worker, engine, version)
    else:
        _purge(worker, engine, version)
    if gone_for_good:
        getattr(worker, "_remote_registration_generations", {}).pop(engine, None)


def release_reads(worker: Any, req_id: str) -> None:
    """Release a request's READs in flight (NIXL cancels them: measured on a stopped and on a
    dead peer); handles that do not release stay with the request, as 0.30+ keep them."""
    transfers = getattr(worker, "_recving_transfers", {})
    kept = []
    for handle in list(transfers.get(req_id) or ()):
        try:
            worker.nixl_wrapper.release_xfer_handle(handle)
        except Exception as exc:
            logger.warning("pdpatch: request %s: a READ handle did not release (%s: %s); kept "
                           "until it does [peer_restart]", req_id, type(exc).__name__, exc)
            kept.append(handle)
    if kept:
        transfers[req_id] = kept
    else:
        transfers.pop(req_id, None)


def fail(worker: Any, req_id: str, version: Version) -> None:
    """Fail a request of a peer D stopped reading from: its READs released first, then the
    release's own failure bookkeeping (the scheduler fails or recomputes it:
    ``kv_load_failure_policy``); an HMA model's before 0.30 through ``hma_failed_recv``'s
    channel, the only one those releases can take (``receive.book_of`` acts on such a worker
    only where it serves)."""
    if getattr(worker, "_recving_transfers", {}).get(req_id):
        release_reads(worker, req_id)
        if req_id in getattr(worker, "_recving_metadata", {}):
            hma_failed_recv.record_failure(worker, req_id, version)
        return
    if req_id in getattr(worker, "_recving_metadata", {}):
        getattr(worker, "_recving_transfers", {}).pop(req_id, None)
        hma_failed_recv.record_failure(worker, req_id, version, vllm_sites.fail_unread)


def forget_orphan(worker: Any, engine: str, names: set, version: Version) -> None:
    """Drop what a failed handshake with ``engine`` left: the agents NIXL loaded for it, its
    prepared lists and its entries in the per-engine tables (the engine is not held)."""
    for handle in (worker.dst_xfer_side_handles.pop(engine, None) or {}).values():
        worker.nixl_wrapper.release_dlist_handle(handle)
    for name in names:
        try:
            # the release may have removed it itself (0.31+: another id at its address)
            if worker.nixl_wrapper.check_remote_metadata(name):
                worker.nixl_wrapper.remove_remote_agent(name)
        except Exception as exc:
            logger.debug("pdpatch: orphan agent %r of engine %s: %s [peer_restart]", name,
                         engine, exc)
    _purge(worker, engine, version)
    # 0.33+ keep each engine's registration generation forever (pull_worker.py L47), also
    # after their own teardown: of an engine no longer held nor pending, it goes too (an engine
    # id that comes back starts from 0 again, and its handshake records it anew)
    getattr(worker, "_remote_registration_generations", {}).pop(engine, None)
