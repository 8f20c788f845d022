"""vllm#42895's family on a release's real code (0.23-0.26): a Mamba hybrid served with prefix
caching and speculative decoding.  The decode worker's ``_apply_prefix_caching`` asserts that
an SSM group's local list, when shorter than the remote one, is one block ("SSM can only have
one local block", 0.23.0 worker.py L2344, 0.26.0 base_worker.py L2293); with speculative
blocks it never is, and the assert kills the worker on the model-runner thread.

Both lists come from the release's own schedulers, built with its own unit-test helpers
(``tests/v1/kv_connector/unit/utils.py`` of its sdist, :mod:`hma_failed_recv_scenarios`) and a
full-attention + ``MambaSpec`` KV-cache config (block 16, ``mamba_cache_mode="align"``, the
mode prefix caching selects for such models, two speculative blocks):

* P runs a ``do_remote_decode`` request of 100 tokens to the end; its ``request_finished``
  sends the SSM group as nulls before the running state and the speculative slots
  (``[0]*6 + [run, spec, spec]``: the scheduler nulls the skipped blocks, and
  ``get_sw_clipped_blocks`` leaves non-window groups whole);
* D schedules the ``do_remote_prefill`` request with P's params: its connector metadata holds
  the running state and the speculative slots (``[run, spec, spec]``; Mamba's manager keeps
  no earlier state).

0.27 strips the speculative slots on both sides (``get_exchange_clipped_blocks``) and pairs
what remains.  The decode worker is the release's real worker (``robust_worker``: recording
NIXL agent, real handshake, ``start_load_kv``), registered with the hybrid full-attention +
sliding-window layout of the harness and told that its second group is the Mamba group the
way vLLM's own test does it (0.26.0 ``test_nixl_connector.py`` L1093 sets ``_has_mamba``): the
read path only reads ``_has_mamba`` and the group's spec type before it asserts.  The step's
worker output then goes to D's real scheduler (``update_from_output``), as the model runner
hands it over.
"""

from __future__ import annotations

import os
from typing import Any

import hma_failed_recv_scenarios as hfr
import robust_worker as rw

BLOCK = 16
PROMPT_TOKENS = 100
SPEC_BLOCKS = 2
MODE = "align"


def scheduler(role: str, policy: str = "fail") -> Any:
    """The release's scheduler with a full-attention + Mamba KV-cache config, its block sizes
    resolved as the engine core resolves them."""
    import torch
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    u = hfr.unit_utils()
    cfg = u.create_vllm_config(block_size=BLOCK, max_num_batched_tokens=2048,
                               max_model_len=2048, kv_role=role,
                               kv_load_failure_policy=policy)
    cfg.cache_config.mamba_cache_mode = MODE
    cfg.cache_config.mamba_block_size = BLOCK
    mamba = MambaSpec(block_size=BLOCK, shapes=((16,), (16,)), dtypes=(torch.float32,),
                      mamba_cache_mode=MODE, num_speculative_blocks=SPEC_BLOCKS)
    kvc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["attn0"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32)),
        KVCacheGroupSpec(["mamba0"], mamba)])
    sched_block, hash_block = resolve_kv_cache_block_sizes(kvc, cfg)
    cfg.cache_config.num_gpu_blocks = 64
    cls = u.AsyncScheduler if cfg.scheduler_config.async_scheduling else u.Scheduler
    return cls(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
               structured_output_manager=u.StructuredOutputManager(cfg),
               block_size=sched_block, hash_block_size=hash_block)


def step_output(req: Any) -> Any:
    """The model runner's output for a step of ``req``: a sampled token once its prompt is
    computed, none after a partial chunk (the release's ``create_model_runner_output`` samples
    one every step, which would end P's request after its first chunk: "align" mode cuts
    chunks at block boundaries)."""
    from vllm.v1.outputs import ModelRunnerOutput

    done = req.num_computed_tokens >= req.num_tokens
    return ModelRunnerOutput(req_ids=[req.request_id], req_id_to_index={req.request_id: 0},
                             sampled_token_ids=[[0] if done else []], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None)


def prefill_params() -> dict[str, Any]:
    """P's ``kv_transfer_params`` for the prompt, from its real scheduler."""
    u = hfr.unit_utils()
    p = scheduler("kv_both")
    req = u.create_request(request_id=1, num_tokens=PROMPT_TOKENS, do_remote_decode=True,
                           block_size=BLOCK)
    p.add_request(req)
    for _ in range(20):
        out = p.schedule()
        engine_out = p.update_from_output(out, step_output(req))
        for outs in engine_out.values():
            for o in outs.outputs:
                if o.request_id == req.request_id and o.finish_reason is not None:
                    return dict(o.kv_transfer_params)
    raise AssertionError("P's request did not finish")


def scenario(policy: str) -> dict[str, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    os.environ.update(hfr.hf_env())
    u = hfr.unit_utils()
    params = prefill_params()
    d_sched = scheduler("kv_both", policy)
    req = u.create_request(request_id=1, num_tokens=PROMPT_TOKENS, do_remote_prefill=True,
                           block_size=BLOCK)
    req.kv_transfer_params.update(params, do_remote_prefill=True, do_remote_decode=False)
    d_sched.add_request(req)
    first = d_sched.schedule()
    recv = first.kv_connector_metadata.reqs_to_recv[req.request_id]
    local = [list(g) for g in recv.local_block_ids]
    remote = [list(g) for g in params["remote_block_ids"]]

    # the handshake first (its warm-up read registers the harness's regions, which have no
    # Mamba state to describe), then the second group is the Mamba group
    d = rw.handshaken_decoder(hma=True, d_blocks=64, p_blocks=64, hybrid_manager=True)
    d._has_mamba = True
    d._group_spec_types = (FullAttentionSpec, MambaSpec)
    with rw.pdpatch_warnings() as logged:
        crash = rw.step(d, rw.recv_metadata([{"req_id": req.request_id, "local_ids": local,
                                              "remote_ids": remote,
                                              "engine": "prefill-engine"}]))
    results: dict[str, Any] = {}
    if crash is None:
        results, crash = rw.run_until(d, lambda a: req.request_id in a["done_recving"])
    observed = {"policy": policy, "local_ssm": local[1], "remote_ssm": remote[1],
                "local_fa": local[0], "remote_fa": remote[0],
                "crash": crash, "reads": rw._reads_by_req(d), "results": results,
                "logged": logged}
    if crash is not None:
        return observed
    meta = rw.worker_meta_object(d)
    return {**observed, "worker_meta": rw.failed_ids(meta),
            **hfr.after_worker_output(d_sched, first, req, results.get("done_recving", ()),
                                      meta)}


SCENARIOS = {"ssm_fail": lambda: scenario("fail"),
             "ssm_recompute": lambda: scenario("recompute")}


def release_report(names: list[str]) -> dict[str, Any]:
    return rw.stock_then_patched(SCENARIOS, names)
