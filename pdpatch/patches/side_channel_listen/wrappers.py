"""The code of patch ``side_channel_listen``, loaded when vLLM imports the NIXL worker (the patch
and why it exists: :mod:`pdpatch.patches.side_channel_listen`)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from pdpatch.patches.common import allowed, arg
from pdpatch.patches.side_channel_listen import NAME

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
