"""pdpatch's counters, and their way to vLLM's own ``/metrics``.

Counts arise in every vLLM process: NIXL workers (staged READs, converted peers, contained read
failures, refused peers), the EngineCore scheduler (pulled or recomputed requests, refused
params) and the API server (refused ``kv_transfer_params``).  Only the API server serves
``/metrics``.  vLLM already carries NIXL statistics that way -- a worker's
``NixlKVConnectorStats`` rides its model-runner output to the scheduler, whose
``SchedulerStats.kv_connector_stats`` (the stats' plain dict) reaches the API server, where
``NixlPromMetrics.observe`` records them as ``vllm:nixl_*`` -- so pdpatch's counts ride along:
the counts made for a worker (or a scheduler) since its last hand-over travel with that
object's statistics as *records* under one extra key of that dict (:data:`RECORDS_KEY`), and
the API server adds them to ``pdpatch:*`` Prometheus counters built like vLLM's own (its
counter class, its ``model_name``/``engine`` labels, so vLLM's multiprocess collection with
several API servers covers them too).  The wrappers that do this are the ``metrics`` patch
(:mod:`pdpatch.patches.metrics`); this module holds no vLLM code.

A count made in a process that serves ``/metrics`` (an API server's ``params_check``
refusals) goes straight to its counters, labelled with the first engine the server fronts.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pdpatch import attached
from pdpatch.log import logger
from pdpatch.state import Counter, State

#: The key pdpatch's records travel under in the NIXL connector stats' dict.
RECORDS_KEY = "pdpatch"
PREFIX = "pdpatch:"

#: A record: ``[metric, [label values...], amount]`` (lists: msgpack and pickle carry them).
Record = list[Any]


class Metric(NamedTuple):
    """One counter: its name without prefix and ``_total``, its own labels (after vLLM's
    ``model_name`` and ``engine``), the label values shown at 0 from the start, its help."""

    name: str
    labels: tuple[str, ...]
    preset: tuple[tuple[str, ...], ...]
    documentation: str


KV_REQUESTS = "kv_requests"
PEERS_CONVERTED = "peers_converted"
STAGED_READS = "staged_reads"
STAGED_READ_BYTES = "staged_read_bytes"
REFUSALS = "refusals"
FAILURES_CONTAINED = "failures_contained"
PEER_EVENTS = "peer_events"

# kv_requests outcomes and causes
PULLED = ("pulled", "")
KEY_MISMATCH = ("recomputed", "key_mismatch")
REFUSED_PARAMS = ("recomputed", "refused_params")
LOAD_FAILED = ("recomputed", "failure")

METRICS: dict[str, Metric] = {m.name: m for m in (
    Metric(KV_REQUESTS, ("outcome", "cause"), (PULLED, KEY_MISMATCH, REFUSED_PARAMS, LOAD_FAILED),
           "Decode requests with remote-prefill kv_transfer_params: KV pulled over NIXL, or "
           "the prompt recomputed locally, by cause (pdpatch)."),
    Metric(PEERS_CONVERTED, (), ((),),
           "Prefill peers whose K/V segment layout differs, served through converted "
           "descriptors (pdpatch kv_segments)."),
    Metric(STAGED_READS, (), ((),),
           "NIXL READs from converted (or, with PDPATCH_KV_COALESCE, coalesced) peers staged "
           "through the staging buffer (pdpatch kv_segments)."),
    Metric(STAGED_READ_BYTES, (), ((),),
           "Requested KV bytes read by staged NIXL READs (pdpatch kv_segments)."),
    Metric(REFUSALS, ("patch",),
           tuple((p,) for p in ("block_ids_bound", "block_keys", "division_checks",
                                "kv_segments", "lease_guard", "params_check", "params_guard",
                                "peer_check", "readback_guard")),
           "Requests, params or peers a pdpatch check refused instead of letting vLLM crash "
           "or use them, by patch."),
    Metric(FAILURES_CONTAINED, ("patch",), (("read_guard",),),
           "Exceptions on the NIXL read path that failed one request instead of the worker, "
           "by patch."),
    Metric(PEER_EVENTS, ("event",),
           tuple((e,) for e in ("disconnected", "new_incarnation", "replaced", "forgotten",
                                "stale_params", "deadline")),
           "Prefill engines a decode worker stopped reading from (disconnected, a new "
           "incarnation, replaced at its address) and forgot, requests whose params name a "
           "retired incarnation, requests failed past the peer deadline (pdpatch "
           "peer_restart)."),
)}

NAME = "metrics"        # the patch that carries these counts: pdpatch.patches.metrics

_lock = threading.Lock()


_undrained: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""The objects that hold counts no drain has taken yet, by ``id``.  Every engine step drains
(the scheduler's ``make_stats``, the worker's stats) and counts come a few per request, so a
step with nothing counted returns at once (:func:`pending`).  Weak, so an object collected with
its counts undrained leaves it (its counts go with it) instead of keeping every later step on
the full path; by ``id``, as vLLM's objects are told apart by identity, not by ``==``.  With
the objects, not with a patch's state: their counts outlive ``reset_state``."""


@dataclass
class MetricsState(State):
    """The ``metrics`` patch's per-process state: the process's totals of every counter (what
    ``pdpatch.status()`` reports: the one book of each counted event, :func:`count`), and its
    exporters, by the ``NixlPromMetrics`` that built each (none outside a ``/metrics``
    server); the newest takes the counts made in this process at once."""

    totals: dict[tuple[str, tuple[str, ...]], int] = field(default_factory=dict)
    exporters: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    local: Exporter | None = None

    def counters(self, patch: str) -> list[Counter]:
        """Every counter, at 0 where nothing was counted yet, named as on ``/metrics``."""
        with self.lock:
            totals = dict(self.totals)
        return [Counter(f"{PREFIX}{spec.name}_total", totals.get((spec.name, values), 0),
                        spec.documentation, tuple(zip(spec.labels, values, strict=True)))
                for spec in METRICS.values()
                for values in sorted({*spec.preset, *(v for m, v in totals if m == spec.name)})]


