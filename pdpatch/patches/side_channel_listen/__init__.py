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

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from

NAME = "side_channel_listen"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.HANDSHAKE_LISTENER_OWNER, version)
    if site is None:
        return []
    return [Target(site.module, f"{site.qualname}._nixl_handshake_listener",
                   _code("guard_listener")),
            Target(site.module, f"{site.qualname}.set_xfer_handshake_metadata",
                   _code("check_listener_started"))]


PATCH = Patch(
    name=NAME,
    summary="a NIXL side channel that cannot listen fails the engine's start instead of "
            "hanging it",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
)
