"""Patch ``block_ids_bound``: a ``remote_block_ids`` list whose length does not match what the
decode engine allocated fails that request instead of reading another request's blocks.

With equal block sizes the pull read path pairs D's blocks with P's by the **end** of P's list:
every release 0.19-0.34 trims P's group to its last ``len(local)`` ids (``_read_blocks``'
prefix-cache trim: 0.19 ``nixl_connector.py`` L2649-2653; ``_apply_prefix_caching`` from 0.22,
0.34.0 ``base_worker.py`` L3878-3913, called from ``pull_worker.py::_read_blocks``), where
``local`` holds only the blocks D did not find in its own prefix cache.  Position ``i`` of D's
allocation (``h`` hit blocks, then the ``k`` blocks it reads into) is block ``i`` of the
prompt; position ``i`` of a correct P list is block ``i`` of P's prompt.  So the end trim pairs
the right blocks exactly when P lists ``h + k`` blocks, and otherwise reads the wrong ones:

* more ids (a proxy that sends 22 ids for a 2-block prompt, a P that also listed generated or
  lookahead blocks): D reads the *last* ids -- another request's blocks or the wrong part of
  this one -- and the server answers HTTP 200 with wrong tokens;
* fewer ids with a local hit (vllm-project/vllm#50558: a proxy appends P's first sampled token
  to D's prompt; when P's prompt ends on a block boundary D allocates one block more than P
  listed): every block read is shifted by one, again silently.  Without a local hit the
  release's own ``num_local <= len(remote)`` assert fires (``read_guard`` contains it).

Where P's blocks are smaller (``block_size_ratio`` r > 1) or hold another number of physical
blocks per logical block, 0.19-0.33 pair D's sub-blocks with P's list by position
(``_map_block_ids_for_block_size_ratio`` from 0.27, 0.33.0 ``pull_worker.py`` L435) and then
end-trim; D's token count is not known to the worker there, so only a list longer than
``(h + k) * r`` -- more than D's allocation can hold -- is refused (and only with equal
physical-per-logical ratios).  (That pairing also reads a *correct* list wrongly where D has a
local hit and P's list ends short of D's last sub-block -- 20 tokens, P blocks of 8, D blocks of
16, one hit: D's read block gets P's blocks 1 and 2, one block early, instead of block 2 in its
first half -- which this patch, judging lists, leaves to those releases; 0.34 reads it right.)

0.34 pairs both lists from P's last token instead (``_pair_blocks_by_last_token``, 0.34.0
``base_worker.py`` L3683-3727, from ``pull_worker.py`` L311-333) with ``remote_num_tokens`` T
(it declines such a read without it, L188-205).  P lists exactly the blocks of its T computed
tokens (``Scheduler._connector_finished``, 0.34.0 ``scheduler.py`` L3511-3514;
``remote_num_tokens = num_computed_tokens``, ``pull_scheduler.py`` L279), so 0.34 pairs right
exactly when P lists cdiv(T, P's logical block) blocks and D holds (``h + k``) cdiv(T, D's
logical block): anything else shifts every pair, which this patch refuses there.  vllm#50558
without a local hit is such a case that 0.33 read right and 0.34 reads one of D's blocks late
(P's prompt ending on D's block boundary, D's one token longer).

The check needs ``h``.  0.29+ carry it to the worker (``ReqMeta.local_num_computed_blocks``,
counted in ``update_state_after_alloc``, 0.34.0 ``pull_scheduler.py`` L160-169); for 0.19-0.28
this patch counts it there with the same expression and attaches it to that request's
``ReqMeta`` in ``build_connector_meta`` (:class:`LocalHits`, pdpatch's record on it,
:mod:`pdpatch.attached`, which no vLLM code reads; it travels with the metadata to the worker
processes, which receive it pickled).

Judged only where the release's own pairing is one of the above for one full-attention group:
one KV-cache group, no decode-context parallelism on either side, no region-mapped (0.33+ MLA)
read, no bidirectional (turn-2) transfers, a handshaken peer that the release neither marked
invalid nor is about to handshake with again (0.34.0 ``pull_worker.py`` L140-155).  A refused
load is failed with the release's own bookkeeping (:func:`pdpatch.vllm_sites.record_recv_failure`):
the scheduler recomputes or fails the request, no READ is posted, the engine serves on.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from

NAME = "block_ids_bound"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    site = vllm_sites.lookup(vllm_sites.READ_BLOCKS_FOR_REQ, version)
    if site is None or vllm_sites.recv_failure_style(version) is None:
        return []
    targets = [Target(site.module, site.qualname, _code("make_check", version))]
    if vllm_sites.release_of(version) < vllm_sites.LOCAL_HITS_IN_METADATA_FROM:
        record = vllm_sites.lookup(vllm_sites.PULL_UPDATE_STATE_AFTER_ALLOC, version)
        build = vllm_sites.lookup(vllm_sites.BUILD_CONNECTOR_META, version)
        if record is None or build is None:
            return []
        targets += [Target(record.module, record.qualname, _code("record_local_hits")),
                    Target(build.module, build.qualname, _code("attach_local_hits"))]
    return targets


PATCH = Patch(
    name=NAME,
    summary="remote_block_ids not matching the decode engine's allocation fail that request "
            "instead of reading the wrong blocks",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.READ_BLOCKS, vllm_sites.APPLY_PREFIX_CACHING,
               vllm_sites.BLOCK_SIZE_PAIRING, vllm_sites.CONNECTOR_FINISHED,
               vllm_sites.HANDLE_FAILED_TRANSFER),
    object_state=_code("LocalHits"),
)