@dataclass
class Pending:
    """What the ``metrics`` patch keeps on one object (:mod:`pdpatch.attached`): the counts made
    for it and not handed over yet -- each goes out with that object's own statistics, never
    another's (two engines in one process, vLLM's own tests, keep their counts apart)."""

    counts: dict[tuple[str, tuple[str, ...]], int] = field(default_factory=dict)


def count(owner: Any, metric: str, *labels: str, amount: int = 1) -> int:
    """Count an event: ``amount`` more of a counter, for ``owner``, the vLLM object whose
    statistics carry it to the API server (``None``: made in the API server itself, or an
    owner gone).  The one call for it: it adds to this process's total (``pdpatch.status()``;
    returned) and queues it for ``/metrics`` -- exported at once where this process serves
    ``/metrics``, else with the owner's next statistics (for no owner, nowhere else).  An
    unknown metric or a wrong number of labels is a bug of the caller and raises."""
    from pdpatch.installer import object_state, state_of

    spec = METRICS[metric]
    if len(labels) != len(spec.labels):
        raise ValueError(f"{metric} takes labels {spec.labels}, got {labels}")
    state = state_of(NAME)
    with state.lock:
        total = state.totals[(metric, labels)] = state.totals.get((metric, labels), 0) + amount
    exporter = state.local
    if exporter is not None:
        exporter.export([[metric, list(labels), amount]], None)
        return total
    if owner is None:
        return total
    with _lock:
        try:
            mine = object_state(NAME, owner)
            if not mine.counts:
                _undrained[id(owner)] = owner
            mine.counts[(metric, labels)] = mine.counts.get((metric, labels), 0) + amount
        except (AttributeError, TypeError):    # no __dict__ or no weak reference to keep data
            logger.debug("pdpatch: %s not queued for a %s [metrics]", metric, type(owner))
    return total


def total(metric: str, *labels: str) -> int:
    """This process's total of a counter so far (what ``pdpatch.status()`` reports)."""
    from pdpatch.installer import state_of

    state = state_of(NAME)
    with state.lock:
        return state.totals.get((metric, labels), 0)


def pending() -> bool:
    """Whether any object holds counts not drained yet (read without the lock: a count made
    meanwhile goes out with the next drain)."""
    return len(_undrained) > 0


def drain(*owners: Any) -> list[Record]:
    """The counts of ``owners`` since their last drain, as records; forgotten here."""
    records: list[Record] = []
    if not pending():
        return records
    with _lock:
        for owner in owners:
            mine = attached.peek(owner, NAME) if owner is not None else None
            if mine is not None and mine.counts:
                taken, mine.counts = mine.counts, {}
                _undrained.pop(id(owner), None)
                records += [[m, list(labels), n] for (m, labels), n in taken.items()]
    return records


class Exporter:
    """``pdpatch:*`` counters next to one ``NixlPromMetrics``: built with the counter class,
    label names and per-engine label values vLLM gave it, so they are collected as its own
    ``vllm:nixl_*`` metrics are (one process, or vLLM's Prometheus multiprocess mode)."""

    def __init__(self, counter_cls: Any, labelnames: Sequence[str],
                 per_engine_labelvalues: Mapping[int, Sequence[object]]) -> None:
        self._engines = {i: [str(v) for v in vals] for i, vals in per_engine_labelvalues.items()}
        self._default = min(self._engines) if self._engines else None
        self._warned = False
        self.counters: dict[str, Any] = {}
        for spec in METRICS.values():
            counter = counter_cls(name=PREFIX + spec.name, documentation=spec.documentation,
                                  labelnames=[*labelnames, *spec.labels])
            self.counters[spec.name] = counter
            for values in self._engines.values():
                for extra in spec.preset:
                    counter.labels(*values, *extra)

    def export(self, records: Iterable[Any], engine_idx: int | None) -> None:
        """Add records to the counters of ``engine_idx`` (None: the first engine).  A record
        this pdpatch does not know (another version's) is skipped, never raised on."""
        values = self._engines.get(self._default if engine_idx is None else engine_idx)
        if values is None:
            return
        for rec in records:
            try:
                metric, labels, amount = rec
                spec = METRICS[metric]
                if len(labels) != len(spec.labels) or amount <= 0:
                    raise ValueError(rec)
                self.counters[metric].labels(*values, *labels).inc(amount)
            except Exception as exc:
                if not self._warned:
                    self._warned = True
                    logger.warning("pdpatch: metrics record %r not exported (%s: %s) [metrics]",
                                   rec, type(exc).__name__, exc)


def unregister_collectors() -> None:
    """Drop earlier ``pdpatch:*`` collectors from prometheus_client's default registry, as
    vLLM's ``unregister_vllm_metrics`` does for ``vllm:*`` before it builds its loggers again
    (registering a name twice raises)."""
    from prometheus_client import REGISTRY

    for collector in list(getattr(REGISTRY, "_collector_to_names", {})):
        if str(getattr(collector, "_name", "")).startswith(PREFIX):
            REGISTRY.unregister(collector)


def add_exporter(owner: Any, exporter: Exporter) -> None:
    """``exporter`` serves ``owner`` (a ``NixlPromMetrics``) and this process's own counts."""
    from pdpatch.installer import state_of

    state = state_of(NAME)
    state.exporters[owner] = exporter
    state.local = exporter


def exporter_for(owner: Any) -> Exporter | None:
    from pdpatch.installer import state_of

    return state_of(NAME).exporters.get(owner)
