"""Patch ``read_guard``: an exception on the KV read path fails that request, not the worker.

``_read_blocks_for_req`` runs on the model-runner thread outside any ``try`` in every release
from 0.19 to 0.34 (``start_load_kv`` has no guard either: 0.34.0 ``pull_worker.py`` L49-81
calls it at L77 and L81).  Its asserts -- the prefix-trim ``num_local_blocks <= len(remote)``
(0.19 ``nixl_connector.py`` L2650, 0.33 ``base_worker.py`` L3791, 0.34.0 ``base_worker.py``
L3910), ``len(remote) == len(local) == len(groups)`` (0.34.0 L3840), ``len(local_desc_ids) ==
len(remote_desc_ids)`` (0.34.0 ``pull_worker.py`` L602) -- 0.34's ``TypeError`` for a
``remote_num_tokens`` that is no integer (``_pair_blocks_by_last_token``, ``base_worker.py``
L3717-3722) and any unexpected error there (a peer sent fewer blocks than the decode side
allocated: a race or a misconfigured proxy) kill the worker and with it the engine.  Wrapped,
the request's KV load is recorded as failed with the release's own bookkeeping
(:func:`pdpatch.vllm_sites.record_recv_failure`), so the scheduler recomputes or fails just that
request, frees its blocks, and the engine keeps serving others.

HMA models (a sliding-window or Mamba group) before 0.30 report load failures only as invalid
block ids, which those releases skip for HMA.  On 0.22-0.29 the request goes through
``hma_failed_recv``'s worker -> scheduler channel instead
(:func:`pdpatch.patches.hma_failed_recv.wrappers.fail_alone`): that is what turns vllm#42895's
family on 0.23-0.26 -- a Mamba hybrid with prefix caching and speculative decoding, whose every
P/D read asserts "SSM can only have one local block" (0.26.0 ``base_worker.py`` L2293) -- into
one failed or recomputed request.  Where no such channel serves the worker (0.19-0.21, or
``hma_failed_recv`` switched off) the original exception is re-raised: turning a crash into
silently-used garbage KV would be worse than the crash.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from

NAME = "read_guard"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.READ_BLOCKS_FOR_REQ, version)
    if site is None or vllm_sites.recv_failure_style(version) is None:
        return []
    return [Target(site.module, site.qualname, _code("make_guard", version))]


PATCH = Patch(
    name=NAME,
    summary="exceptions on the NIXL read path fail one request instead of killing the worker",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.START_LOAD_KV, vllm_sites.READ_BLOCKS,
               vllm_sites.HANDLE_FAILED_TRANSFER, vllm_sites.GET_FINISHED,
               vllm_sites.GET_TRANSFER_RESULTS),
)
