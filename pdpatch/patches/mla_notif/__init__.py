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

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "mla_notif"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.READ_BLOCKS_FOR_REQ, _code("fix_notif_id")))


PATCH = Patch(
    name=NAME,
    summary="MLA notifications to non-read prefill ranks use the prefill request id",
    versions=vllm_sites.supported_until("0.21"),
    why_version="fixed upstream in vLLM 0.21.0 (the notification uses meta.remote.request_id)",
    targets=_targets,
    relies_on=(vllm_sites.READ_BLOCKS,),
)
