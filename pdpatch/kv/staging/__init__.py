"""Staged READs inside a worker's NIXL agent (torch, no vLLM), for peers whose K/V placement
was converted: :mod:`.agent` the :class:`StagingAgent` that stands in for the worker's
``nixl_wrapper``; :mod:`.lists` the descriptor lists it saw prepared; :mod:`.reads` one staged
READ, its planning and its state; :mod:`.chunked` a READ larger than the free staging, in
pipelined chunks; :mod:`.calibration` a peer's gap budget; :mod:`.buffer` the
staging memory; :mod:`.copier` its allocator and the gather's copier; :mod:`.rows` descriptor
rows as arrays and the pure address-order helpers; :mod:`.nixl_states` NIXL's state names;
:mod:`.plans` the pure (numpy) pieces a staged READ is planned from, and why staging pays;
:mod:`.timeline` each READ's polls, logged at DEBUG."""

from pdpatch.kv.staging.agent import StagingAgent, StagingStats
from pdpatch.kv.staging.copier import ByteAllocator, ByteCopier, arenas_of
from pdpatch.kv.staging.rows import address_order

__all__ = ["ByteAllocator", "ByteCopier", "StagingAgent", "StagingStats", "address_order",
           "arenas_of"]
