"""The code of patch ``mla_notif``, loaded when vLLM imports the decode worker's read path (the
patch and why it exists: :mod:`pdpatch.patches.mla_notif`)."""

from __future__ import annotations

from typing import Any

from pdpatch import agent_layers
from pdpatch.agent_layers import Layer
from pdpatch.log import logger
from pdpatch.patches.common import allowed
from pdpatch.patches.mla_notif import NAME


class _NotifIdFix(Layer):
    """Delegates everything to the worker's NIXL agent; rewrites one notification payload (the
    ``notif_fix`` layer of :mod:`pdpatch.agent_layers`)."""

    kind = "notif_fix"

    def __init__(self, agent: Any, wrong: bytes, right: bytes) -> None:
        super().__init__(agent)
        self._wrong, self._right = wrong, right
        self.rewritten = 0

    def send_notif(self, remote_agent: Any, notif_msg: Any = None, *args: Any,
                   **kwargs: Any) -> Any:
        if notif_msg == self._wrong:
            notif_msg = self._right
            self.rewritten += 1
        return self._agent.send_notif(remote_agent, *args, notif_msg=notif_msg, **kwargs)


def fix_notif_id(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    req_id = kwargs["req_id"] if "req_id" in kwargs else args[0]
    meta = kwargs["meta"] if "meta" in kwargs else args[1]
    remote = getattr(meta, "remote", None)
    if (not getattr(instance, "use_mla", False) or remote is None
            or remote.request_id == req_id or not allowed(NAME, instance)):
        return wrapped(*args, **kwargs)
    world = instance.world_size
    # The view is in place only for this call; other threads that touch the agent meanwhile
    # (the handshake initiator) get the delegating view, which is the same agent.
    view = agent_layers.push(instance, _NotifIdFix, f"{req_id}:{world}".encode(),
                             f"{remote.request_id}:{world}".encode())
    try:
        return wrapped(*args, **kwargs)
    finally:
        agent_layers.remove(instance, view)
        if view.rewritten:
            logger.debug("pdpatch: MLA notification for %s sent as prefill request %s "
                         "[mla_notif]", req_id, remote.request_id)
