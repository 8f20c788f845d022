"""D's worker: notice that the agent it holds for a prefill engine is no longer the one serving,
stop reading from it, forget it, and let the next request handshake anew -- never reading a
request's blocks from another incarnation than the one that prefilled it.

Signals, cheapest first (each release's code gives no other: its TTL is re-stamped by every
read, even failing ones; its 0.32+ ``check_remote_metadata`` probe stays True after a
disconnect; its 0.31+ address tracking fires only for another engine id):

* the request's incarnation tokens (P with pdpatch, :mod:`.book`): compared with the tokens of
  the agents D holds before any READ -- a newer incarnation is handshaken before the request
  reads, an older one's request is failed unread (stale params);
* a disconnect NIXL reports on a READ or a notification (:mod:`.watch`): D forgets the engine;
  requests that reached D before it noticed and carry no tokens are failed unread (their
  params may name the dead incarnation's blocks), later ones are read from the new one;
* 0.19-0.30: another engine id handshaken at a held engine's address: the old one is forgotten
  once idle (0.31+ do this themselves).

Forgetting waits until no READ of the engine is in flight and no handshake with it pending
(requests for it meanwhile wait, then go through the release's own handshake); READs from a
disconnected agent are released and failed at once.  A request whose READ, or whose wait for a
handshake, outlasts ``PDPATCH_PEER_DEADLINE_S`` is failed with its READs released: a stalled
or partitioned P bounds D's requests instead of holding them for as long as it stalls.
"""

from __future__ import annotations

import time
from typing import Any

from packaging.version import Version

from pdpatch import agent_layers, attached, config, metrics, vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.hma_failed_recv import wrappers as hma_failed_recv
from pdpatch.patches.peer_restart import NAME
from pdpatch.patches.peer_restart import forget as F
from pdpatch.patches.peer_restart.book import Incarnation, PeerBook, Pending
from pdpatch.patches.peer_restart.watch import PeerWatch
from pdpatch.versions import release_of


def book_of(worker: Any, version: Version) -> PeerBook | None:
    """The worker's book, if this patch acts on it: a pull-mode worker whose release can fail
    one request's KV load alone (an HMA model's before 0.30 only through ``hma_failed_recv``'s
    channel: vllm#52234), allowed by the deployment's toggle."""
    from pdpatch.installer import object_state

    found = attached.peek(worker, NAME)
    if found is not None and found.active is not None:
        return found if found.active else None
    try:
        active = allowed(NAME, worker) and not vllm_sites.pushes(worker, version) and \
            hasattr(worker, "_recving_metadata") and hasattr(worker, "_remote_agents") and \
            (vllm_sites.failure_recordable(worker, version)
             or hma_failed_recv.serves(worker))
    except Exception:
        active = False
    try:
        book = object_state(NAME, worker)
    except (AttributeError, TypeError):     # an object that cannot carry pdpatch's record
        return None
    book.active = active
    if active and agent_layers.find(worker, PeerWatch) is None:
        agent_layers.push(worker, PeerWatch, book)
    return book if active else None


def deadline_s() -> float:
    return float(config.PEER_DEADLINE_S.read())


def _held_tokens(worker: Any, book: PeerBook, engine: str) -> dict[str, str | None]:
    with book.lock:
        return {vllm_sites.remote_rank_key(k): book.token_of.get(name)
                for k, name in F.held(worker, engine).items()}


def _engine_of(meta: Any) -> str | None:
    remote = getattr(meta, "remote", None)
    engine = getattr(remote, "engine_id", None)
    return engine if isinstance(engine, str) else None


def _reqs_of(worker: Any, engine: str, *, reading: bool) -> list[str]:
    metas = getattr(worker, "_recving_metadata", {})
    transfers = getattr(worker, "_recving_transfers", {})
    return [r for r, m in list(metas.items())
            if _engine_of(m) == engine and bool(transfers.get(r)) == reading]


