"""Patch ``num_blocks``: a NIXL worker registers and advertises exactly the blocks its engine
planned, whatever the allocator handed it.

Why: kvcached's KV tensors are views over a virtual range sized from the whole GPU, 1.2-7x more
blocks than ``kv_cache_config.num_blocks``.  Stock NixlConnector then asserts (0.19-0.29:
``shape[0] == num_blocks``), or mis-partitions (0.30-0.34: "cannot be partitioned into NIXL
regions", or bogus segments), and from 0.29 registers the tensor's whole storage -- the entire
virtual range -- with NIXL.  kvcached's own fix rewrites ``worker.num_blocks``, which from 0.30
changes only what is advertised (registration reads ``kv_cache_config.num_blocks``).

What this does, in a wrapper of ``register_kv_caches`` on the class defining it per release
(:data:`pdpatch.vllm_sites.REGISTER_KV_CACHES`):

* plan = ``kv_cache_config.num_blocks`` x ``physical_blocks_per_logical`` (kernel blocks), the
  ids the scheduler (kvcached's ``ElasticBlockPool`` included) can hand out;
* every attention tensor with more blocks is **narrowed** to the plan (a view: same memory);
  on releases that register a tensor's whole storage (>= 0.29) the narrowed views are re-based on
  a storage object that spans exactly their bytes, so what vLLM registers ends where the plan
  ends.  Why slicing and not "advertise the virtual capacity": see :mod:`pdpatch.block_counts`
  (GPU probe: a past-the-plan index then fails cleanly with ``NIXL_ERR_NOT_FOUND`` instead of
  silently reading kvcached's zero page; every TP rank advertises the same count because they
  share one ``KVCacheConfig``);
* a tensor with fewer blocks than planned fails registration with a message saying why;
* ``worker.num_blocks`` / ``_logical_num_blocks`` are restored to the plan if kvcached's own
  register patch (detected by its markers) changed them, so exactly one reconciliation is in
  effect -- pdpatch's; the ``KVCacheConfig`` shared with the model runner is never mutated;
* afterwards the advertised handshake metadata (``num_blocks``, ``region_num_blocks``) is
  decoded and checked against the target count.

Through vLLM 0.34 with no change here (0.34.0 ``v1/nixl/base_worker.py``): registration still
reads the per-layer plan from ``kv_cache_config.num_blocks`` x the physical-per-logical ratio
(L1688-1698), registers each cache's whole ``untyped_storage()`` (L1705, L1719-1720) and
raises "KV cache view cannot be partitioned into NIXL regions" for a view of more blocks than
planned (L1806-1815), so the slicing and re-basing above are what a kvcached-style pool needs
there too; what it advertises is still ``num_blocks`` / ``region_num_blocks`` in the encoded
metadata (L1973-2011).  vLLM 0.34's own extensible KV cache (CUDA VMM) needs none of it: the
connector is created after the cache is committed, with a ``KVCacheConfig`` copy whose
``num_blocks`` is the committed count, and gets views whose storage spans exactly the
committed blocks (``v1/worker/extensible_kv_cache.py`` L224-233, L489-510, L530-534), so
every tensor holds the plan and vLLM's own registration runs untouched here.

Switch: ``kv_connector_extra_config["pdpatch"]["num_blocks_mode"]`` = ``"slice"`` (default) or
``"virtual"`` (advertise and register the tensors' whole, equal, block count; the worker gets a
private ``KVCacheConfig`` copy carrying it).  Toggle: ``PDPATCH_NUM_BLOCKS``.
"""

from __future__ import annotations

import sys

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from, targets_at

NAME = "num_blocks"
_code = lazy_from(f"{__name__}.wrappers")
# kvcached's vLLM module (pdpatch.kvcached.INTERFACES_MODULE): without it in sys.modules there
# is nothing to note, and the summary line, made inside every `import vllm`, imports no reader.
_KVCACHED_INTERFACES = "kvcached.integration.vllm.interfaces"


def _targets(version: Version) -> list[Target]:
    return targets_at(version, (vllm_sites.REGISTER_KV_CACHES, _code("reconcile_register")))


def summary_note(active: bool) -> str:
    """Said once per process at install: kvcached's own NIXL patch may be present too."""
    if _KVCACHED_INTERFACES not in sys.modules:
        return ""
    from pdpatch import kvcached

    state = kvcached.read_state()
    charge = "pdpatch" if active else "kvcached's own patch (pdpatch num_blocks is off)"
    return f"{state.describe()}; block-count reconciliation by {charge}"


PATCH = Patch(
    name=NAME,
    summary="NIXL registers/advertises exactly the planned KV blocks (over-allocated views "
            "sliced, under-allocation refused); kvcached's own rewrite neutralized",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.SYNC_BLOCK_SIZE, vllm_sites.ADVERTISED_COUNTS,
               vllm_sites.RESTORE_KV_CACHES, vllm_sites.EXTENSIBLE_COMMITTED_VIEWS),
    summary_note=summary_note,
    state=_code("NumBlocksState"),
    runtime_status=_code("status_line"),
)
