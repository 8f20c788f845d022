"""Patch ``side_channel_listen``: a NIXL side channel that cannot listen fails the engine's
start with the reason, instead of hanging it forever.

The scheduler half starts the ``nixl_handshake_listener`` thread and waits, with no timeout, for
the thread to say its ZMQ socket is bound.  When the bind fails -- another process holds
``VLLM_NIXL_SIDE_CHANNEL_PORT``, two engines on a host were given the same port, the host name
does not resolve -- the thread dies with the exception before saying so, and the engine core
waits forever: the API server never becomes healthy and nothing but a thread traceback in the
log says why (every release 0.19-0.34: 0.34.0 ``base_scheduler.py`` L325-340 starts the thread
and waits on its event without a timeout, L343 is the listener; seen in this project's CI, and
reported upstream: vllm-project/vllm PR 23756, ai-dynamo/dynamo PR 14838).

Two wrappers, behaviour changed only on that path: the listener's, on an exception raised
before the socket was ready, records it for its thread and releases the waiting caller; the
caller's wrapper then raises :class:`SideChannelUnavailable` from it, so ``EngineCore`` fails to
start and the process exits with the reason.  A listener that was bound runs and fails exactly
as the release's does.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.patches.common import allowed, arg
from pdpatch.registry import Patch, Target

NAME = "side_channel_listen"

_waiting: weakref.WeakSet[Any] = weakref.WeakSet()
"""Scheduler halves inside a guarded ``set_xfer_handshake_metadata`` call."""

_failed_listeners: weakref.WeakKeyDictionary[threading.Thread, BaseException] = (
    weakref.WeakKeyDictionary())


class SideChannelUnavailable(RuntimeError):
    """The NIXL side channel's listener could not start; the engine cannot serve handshakes."""


def guard_listener(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    ready = arg(args, kwargs, 1, "ready_event", None)
    try:
        return wrapped(*args, **kwargs)
    except BaseException as exc:
        me = threading.current_thread()
        # Only a listener whose starter waits in a guarded call is released (the release
        # assigns the thread to `_nixl_handshake_listener_t` before starting it); a direct call
        # or a starter the deployment left unguarded gets the release's behaviour.
        if isinstance(ready, threading.Event) and not ready.is_set() and any(
                getattr(s, "_nixl_handshake_listener_t", None) is me for s in list(_waiting)):
            _failed_listeners[me] = exc
            ready.set()
        raise


def check_listener_started(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if not allowed(NAME, instance):
        return wrapped(*args, **kwargs)
    _waiting.add(instance)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _waiting.discard(instance)
    listener = getattr(instance, "_nixl_handshake_listener_t", None)
    exc = _failed_listeners.get(listener) if isinstance(listener, threading.Thread) else None
    if exc is not None:
        raise SideChannelUnavailable(
            f"pdpatch: the NIXL side channel could not listen on port "
            f"{getattr(instance, 'side_channel_port', '?')} "
            f"({type(exc).__name__}: {exc}), so no decode engine could handshake with this "
            f"one (stock vLLM would wait for it forever).  If another process holds the port, "
            f"give this engine a free VLLM_NIXL_SIDE_CHANNEL_PORT: every engine on a host "
            f"needs its own, and data-parallel rank r listens on that port + r "
            f"[{NAME}]") from exc
    return result


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.HANDSHAKE_LISTENER_OWNER, version)
    if site is None:
        return []
    return [Target(site.module, f"{site.qualname}._nixl_handshake_listener", guard_listener),
            Target(site.module, f"{site.qualname}.set_xfer_handshake_metadata",
                   check_listener_started)]


PATCH = Patch(
    name=NAME,
    summary="a NIXL side channel that cannot listen fails the engine's start instead of "
            "hanging it",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
)