def supersede(worker: Any, book: PeerBook, engine: str, why: str, version: Version) -> None:
    """Stop reading from the incarnation of ``engine`` D holds; forget it once idle.  ``why``:
    ``disconnected`` (its READs are released and failed now, and requests that reached D
    before now without tokens will not read), ``new_incarnation``, ``replaced``."""
    pending = book.pending.get(engine)
    if pending is None:
        book.retire(engine, [t for t in _held_tokens(worker, book, engine).values() if t])
        pending = book.pending[engine] = Pending(why, book.now())
        metrics.count(worker, metrics.PEER_EVENTS, why)
    elif why != "disconnected" or pending.reads_failed:
        return
    failed = []
    if why == "disconnected":
        pending.reads_failed = True
        # A request without tokens (P without pdpatch) cannot show which incarnation prefilled
        # it.  One prefilled before the restart reaches D, if stock vLLM is to serve it at all,
        # within P's lease of its blocks, which began before now: until then only requests
        # that name their incarnation are read.
        book.fence[engine] = time.time() + vllm_sites.lease_seconds(worker, version)
        for req in _reqs_of(worker, engine, reading=True):
            F.fail(worker, req, version)
            book.doomed.add(req)
            failed.append(req)
    logger.warning(
        "pdpatch: prefill engine %s: %s; this decode worker stops reading from the agent it "
        "holds, forgets it once no READ is in flight, and handshakes anew for the next "
        "request%s [peer_restart]", engine,
        {"disconnected": "NIXL reports its agent disconnected (the engine restarted or died)",
         "new_incarnation": "a request names another incarnation of it than the one held "
                            "(it restarted under the same engine id)",
         "replaced": "another engine id answers at its side-channel address"}[why],
        f"; failed {len(failed)} request(s) reading from it" if failed else "")


def _census(worker: Any) -> str:
    agents = getattr(worker, "_remote_agents", {})
    return f"{sum(1 for a in agents.values() if a)} engine(s), " \
           f"{sum(len(a) for a in agents.values())} agent(s)"


def settle(worker: Any, book: PeerBook, version: Version) -> None:
    """Forget every superseded engine that is idle, then send its waiting requests on."""
    for engine, pending in list(book.pending.items()):
        if F.busy(worker, engine):
            continue
        names = set(F.held(worker, engine).values())
        if names:
            F.forget(worker, engine, version, gone_for_good=pending.why == "replaced")
            book.forgotten += 1
            metrics.count(worker, metrics.PEER_EVENTS, "forgotten")
            logger.info("pdpatch: forgot prefill engine %s (%s); this decode worker holds %s "
                        "[peer_restart]", engine, pending.why, _census(worker))
        with book.lock:
            for name in names | book.loaded.pop(engine, set()):
                book.token_of.pop(name, None)
                book.dead.discard(name)
        del book.pending[engine]
        if pending.why == "replaced":
            book.retired.pop(engine, None)
            book.tried.pop(engine, None)
            book.fence.pop(engine, None)
        for req, meta in pending.deferred:
            if req in getattr(worker, "_recving_metadata", {}) and req not in book.doomed:
                worker._read_blocks_for_req(req, meta)


def sweep_orphans(worker: Any, book: PeerBook, version: Version) -> None:
    """An engine whose handshake failed after NIXL loaded its agent (the release's validation
    refused it, a rank did not answer) is neither held nor pending, yet the release keeps that
    agent and the tables it filled before refusing (the topology's entry among them, which a
    later handshake under the same id would reuse: first-wins).  Drop them."""
    futures = getattr(worker, "_handshake_futures", {})
    with book.lock:
        engines = [e for e in book.loaded if e not in book.pending]
    for engine in engines:
        with worker._handshake_lock:        # the handshake's callback holds it to record one
            if F.held(worker, engine) or engine in futures:
                continue
        with book.lock:
            names = book.loaded.pop(engine, set())
            for name in names:
                book.token_of.pop(name, None)
                book.dead.discard(name)
        F.forget_orphan(worker, engine, names, version)


def _dead_engines(worker: Any, book: PeerBook) -> list[str]:
    with book.lock:
        dead = set(book.dead)
    if not dead:
        return []
    return [e for e, agents in list(getattr(worker, "_remote_agents", {}).items())
            if agents and dead & set(agents.values())]


def _refuse(worker: Any, book: PeerBook, req: str, meta: Any, why: str,
            version: Version) -> None:
    book.doomed.add(req)
    metrics.count(worker, metrics.PEER_EVENTS, "stale_params")
    logger.warning("pdpatch: request %s: its kv_transfer_params %s of prefill engine %s; "
                   "failing it unread (its blocks are not in the incarnation this decode "
                   "worker reads from) [peer_restart]", req, why, _engine_of(meta))
    F.fail(worker, req, version)


