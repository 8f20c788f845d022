"""pdpatch's counts on their way to ``/metrics`` through a release's REAL statistics code.

One scenario, run by ``tests/test_metrics.py`` on the installed release in process and on every
old release from its source tree (``robust_worker.release_report``, stock then patched): the
release's real D ``Scheduler`` with the NIXL connector (``tests/block_keys_scenarios.py``), a
real decode worker (``robust_worker.build_worker``) behind the connector facade, the release's
``NixlKVConnectorStats`` folded as ``KVOutputAggregator`` folds two workers', and the API
server's real ``PrometheusStatLogger`` and ``LoggingStatLogger`` reading the step's
``SchedulerStats``.

What happens: P prefills two requests' worth of params; D schedules two requests that wait
for remote KV; its workers report both received, one of them failed (the scheduler's own mark
for a failed async load); worker 0 had a failed NIXL transfer, worker 1 staged a READ
(pdpatch's count); the next steps promote both requests and hand the stats to the loggers.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
from typing import Any

import block_keys_scenarios as bks
import robust_worker as rw

from pdpatch import installer, metrics, vllm_sites


def _facade(connector_cls: type, worker: Any) -> Any:
    """A connector facade of the running release around a real worker half (the facade's
    constructor would build its own worker; vLLM's stats call is the facade's)."""
    facade = object.__new__(connector_cls)
    facade.connector_worker = worker
    return facade


def _output(reqs: list[Any], **kv: Any) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    out = bks.runner_output(reqs)
    out.kv_connector_output = KVConnectorOutput(**kv)
    return out


def exposition(text: str) -> dict[str, float]:
    """The ``pdpatch:*_total`` and ``vllm:nixl_num_failed_transfers_total`` samples, by
    series (``name{label="value",...}``, labels sorted, ``model_name`` left out)."""
    series = {}
    for line in text.splitlines():
        if line.startswith(("pdpatch:", "vllm:nixl_num_failed_transfers_total")) and \
                "_total" in line.split("{", 1)[0]:
            series_name, value = line.rsplit(" ", 1)
            name, _, labels = series_name.partition("{")
            kept = sorted(lv for lv in re.findall(r'\w+="[^"]*"', labels)
                          if not lv.startswith("model_name="))
            series[f"{name}{{{','.join(kept)}}}"] = float(value)
    return series


def api_server(vllm_config: Any, stats: Any) -> tuple[dict[str, float], list[str]]:
    """What an API server makes of one ``SchedulerStats``: its ``/metrics`` samples (after
    one ``params_check`` refusal of its own) and its CLI logger's connector line."""
    import prometheus_client
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

    prom = PrometheusStatLogger(vllm_config)
    prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
    metrics.count(None, metrics.REFUSALS, "params_check")       # straight to its counters
    exported = exposition(prometheus_client.generate_latest(prometheus_client.REGISTRY).decode())
    # The records must not change the CLI line.
    cli = LoggingStatLogger(vllm_config)
    cli.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
    lines: list[str] = []
    cli.kv_connector_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    return exported, lines


def api_server_alone() -> None:
    """One API server process of several: the stats of :func:`scenario_metrics`'s last step
    (its payload, as EngineCore sends it), recorded by a patched API server."""
    from vllm.v1.metrics.stats import SchedulerStats

    installer.install()
    site = vllm_sites.lookup(vllm_sites.NIXL_STATS_HOME, rw.version_of())
    payload = {k: list(v) for k, v in
               getattr(importlib.import_module(site.module), site.qualname)().data.items()}
    payload["num_failed_transfers"] = [1]
    payload[metrics.RECORDS_KEY] = [["staged_read_bytes", [], 4096],
                                    ["kv_requests", ["pulled", ""], 1],
                                    ["kv_requests", ["recomputed", "failure"], 1]]
    api_server(bks.vllm_config(bks.BASE, "kv_consumer"), SchedulerStats(kv_connector_stats=payload))


def scenario_metrics() -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    installer.reset_state()
    saved_seed = os.environ.get("PYTHONHASHSEED")
    try:
        params, _ = bks.prefill(bks.BASE)
        sched = bks.scheduler(bks.BASE, "kv_consumer")
        reqs = [bks.request(bks.BASE, sched, rid, copy.deepcopy(params), max_tokens=4)
                for rid in ("pulled", "failed")]
    finally:
        if saved_seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved_seed
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    waiting = [r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in reqs]

    # The workers: 0 had a failed transfer (stock's own stats); 1 staged a READ of 4096 bytes
    # (pdpatch: where kv_segments put a staging agent in front of it, 0.19-0.25, through the
    # callback the agent calls for every staged READ it posts, which counts for the worker;
    # elsewhere counted for the worker directly).
    from pdpatch import agent_layers
    from pdpatch.kv.staging import StagingAgent

    worker = rw.build_worker("D-engine")
    agent = agent_layers.find(worker, StagingAgent)
    stats_cls = type(worker.xfer_stats)
    first = stats_cls()
    first.record_failed_transfer()
    if agent is not None:
        agent._on_posted(4096)
    else:
        metrics.count(worker, metrics.STAGED_READS)
        metrics.count(worker, metrics.STAGED_READ_BYTES, amount=4096)
    metrics.count(rw.build_worker("other-engine"), metrics.STAGED_READS)   # not this worker's
    second = _facade(type(sched.connector), worker).get_kv_connector_stats()
    worker_records = (second.data.get(metrics.RECORDS_KEY) if second is not None else None)
    folded = first.aggregate(second) if second is not None else first

    # Both loads end, one failed (marked as the release's invalid-block handling marks a load
    # whose first block failed: no valid tokens); the promotion runs in the next schedule().
    sched.failed_recving_kv_req_ids.add("failed")
    reqs[1].num_computed_tokens = 0
    sched.update_from_output(out, _output([], finished_recving={"pulled", "failed"}))
    out = sched.schedule()
    promoted = [r.status.name for r in reqs]
    scheduled = [r for r in reqs if out.num_scheduled_tokens.get(r.request_id)]
    eco = sched.update_from_output(out, _output(scheduled, kv_connector_stats=folded))
    stats = next(e.scheduler_stats for e in eco.values() if e.scheduler_stats is not None)
    payload = stats.kv_connector_stats or {}

    exported, lines = api_server(sched.vllm_config, stats)
    installer.reset_state()
    return {"waiting": waiting, "promoted": promoted, "staging_agent": agent is not None,
            "worker_records": worker_records,
            "payload_keys": sorted(payload), "records": payload.get(metrics.RECORDS_KEY),
            "failed_transfers": payload.get("num_failed_transfers"),
            "exported": exported, "cli": lines}


SCENARIOS = {"metrics": scenario_metrics}
