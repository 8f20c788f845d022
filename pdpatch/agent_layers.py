"""The proxies pdpatch puts in front of a NIXL worker's agent (``worker.nixl_wrapper``): how they
stack, in one place.

vLLM's NIXL worker reaches its agent only through ``worker.nixl_wrapper``, so a feature that
must see some of those calls stands a proxy there: a :class:`Layer`
(:class:`pdpatch.agent_proxy.AgentProxy`), which handles the calls it defines and passes
everything else to the agent below it.  Four do, always stacked in this
order, outermost first, whichever went on first (:data:`ORDER`):

* ``notif_fix`` -- ``mla_notif``: rewrites one notification, for one ``_read_blocks_for_req``
  call (0.19/0.20, MLA workers);
* ``substitution`` -- ``kv_segments``: replaces a converted peer's remote descriptor list, for
  one ``add_remote_agent`` call (0.19/0.20);
* ``peer_watch`` -- ``peer_restart``: maps prepared remote lists and transfers to their remote
  agent and notes the agents NIXL reports disconnected, from a decode worker's first
  ``start_load_kv`` for its life (above ``staging``, whose own calls go to the agent it was
  given: a staged READ's failure reaches vLLM, and this layer, as a failed READ);
* ``staging`` -- ``kv_segments``: stages a converted peer's READs, from ``register_kv_caches``
  for the worker's life (:class:`pdpatch.kv.staging.StagingAgent`).

Why this order: the staging agent must see every list the worker prepares, the substituted
remote list included, so it sits right above the real agent; the per-call views go above it.
Layers are put on and taken off only here (:func:`push`, :func:`remove`, :func:`layered`), so
taking one off leaves the others in place however their calls interleave across threads, and
taking the last one off leaves the real agent itself in ``worker.nixl_wrapper``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from pdpatch.agent_proxy import AgentProxy as Layer

ORDER = ("notif_fix", "substitution", "peer_watch", "staging")
"""Layer kinds, outermost first."""

L = TypeVar("L", bound="Layer")

_lock = threading.Lock()

__all__ = ["ORDER", "Layer", "find", "layered", "push", "remove", "stack"]


def _rank(kind: str) -> int:
    if kind not in ORDER:
        raise ValueError(f"unknown agent layer kind {kind!r}; known: {', '.join(ORDER)}")
    return ORDER.index(kind)


def stack(worker: Any) -> list[Layer]:
    """The layers in front of the worker's agent, outermost first (none for a worker without
    an agent)."""
    out = []
    agent = getattr(worker, "nixl_wrapper", None)
    while isinstance(agent, Layer):
        out.append(agent)
        agent = agent._agent
    return out


def find(worker: Any, cls: type[L]) -> L | None:
    """The worker's layer of type ``cls``, if one is in place."""
    return next((layer for layer in stack(worker) if isinstance(layer, cls)), None)


def push(worker: Any, cls: type[L], *args: Any, **kwargs: Any) -> L:
    """Put ``cls(<the agent below its place>, *args, **kwargs)`` at its place in the worker's
    stack and return it."""
    rank = _rank(cls.kind)
    with _lock:
        above: Layer | None = None
        below = worker.nixl_wrapper
        while isinstance(below, Layer) and _rank(below.kind) < rank:
            above, below = below, below._agent
        layer = cls(below, *args, **kwargs)
        if above is None:
            worker.nixl_wrapper = layer
        else:
            above._agent = layer
        return layer


def remove(worker: Any, layer: Layer) -> bool:
    """Take ``layer`` out of the worker's stack, wherever it is; False if it is not there."""
    with _lock:
        above: Layer | None = None
        current = worker.nixl_wrapper
        while isinstance(current, Layer) and current is not layer:
            above, current = current, current._agent
        if current is not layer:
            return False
        if above is None:
            worker.nixl_wrapper = layer._agent
        else:
            above._agent = layer._agent
        return True


@contextmanager
def layered(worker: Any, cls: type[L], *args: Any, **kwargs: Any) -> Iterator[L]:
    """:func:`push` for the duration of a ``with`` block, then :func:`remove`."""
    layer = push(worker, cls, *args, **kwargs)
    try:
        yield layer
    finally:
        remove(worker, layer)
