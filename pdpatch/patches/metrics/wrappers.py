"""The code of patch ``metrics``, loaded when vLLM imports its NIXL statistics, the connector's
scheduler half or its Prometheus logger (the patch and why it exists:
:mod:`pdpatch.patches.metrics`)."""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from pdpatch import metrics, vllm_sites
from pdpatch.log import logger
from pdpatch.patches.common import allowed, arg
from pdpatch.patches.metrics import NAME
from pdpatch.registry import Wrapper


def _attach(stats: Any, build: Any, *owners: Any) -> Any:
    """``stats`` (or a fresh one from ``build()``) carrying the pending records of ``owners``."""
    if stats is not None and not isinstance(getattr(stats, "data", None), dict):
        return stats
    records = metrics.drain(*owners)
    if not records:
        return stats
    if stats is None:
        stats = build()
    stats.data.setdefault(metrics.RECORDS_KEY, []).extend(records)
    return stats


def worker_stats(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    stats = wrapped(*args, **kwargs)
    if not metrics.pending() or getattr(instance, "connector_worker", None) is None \
            or not allowed(NAME, instance):
        return stats
    return _attach(stats, instance.build_kv_connector_stats, instance.connector_worker)


def _nixl_connector(scheduler: Any, site: vllm_sites.Site | None) -> Any:
    """The scheduler's connector if it is a NIXL one (pull or push: ``site``, the release's
    :data:`vllm_sites.CONNECTOR_STATS`), else None."""
    connector = getattr(scheduler, "connector", None)
    return connector if vllm_sites.is_loaded_instance(connector, site) else None


def make_scheduler_stats(version: Version) -> Wrapper:
    site = vllm_sites.lookup(vllm_sites.CONNECTOR_STATS, version)   # once, not every step

    def scheduler_stats(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not metrics.pending():       # most steps: nothing counted, nothing to attach
            return wrapped(*args, **kwargs)
        connector = _nixl_connector(instance, site)
        if connector is None or not getattr(instance, "log_stats", False) or \
                not allowed(NAME, instance):
            return wrapped(*args, **kwargs)
        stats = arg(args, kwargs, 1, "kv_connector_stats", None)
        new = _attach(stats, type(connector).build_kv_connector_stats, instance, connector,
                      getattr(connector, "connector_scheduler", None))
        if new is not stats:
            if len(args) > 1:
                args = (args[0], new, *args[2:])
            else:
                kwargs = {**kwargs, "kv_connector_stats": new}
        return wrapped(*args, **kwargs)

    return scheduler_stats


def make_load_outcome(version: Version) -> Wrapper:
    site = vllm_sites.lookup(vllm_sites.CONNECTOR_STATS, version)

    def load_outcome(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        request = arg(args, kwargs, 0, "request", None)
        failed = getattr(request, "request_id", None) in \
            getattr(instance, "failed_recving_kv_req_ids", ())
        result = wrapped(*args, **kwargs)
        if _nixl_connector(instance, site) is not None and allowed(NAME, instance):
            metrics.count(instance, metrics.KV_REQUESTS,
                          *(metrics.LOAD_FAILED if failed else metrics.PULLED))
        return result

    return load_outcome


def merge_records(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    other = arg(args, kwargs, 0, "other", None)
    theirs = getattr(other, "data", None)
    records = theirs.pop(metrics.RECORDS_KEY, None) if isinstance(theirs, dict) else None
    try:
        result = wrapped(*args, **kwargs)
    finally:
        if records is not None:
            theirs[metrics.RECORDS_KEY] = records
    if records and isinstance(getattr(result, "data", None), dict):
        result.data.setdefault(metrics.RECORDS_KEY, []).extend(records)
    return result


def build_exporter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    if not allowed(NAME, arg(args, kwargs, 0, "vllm_config", None)):
        return result
    try:
        if instance._counter_cls.__module__.startswith("prometheus_client"):
            metrics.unregister_collectors()
        metrics.add_exporter(instance, metrics.Exporter(
            instance._counter_cls, instance._labelnames, instance.per_engine_labelvalues))
    except Exception as exc:  # vLLM's own metrics must come up whatever happens here
        logger.warning("pdpatch: pdpatch:* metrics not exported (%s: %s) [metrics]",
                       type(exc).__name__, exc)
    return result


def export_records(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    data = arg(args, kwargs, 0, "transfer_stats_data", None)
    exporter = metrics.exporter_for(instance)
    if exporter is not None and isinstance(data, dict) and data.get(metrics.RECORDS_KEY):
        exporter.export(data[metrics.RECORDS_KEY], arg(args, kwargs, 1, "engine_idx", 0))
    return result
