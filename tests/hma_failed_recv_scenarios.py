"""vllm#52234 on a release's real code, worker to scheduler (0.22-0.29): a hybrid (HMA) model's
KV receive fails (its prefill engine is gone: the release's real ZMQ handshake to a closed
port), the release's real decode worker reports it, and the release's real scheduler takes the
step's output.  Stock: the request is promoted as if its KV had arrived (vllm#52234: decoded
from blocks that never received anything).  With ``hma_failed_recv``: failed
(``kv_load_failure_policy="fail"``, the default) or computed again (``"recompute"``).

The scheduler is built with vLLM's own unit-test helpers of that release
(``tests/v1/kv_connector/unit/utils.py`` of its sdist, fetched at setup by
``python -m scripts.upstream_suites --fetch-only --helpers``:
``create_vllm_config``, ``create_scheduler``, ``create_request``,
``create_model_runner_output``); the connector's ``build_connector_worker_meta`` is the
release's (pdpatch wraps the base class's), called as the model runner calls it after
``get_finished``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import robust_worker as rw

from lab.env import cache_dir

PROMPT_BLOCKS = 3


@functools.cache
def unit_utils() -> Any:
    """The release's own ``tests/v1/kv_connector/unit/utils.py`` (loaded by path: its ``tests``
    package would shadow pdpatch's; once: it registers a test connector at import)."""
    version = str(rw.version_of())
    path = cache_dir() / "vllm-tests" / version / "tests" / "v1" / "kv_connector" / "unit" / \
        "utils.py"
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: run python -m scripts.upstream_suites --fetch-only --helpers")
    spec = importlib.util.spec_from_file_location(f"vllm_unit_utils_{version}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_env() -> dict[str, str]:
    """The offline Hugging Face cache the upstream gate keeps (facebook/opt-125m's config)."""
    from lab.upstream.suites import hf_home

    return {"HF_HOME": str(hf_home()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def worker_meta_after_failure(req_id: str, block_size: int) -> tuple[Any, list[str], Any]:
    """The release's HMA decode worker fails ``req_id`` (its prefill engine gone): what its
    ``get_finished`` reports done, and what the connector's ``build_connector_worker_meta``
    hands the scheduler in the same step."""
    d = rw.build_worker("decode-engine", num_blocks=32, hma=True, hybrid_manager=True)
    port = rw.free_port()
    with rw.closed_port_timeout():
        rw.step(d, rw.recv_metadata([{"req_id": req_id, "local_ids": [[1, 2, 3]] * 2,
                                      "remote_ids": [[4, 5, 6]] * 2, "engine": "prefill-dead",
                                      "port": port}]))
        acc, _ = rw.run_until(d, lambda a: req_id in a["done_recving"], timeout=30)
    return d, acc["done_recving"], rw.worker_meta_object(d)


def scenario(policy: str) -> dict[str, Any]:
    os.environ.update(hf_env())
    u = unit_utils()
    cfg = u.create_vllm_config(kv_load_failure_policy=policy)
    sched = u.create_scheduler(cfg)
    block = cfg.cache_config.block_size
    request = u.create_request(num_tokens=PROMPT_BLOCKS * block + 1, do_remote_prefill=True,
                               num_remote_blocks=PROMPT_BLOCKS, block_size=block)
    sched.add_request(request)
    first = sched.schedule()
    waiting = request.status.name
    d, done, meta = worker_meta_after_failure(request.request_id, block)
    return {"policy": policy, "status_waiting": waiting, "reported_done": sorted(done),
            "meta": type(meta).__name__ if meta is not None else None,
            **after_worker_output(sched, first, request, done, meta),
            "hma": bool(d._is_hma_required)}


def after_worker_output(sched: Any, scheduled: Any, request: Any, done: Any,
                        meta: Any) -> dict[str, Any]:
    """The scheduler's step output taken as the model runner hands it over (no tokens; the
    worker's finished receives ``done`` and its ``meta``), then its next schedule: which
    requests finished and why, and where ``request`` stands."""
    u = unit_utils()
    engine_out = sched.update_from_output(scheduled, u.create_model_runner_output(
        reqs=[], finished_recving=set(done), kv_connector_worker_meta=meta))
    after = sched.schedule()
    held = sched.requests.get(request.request_id)
    return {"finished": [(o.request_id, str(o.finish_reason))
                         for outs in (engine_out or {}).values() for o in outs.outputs
                         if o.finish_reason is not None],
            "status_after": None if held is None else held.status.name,
            "computed_after": None if held is None else held.num_computed_tokens,
            "scheduled_tokens_after": after.num_scheduled_tokens.get(request.request_id),
            "prompt_tokens": request.num_prompt_tokens}


SCENARIOS = {"hma_fail": lambda: scenario("fail"),
             "hma_recompute": lambda: scenario("recompute")}


def release_report(names: list[str]) -> dict[str, Any]:
    return rw.stock_then_patched(SCENARIOS, names)
