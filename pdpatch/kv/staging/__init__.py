"""Staged READs inside a worker's NIXL agent (torch, no vLLM), for peers whose K/V placement
was converted: :mod:`.agent` the :class:`StagingAgent` that stands in for the worker's
``nixl_wrapper``; :mod:`.calibration` its per-peer gap budget; :mod:`.copier` the staging
buffer's allocator and the gather's copier; :mod:`.rows` descriptor rows as arrays and the
pure address-order helpers.  The plans it executes are :mod:`pdpatch.kv.stage`'s (pure
numpy)."""

from pdpatch.kv.staging.agent import StagingAgent, StagingStats
from pdpatch.kv.staging.copier import ByteAllocator, ByteCopier, arenas_of
from pdpatch.kv.staging.rows import address_order

__all__ = ["ByteAllocator", "ByteCopier", "StagingAgent", "StagingStats", "address_order",
           "arenas_of"]
