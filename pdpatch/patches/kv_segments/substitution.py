"""``add_remote_agent`` for a peer whose K/V placement differs: vLLM's own code runs on a
*shadow* of the peer's metadata that describes the same bytes in the local layout's terms, so
its validation, TP mapping and local split handles apply unchanged; the remote descriptor list
it builds is swapped for pdpatch's (same count, order and lengths -- checked -- only addresses
differ).  Where: in ``_build_fa_remote`` from 0.21; at the ``get_xfer_descs`` /
``prep_xfer_dlist`` pair inside ``add_remote_agent`` on 0.19/0.20 (the builder is a closure
there)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from pdpatch import metrics, vllm_sites
from pdpatch.agent_layers import Layer, layered
from pdpatch.log import logger
from pdpatch.patches.common import arg
from pdpatch.patches.kv_segments.handshake import current_handshake
from pdpatch.patches.kv_segments.planning import Conversion, peer_read_ranges, plan_peer
from pdpatch.patches.kv_segments.settings import COALESCE_ENV, allowed, coalesce
from pdpatch.patches.kv_segments.staged_reads import stage_peer
from pdpatch.patches.kv_segments.state import count, existing_worker_state, worker_state
from pdpatch.registry import Wrapper

if TYPE_CHECKING:
    from pdpatch.kv import KVGeometry


class _Pending:
    """A descriptor list not yet handed to NIXL (0.19/0.20 substitution, see below)."""

    __slots__ = ("args", "blocks", "kwargs")

    def __init__(self, blocks: list, args: tuple, kwargs: dict) -> None:
        self.blocks, self.args, self.kwargs = blocks, args, kwargs


class _SubstitutingAgent(Layer):
    """Stands in for ``worker.nixl_wrapper`` during one 0.19/0.20 ``add_remote_agent`` call
    (the ``substitution`` layer of :mod:`pdpatch.agent_layers`).

    There the remote builder is a closure; its list reaches NIXL as
    ``prep_xfer_dlist(<remote agent>, get_xfer_descs(list))``.  On the handshake thread
    ``get_xfer_descs`` is deferred until ``prep_xfer_dlist`` shows which agent the list is for,
    and the remote agent's list is replaced by the converted one.  Everything else, and every
    other thread, goes straight to the agent below.
    """

    kind = "substitution"

    def __init__(self, agent: Any, conversion: Conversion) -> None:
        super().__init__(agent)
        self._conv = conversion
        self._thread = threading.get_ident()
        self._remote: Any = None

    def add_remote_agent(self, metadata: Any, *args: Any, **kwargs: Any) -> Any:
        name = self._agent.add_remote_agent(metadata, *args, **kwargs)
        if threading.get_ident() == self._thread:
            self._remote = name
        return name

    def get_xfer_descs(self, blocks_data: Any, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != self._thread:
            return self._agent.get_xfer_descs(blocks_data, *args, **kwargs)
        return _Pending(list(blocks_data), args, kwargs)

    def prep_xfer_dlist(self, agent: Any, descs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(descs, _Pending):
            blocks = descs.blocks
            if agent == self._remote and not self._conv.substituted:
                blocks = self._conv.substitute(blocks, None)
            descs = self._agent.get_xfer_descs(blocks, *descs.args, **descs.kwargs)
        return self._agent.prep_xfer_dlist(agent, descs, *args, **kwargs)


def _known(worker: Any, meta: Any) -> tuple[KVGeometry | None, Mapping | None, bool]:
    """What this worker and this thread's handshake know of the peer behind ``meta``: the
    worker's geometry from its tensors, the peer rank's advertised geometry, and whether the
    handshake let its hash through on a backend name alone."""
    ctx = current_handshake()
    state = existing_worker_state(worker)
    return (state.geometry if state is not None else None,
            ctx.advertised_by(meta) if ctx is not None else None, bool(ctx and ctx.accepted))


def _plan(worker: Any, meta: Any, tp_size: int, version: Version) -> Conversion | None:
    """:func:`plan_peer` with what this worker and this thread's handshake know of the peer."""
    local_true, advertised, accepted = _known(worker, meta)
    try:
        return plan_peer(worker, meta, tp_size, version, local_true=local_true,
                         advertised=advertised, hash_accepted=accepted)
    except (AttributeError, KeyError, TypeError) as exc:
        # a worker or metadata without what the planning reads (a stand-in): the
        # release's own handshake decides, with its own errors
        logger.warning("pdpatch kv_segments: peer %s not planned (%s: %s); vLLM's own "
                       "handshake runs", getattr(meta, "engine_id", "?"),
                       type(exc).__name__, exc)
        return None