def _dispatch(worker: Any, wrapped: Any, args: tuple, kwargs: dict, req: str, meta: Any,
              engine: str, version: Version) -> Any:
    """Hand the request to the release: its READ where it can read the engine (its agent held,
    or its READ lists prepared: ``add_remote_agent`` called directly, as vLLM's own tests do);
    before 0.32, whose read path assumes both, its handshake path otherwise (as its
    ``start_load_kv`` does: a request deferred while pdpatch forgot the engine)."""
    if F.held(worker, engine) or F.prepared(worker, engine) \
            or release_of(version) >= vllm_sites.HANDSHAKE_IN_READ_FROM:
        result = wrapped(*args, **kwargs)
        book = attached.peek(worker, NAME)
        if book is not None and getattr(worker, "_recving_transfers", {}).get(req):
            book.posted.setdefault(req, book.now())
        return result
    with worker._handshake_lock:
        if engine not in getattr(worker, "_remote_agents", {}):
            worker._background_nixl_handshake(req, engine, meta)
            return None
    return _dispatch(worker, wrapped, args, kwargs, req, meta, engine, version)


def make_read_guard(version: Version) -> Any:
    def guard_read(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        meta = arg(args, kwargs, 1, "meta", None)
        engine = _engine_of(meta)
        book = None if engine is None else book_of(instance, version)
        if book is None or vllm_sites.is_notify_only(meta):
            return wrapped(*args, **kwargs)
        req = arg(args, kwargs, 0, "req_id")
        book.first_seen.setdefault(req, book.now())
        if req in book.doomed:
            if req in getattr(instance, "_recving_metadata", {}):
                F.fail(instance, req, version)
            return None
        inc = attached.peek(meta, NAME)
        tokens = inc.tokens if isinstance(inc, Incarnation) else None
        arrival = inc.arrival if isinstance(inc, Incarnation) else None
        if logger.isEnabledFor(10):
            logger.debug("pdpatch: request %s of engine %s: tokens %s, held %s, pending %s, "
                         "dead %s [peer_restart]", req, engine, tokens,
                         _held_tokens(instance, book, engine), engine in book.pending,
                         list(book.dead))
        if tokens is None and arrival is not None and arrival < book.fence.get(engine, -1.0):
            _refuse(instance, book, req, meta, "name no incarnation and reached this engine "
                    "within P's lease (kv_lease_duration) of the restart D noticed, so they may "
                    "be the dead incarnation's (pdpatch on P names it)", version)
            return None
        pending = book.pending.get(engine)
        if tokens is not None:
            if book.is_retired(engine, tokens.values()):
                _refuse(instance, book, req, meta, "name a retired incarnation", version)
                return None
            held = _held_tokens(instance, book, engine)
            if pending is None and held:
                want = {k: tokens[k] for k in held if k in tokens and held[k] is not None}
                stale = [t for k, t in want.items() if t != held[k]]
                if stale:
                    if book.was_tried(engine, stale):
                        book.retire(engine, stale)
                        _refuse(instance, book, req, meta, "name another incarnation than "
                                "the one it answered with when handshaken again", version)
                        return None
                    book.try_tokens(engine, stale)
                    supersede(instance, book, engine, "new_incarnation", version)
                    pending = book.pending.get(engine)
        if pending is not None:
            pending.deferred.append((req, meta))
            settle(instance, book, version)
            return None
        if release_of(version) < vllm_sites.ADDRESS_REPLACEMENT_FROM and F.held(instance,
                                                                               engine):
            _note_address(instance, book, meta, engine, version)
        return _dispatch(instance, wrapped, args, kwargs, req, meta, engine, version)

    return guard_read


def _note_address(worker: Any, book: PeerBook, meta: Any, engine: str,
                  version: Version) -> None:
    """0.19-0.30: the engine held at this request's side-channel address is this one; one
    held there before under another id was replaced (as 0.31+ track it)."""
    try:
        address = (str(meta.remote.host), int(meta.remote.port))
    except (AttributeError, TypeError, ValueError):
        return
    before = book.address.get(address)
    book.address[address] = engine
    if before is not None and before != engine and F.held(worker, before):
        supersede(worker, book, before, "replaced", version)


def _sweep_deadline(worker: Any, book: PeerBook, version: Version) -> None:
    limit = deadline_s()
    if limit <= 0:
        return
    now = book.now()
    metas = getattr(worker, "_recving_metadata", {})
    transfers = getattr(worker, "_recving_transfers", {})
    futures = getattr(worker, "_handshake_futures", {})
    deferred = {r for p in book.pending.values() for r, _ in p.deferred}
    for req, meta in list(metas.items()):
        if req in book.doomed:
            continue
        engine = _engine_of(meta)
        if transfers.get(req):
            since, what = book.posted.get(req), "its READ"
        elif engine in futures or req in deferred:
            since, what = book.first_seen.get(req), "its wait for the prefill engine"
        else:
            continue
        if since is None or now - since <= limit:
            continue
        book.doomed.add(req)
        metrics.count(worker, metrics.PEER_EVENTS, "deadline")
        logger.warning("pdpatch: request %s: %s (engine %s) has lasted %.0f s, more than "
                       "PDPATCH_PEER_DEADLINE_S=%.0f; failing it, its READs released "
                       "[peer_restart]", req, what, engine, now - since, limit)
        F.fail(worker, req, version)
    for pending in book.pending.values():
        pending.deferred = [(r, m) for r, m in pending.deferred if r not in book.doomed]


def _trim(worker: Any, book: PeerBook) -> None:
    """Forget the clocks of requests the worker no longer holds; a failed request stays
    marked while a handshake it waited for may still hand it to the read path."""
    metas = getattr(worker, "_recving_metadata", {})
    for table in (book.first_seen, book.posted):
        for req in [r for r in table if r not in metas]:
            del table[req]
    ready = getattr(worker, "_ready_requests", None)
    if book.doomed and not getattr(worker, "_handshake_futures", {}) and \
            (ready is None or ready.empty()):
        book.doomed = {r for r in book.doomed if r in metas}


def make_step_hook(version: Version) -> Any:
    """After the release's per-step result collection (``get_finished`` up to 0.29,
    ``get_transfer_results`` from 0.30; the model-runner thread, as ``start_load_kv``)."""

    def after_step(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        book = attached.peek(instance, NAME)
        if book is None or not book.active:
            return result
        try:
            for engine in _dead_engines(instance, book):
                supersede(instance, book, engine, "disconnected", version)
            _sweep_deadline(instance, book, version)
            settle(instance, book, version)
            sweep_orphans(instance, book, version)
            _trim(instance, book)
        except Exception as exc:        # never fail the step over pdpatch's bookkeeping
            logger.warning("pdpatch: peer bookkeeping failed (%s: %s) [peer_restart]",
                           type(exc).__name__, exc, exc_info=logger.isEnabledFor(10))
        return result

    return after_step


def make_load_hook(version: Version) -> Any:
    """Before ``start_load_kv``: the book and the agent layer exist before the step's first
    handshake, and engines whose agent died are superseded before this step reads."""

    def before_load(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        book = book_of(instance, version)
        if book is not None:
            try:
                metadata = arg(args, kwargs, 0, "metadata", None)
                now = book.now()
                for req in getattr(metadata, "reqs_to_recv", None) or ():
                    book.first_seen.setdefault(req, now)
                for engine in _dead_engines(instance, book):
                    supersede(instance, book, engine, "disconnected", version)
                settle(instance, book, version)
            except Exception as exc:
                logger.warning("pdpatch: peer bookkeeping failed (%s: %s) [peer_restart]",
                               type(exc).__name__, exc, exc_info=logger.isEnabledFor(10))
        return wrapped(*args, **kwargs)

    return before_load


def note_agent(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """D's handshake thread: the token of every agent it loads (the digest of the very bytes
    NIXL loads), and the agents loaded per engine."""
    book = attached.peek(instance, NAME)
    meta = arg(args, kwargs, 0, "nixl_agent_meta", None)
    engine = getattr(meta, "engine_id", None)
    if book is None or not book.active or not isinstance(engine, str):
        return wrapped(*args, **kwargs)
    book.adding.engine = engine
    try:
        name = wrapped(*args, **kwargs)
    finally:
        book.adding.engine = None
    raw = getattr(meta, "agent_metadata", None)
    if isinstance(raw, (bytes, bytearray)) and isinstance(name, (str, bytes)):
        from pdpatch.patches.peer_restart.book import token

        with book.lock:
            book.token_of.setdefault(name, token(raw))
            book.loaded.setdefault(engine, set()).add(name)
    return name
