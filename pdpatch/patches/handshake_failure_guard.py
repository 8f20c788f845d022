"""Patch ``handshake_failure_guard``: on vLLM 0.19-0.21 a failed handshake no longer kills the
decode worker one step later.

Found by fault injection (bad peers).  When the handshake with a prefill
engine fails before ``add_remote_agent`` registered it -- the prefill engine is dead (ZMQ times
out after 5 s), the compatibility hash differs, the peer's metadata is rejected -- the release
marks the waiting requests failed, and its ``get_finished`` then runs the
heterogeneous-block-size post-processing for them too, looking the unknown engine up:
``KeyError`` on the model-runner thread, the worker dies (0.19.0 ``nixl_connector.py`` L2302,
0.20.2 ``nixl/worker.py`` L1685, same in 0.21.0).  0.22 skips failed requests there ("Skip KV
sync and post-processing for failed requests").

The wrapper does what 0.22 does: requests listed as failed whose remote engine is unknown are
taken out of ``_failed_recv_reqs`` before the original runs and added to its ``done_recving``
afterwards, with their metadata dropped.  Their blocks were already marked invalid by the
release's own handshake-failure callback, so the scheduler recomputes or fails them.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed
from pdpatch.registry import Patch, Target, Wrapper

NAME = "handshake_failure_guard"


def make_guard(version: Version) -> Wrapper:
    def guard_get_finished(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        failed = getattr(instance, "_failed_recv_reqs", None)
        if not allowed(NAME, instance) or not isinstance(failed, set):
            return wrapped(*args, **kwargs)        # not the release's worker state: its own code
        orphans = set()
        for req_id in list(failed):
            meta = instance._recving_metadata.get(req_id)
            remote = getattr(meta, "remote", None)
            if remote is not None and not vllm_sites.remote_engine_known(
                    instance, remote.engine_id, version):
                orphans.add(req_id)
        failed -= orphans
        done_sending, done_recving = wrapped(*args, **kwargs)
        for req_id in orphans:
            instance._recving_metadata.pop(req_id, None)
            done_recving.add(req_id)
            logger.warning("pdpatch: request %s failed before its prefill engine was known; "
                           "reported as failed without post-processing "
                           "[handshake_failure_guard]", req_id)
        return done_sending, done_recving

    return guard_get_finished


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.GET_FINISHED, version)
    return [] if site is None else [Target(site.module, site.qualname, make_guard(version))]


PATCH = Patch(
    name=NAME,
    summary="a failed handshake fails its requests without crashing get_finished (0.19-0.21)",
    versions=vllm_sites.supported_until("0.22"),
    why_version="fixed upstream in vLLM 0.22.0 (get_finished skips failed requests)",
    targets=_targets,
)