def _coalesce_peer(worker: Any, meta: Any, rank: int, tp_size: int, version: Version) -> None:
    """``PDPATCH_KV_COALESCE``: a peer stock code serves has its READs staged too -- the same
    descriptor pairs vLLM built, read in the peer's address order so runs of blocks merge,
    then copied into the very local descriptors vLLM named."""
    t0 = time.perf_counter()
    local_true, advertised, _ = _known(worker, meta)
    ranges = peer_read_ranges(worker, meta, tp_size, version, local_true=local_true,
                              advertised=advertised)
    try:
        staged = stage_peer(worker, meta.engine_id, rank, ranges)
    except Exception as exc:     # an optimisation never fails a handshake stock code completed
        logger.warning("pdpatch kv_segments: peer %s rank %s not staged (%s: %s)",
                       meta.engine_id, rank, type(exc).__name__, exc)
        staged = False
    if staged:
        count("coalesced")
        logger.info("pdpatch kv_segments: peer %s rank %s (same layout): READs staged, runs of "
                    "blocks coalesced (%s); set up in %.0f ms", meta.engine_id, rank,
                    COALESCE_ENV, (time.perf_counter() - t0) * 1e3)
    else:
        logger.warning("pdpatch kv_segments: peer %s rank %s: %s is set but its READs cannot "
                       "be staged (see above); vLLM's own READs serve it", meta.engine_id, rank,
                       COALESCE_ENV)


def make_add_remote_wrapper(version: Version) -> Wrapper:
    """``add_remote_agent``: plan the peer; a converted one runs stock code on its shadow with
    the remote list swapped, then its READs are handed to staging."""
    closure_builder = vllm_sites.remote_builder_is_closure(version)

    def add_remote_agent(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not allowed(instance):
            return wrapped(*args, **kwargs)
        meta = arg(args, kwargs, 0, "nixl_agent_meta", None)
        rank = arg(args, kwargs, 1, "remote_tp_rank", 0)
        tp_size = arg(args, kwargs, 2, "remote_tp_size", 1)
        if meta is None or vllm_sites.remote_agent_known(
                instance, getattr(meta, "engine_id", None), rank, version):
            return wrapped(*args, **kwargs)       # the release returns the agent it has
        t0 = time.perf_counter()
        conversion = _plan(instance, meta, tp_size, version)
        t1 = time.perf_counter()
        if conversion is None:
            result = wrapped(*args, **kwargs)
            if coalesce():
                _coalesce_peer(instance, meta, rank, tp_size, version)
            return result
        if "nixl_agent_meta" in kwargs:
            kwargs = {**kwargs, "nixl_agent_meta": conversion.shadow}
        else:
            args = (conversion.shadow, *args[1:])
        state = worker_state(instance)
        state.begin(conversion)
        try:
            if closure_builder:
                with layered(instance, _SubstitutingAgent, conversion):
                    result = wrapped(*args, **kwargs)
            else:
                result = wrapped(*args, **kwargs)
        finally:
            state.end(conversion)
        if not conversion.substituted:
            from pdpatch.kv import GeometryMismatch

            raise GeometryMismatch(
                "vLLM built no remote descriptor list pdpatch could replace",
                conversion.plan.local, conversion.plan.remote)
        metrics.count(instance, metrics.PEERS_CONVERTED)
        t2 = time.perf_counter()
        staged = stage_peer(instance, meta.engine_id, rank,
                            conversion.plan.remote.read_ranges())
        t3 = time.perf_counter()
        logger.info("pdpatch kv_segments: peer %s rank %s converted (%s -> %s, %d descriptors%s) "
                    "in %.0f ms: planning %.0f, vLLM's add_remote_agent %.0f, staging %.0f",
                    meta.engine_id, rank, conversion.plan.remote.kind, conversion.plan.local.kind,
                    len(conversion.descs), ", READs staged" if staged else "",
                    (t3 - t0) * 1e3, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
        return result

    return add_remote_agent


def build_fa_remote_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``_build_fa_remote`` (0.21-0.25): vLLM's list for a converted peer's shadow, checked,
    then replaced by pdpatch's."""
    meta = arg(args, kwargs, 1, "nixl_agent_meta", None)
    state = existing_worker_state(instance)
    conversion = state.converting(meta) if state is not None and meta is not None else None
    if conversion is None:
        return wrapped(*args, **kwargs)
    stock = wrapped(*args, **kwargs)
    plan = arg(args, kwargs, 0, "plan", None)
    return conversion.substitute(stock, getattr(plan, "rank_offset_factor", None))
