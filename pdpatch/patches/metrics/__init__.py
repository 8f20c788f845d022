"""Patch ``metrics``: pdpatch's counters on vLLM's own ``/metrics`` (``pdpatch:*``).

The counts ride vLLM's NIXL statistics channel (:mod:`pdpatch.metrics` says how); the wrappers:

* the connector facade's ``get_kv_connector_stats`` (worker half only): the records counted for
  its worker join the stats it returns -- a fresh ``NixlKVConnectorStats`` when stock has none;
* ``Scheduler.make_stats``: the records counted for the scheduler, its connector and the
  connector's scheduler half join the step's connector stats (only with a NIXL connector and
  vLLM's stats on, where ``/metrics`` gets connector stats);
* ``Scheduler._update_waiting_for_remote_kv``: one ``kv_requests`` count per request whose KV
  load ended: ``pulled``, or ``recomputed``/``failure`` when the release marked it failed;
* ``NixlKVConnectorStats.aggregate``: stock extends every key of the other stats into its own
  (a ``KeyError`` on a key it lacks) and skips stats it calls empty -- records alone are
  "empty" -- so the records are set aside during the stock call and merged after it;
* ``NixlPromMetrics.__init__`` / ``observe`` (API server): build the ``pdpatch:*`` counters
  with vLLM's counter class and labels; after stock's observe, add the records.

Stock code sees only its own keys: ``reduce`` (the CLI log line), ``is_empty`` and
``observe`` read named keys and ignore the extra one.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from

NAME = "metrics"               # pdpatch.metrics.NAME: the patch that carries its counts
_code = lazy_from(f"{__name__}.wrappers")
_counts = lazy_from("pdpatch.metrics")      # the counts' state, shared with every patch


def _targets(version: Version) -> list[Target]:
    stats = vllm_sites.lookup(vllm_sites.NIXL_STATS_HOME, version)
    prom = vllm_sites.lookup(vllm_sites.NIXL_PROM_HOME, version)
    sched = vllm_sites.lookup(vllm_sites.SCHEDULER_HOME, version)
    facade = vllm_sites.lookup(vllm_sites.CONNECTOR_STATS, version)
    if None in (stats, prom, sched, facade):
        return []
    return [
        Target(facade.module, facade.qualname, _code("worker_stats")),
        Target(stats.module, f"{stats.qualname}.aggregate", _code("merge_records")),
        Target(sched.module, f"{sched.qualname}.make_stats",
               _code("make_scheduler_stats", version)),
        Target(sched.module, f"{sched.qualname}._update_waiting_for_remote_kv",
               _code("make_load_outcome", version)),
        Target(prom.module, f"{prom.qualname}.__init__", _code("build_exporter")),
        Target(prom.module, f"{prom.qualname}.observe", _code("export_records")),
    ]


PATCH = Patch(
    name=NAME,
    summary="pdpatch's counters on vLLM's /metrics (pdpatch:*), through vLLM's NIXL stats",
    versions=vllm_sites.SUPPORTED,
    targets=_targets,
    relies_on=(vllm_sites.STATS_READERS, vllm_sites.STATS_FOLD, vllm_sites.PROM_BASE,
               vllm_sites.LOAD_ENDED_CALLER),
    state=_counts("MetricsState"),
    object_state=_counts("Pending"),
)
