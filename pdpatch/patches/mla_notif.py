"""Patch ``mla_notif``: MLA "done reading" notifications carry the prefill-side request id.

With MLA the KV cache is replicated on every TP rank, so when prefill TP > decode TP the decode
worker reads from one prefill rank only and then notifies the other prefill ranks that they may
free the request's blocks.  vLLM 0.19.0 (``nixl_connector.py`` L2559) and 0.20.x
(``nixl/worker.py`` L1974) build that message from the *decode* request id
(``f"{req_id}:{self.world_size}"``).  The prefill ranks do not know that id: they log
"Potentially invalid KV blocks for unrecognized request" and keep the blocks until the lease
expires (``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``), on every such request.  Upstream fixed it in 0.21.0
(vllm PR #40449, re-applied after #40731): ``meta.remote.request_id``.

The fix wraps ``_read_blocks_for_req`` and, for MLA workers, hands the method a view of its NIXL
agent whose ``send_notif`` rewrites exactly that message to the prefill-side id.  Nothing else
the method sends matches it: its only other notification (full prefix hit, in ``_read_blocks``)
and the READ's own notification already use the prefill id.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from pdpatch import agent_layers, vllm_sites
from pdpatch.agent_layers import Layer
from pdpatch.log import logger
from pdpatch.patches.common import allowed
from pdpatch.registry import Patch, Target

NAME = "mla_notif"


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


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.READ_BLOCKS_FOR_REQ, version)
    return [] if site is None else [Target(site.module, site.qualname, fix_notif_id)]


PATCH = Patch(
    name=NAME,
    summary="MLA notifications to non-read prefill ranks use the prefill request id",
    versions=vllm_sites.supported_until("0.21"),
    why_version="fixed upstream in vLLM 0.21.0 (the notification uses meta.remote.request_id)",
    targets=_targets,
    relies_on=(vllm_sites.READ_BLOCKS,),
)
