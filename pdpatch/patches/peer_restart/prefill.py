"""The scheduler halves: P puts its incarnation's tokens in the ``kv_transfer_params`` of each
request it prefills for D; D's scheduler half carries a request's tokens and arrival time to
its workers on the receive's ``ReqMeta``."""

from __future__ import annotations

from typing import Any

from pdpatch import attached
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.peer_restart import NAME
from pdpatch.patches.peer_restart.book import (
    PARAMS_KEY,
    Incarnation,
    PTokens,
    token,
    tokens_in,
)
from pdpatch.vllm_sites import remote_rank_key


def note_own_tokens(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """P's scheduler half: the token of each rank whose handshake payload it will serve (the
    digest of ``NixlAgentMetadata.agent_metadata``, the bytes D loads).  Never fails the call:
    without tokens P's requests carry none, as without pdpatch."""
    try:
        import msgspec

        metadata = arg(args, kwargs, 0, "metadata", None)
        if isinstance(metadata, dict) and allowed(NAME, instance):
            tokens = {}
            for key, payload in metadata.items():
                raw = msgspec.msgpack.decode(payload.agent_metadata_bytes)
                tokens[remote_rank_key(key)] = token(raw["agent_metadata"])
            attached.entry(instance, NAME, PTokens).tokens.update(tokens)
    except Exception as exc:
        logger.warning("pdpatch: could not read this prefill engine's incarnation from its "
                       "handshake metadata (%s: %s); its requests carry none [peer_restart]",
                       type(exc).__name__, exc)
    return wrapped(*args, **kwargs)


def add_tokens(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """P (the connector facade's ``request_finished[_all_groups]``): the params for D name the
    incarnation whose blocks hold the request's KV."""
    result = wrapped(*args, **kwargs)
    try:
        params = result[1]
        sched = getattr(instance, "connector_scheduler", None)
        mine = None if sched is None else attached.peek(sched, NAME)
        if isinstance(params, dict) and params.get("do_remote_prefill") and \
                isinstance(mine, PTokens) and mine.tokens:
            params[PARAMS_KEY] = dict(mine.tokens)
    except Exception as exc:        # never fail a finished request over its tokens
        logger.warning("pdpatch: could not add this prefill engine's incarnation to a finished "
                       "request (%s: %s); D cannot check it [peer_restart]",
                       type(exc).__name__, exc)
    return result


def carry_incarnation(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """D's scheduler half (``build_connector_meta``, which turns ``_reqs_need_recv`` -- request
    id -> ``(Request, ...)`` in every release -- into the workers' receives): each receive's
    ``ReqMeta`` carries its params' tokens and the request's arrival time."""
    need = getattr(instance, "_reqs_need_recv", None)
    seen: dict[str, Incarnation] = {}
    if need and allowed(NAME, instance):
        for req_id, entry in list(need.items()):
            request = entry[0] if isinstance(entry, tuple) and entry else None
            arrival = getattr(request, "arrival_time", None)
            seen[req_id] = Incarnation(
                tokens_in(getattr(request, "kv_transfer_params", None)),
                float(arrival) if isinstance(arrival, (int, float)) else None)
    result = wrapped(*args, **kwargs)
    if seen:
        recv = getattr(result, "reqs_to_recv", None) or {}
        for req_id, inc in seen.items():
            meta = recv.get(req_id)
            if meta is not None:
                attached.put(meta, NAME, inc)
    return result
