"""Patch ``division_checks``: a peer whose geometry makes the release's descriptor maths
truncate is rejected at handshake time, with the numbers, instead of being read with
truncated descriptors.

The decode worker turns a peer's metadata into descriptor lengths and ids with floor
divisions.  Most of them the release guards itself: ``block_size_ratio`` and ``tp_ratio``
assert that block sizes and TP sizes divide (every release 0.19-0.34: 0.34.0
``kv_connector/utils.py`` L539-565), and 0.33 and 0.34 first split non-dividing block sizes into
gcd-sized units for Mamba+MLA pulls (``_split_remote_blocks``, 0.34.0 ``base_worker.py``
L2414, called at L2555-2557).  Two are unguarded:

* the head slice: with a peer TP above the local one, each local block is read from
  ``peer TP / local TP`` peer ranks in slices of ``len // reads`` (0.33 and 0.34
  ``_build_local_splits_from_plan`` and ``_build_fa_remote``: 0.34.0 ``base_worker.py`` L341
  and L2317; 0.19 inline in ``add_remote_agent``).  A peer TP that does not divide the model's
  KV heads (TP 3 for 4 heads) passes the release's validation, which uses the same floor
  arithmetic, and every block is read in slices that cut through a head: bytes of every block
  are never transferred and (0.24+) each slice runs into the peer's next block.  Nothing
  reports it;
* the logical block count (0.21+): ``num_blocks // physical_blocks_per_logical_kv_block`` in
  ``_compute_desc_ids`` (0.34.0 ``base_worker.py`` L236; 0.19/0.20: the local ratio, only with
  Mamba groups).

The check is a post-hook on the release's own ``_validate_remote_agent_handshake``, which every
release calls after its own normalization of the peer's metadata (0.33: PP window, packed rows,
gcd block split; 0.34 also pairs regions by layer name first: ``add_remote_agent`` calls it at
``base_worker.py`` L2622, after L2547-2557) and before any descriptor is built.  So the
release's own refusals come first with their own errors, the check sees the metadata as the
release will use it, and the heads are the release's own (its topology's
``total_num_kv_heads``).  It raises
:class:`GeometryNotDivisible` in the handshake thread: only that peer's requests fail.  A
worker without the attributes the check reads is left to the release.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "division_checks"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.VALIDATE_HANDSHAKE, _code("make_check", version)))


PATCH = Patch(
    name=NAME,
    summary="reject at handshake a peer geometry that the descriptor maths would truncate",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.ADD_REMOTE_AGENT, vllm_sites.BUILD_FA_REMOTE,
               vllm_sites.BUILD_LOCAL_SPLITS, vllm_sites.DESC_IDS),
)
