"""P/D exchanges through REAL vLLM scheduler-side objects, for the ``block_keys`` patch tests.

Built the way vLLM's own connector unit tests build them (``tests/v1/kv_connector/unit/utils.py``
of the 0.33 sdist: ``create_vllm_config``, ``create_scheduler``, ``create_request``), from vLLM's
real classes, with a local model directory instead of a hub model: a real ``VllmConfig`` with
``NixlConnector`` (or ``NixlPushConnector``), a real ``Scheduler`` (which creates the real NIXL
connector's scheduler half), real ``Request`` objects hashed by vLLM's own
``get_request_block_hasher`` after ``init_none_hash`` under the side's ``PYTHONHASHSEED``.

One exchange: P schedules a ``do_remote_decode`` request, a model-runner output with one token
finishes it, and vLLM's ``update_from_output`` returns the ``kv_transfer_params`` P's connector
produced (JSON round trip, as through the API server and the proxy).  D then receives a request
with those params and runs one ``schedule()``: we observe whether D waits for remote KV
(``WAITING_FOR_REMOTE_KVS``, blocks queued to receive) or computes the prompt itself (scheduled,
a receive queued with *no* blocks: the worker's notification that frees P's blocks).

Version-agnostic (names looked up per release), so the same scenarios run in process under the
installed release (0.34.0 in the test venv) and in a subprocess under an older release's source
tree (``tests/versions_harness.py``).  Every scenario returns JSON-able observations.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import robust_worker as rw
import torch
from packaging.version import Version

from pdpatch import vllm_sites

PROMPT_LEN = 100          # 6 full blocks of 16 + a partial block of 4
ENGINE_IDS = {"kv_producer": "P-engine", "kv_consumer": "D-engine"}
EOS = 2


def version_of() -> Version:
    return rw.version_of()


@dataclass(frozen=True)
class Side:
    """One engine's configuration and its copy of the request."""

    algo: str = "sha256"
    seed: str | None = "0"            # PYTHONHASHSEED in that engine (None: unset)
    block_size: int = 16
    prompt: tuple[int, ...] = tuple(range(1000, 1000 + PROMPT_LEN))
    lora: tuple[str, str] | None = None       # (name, path)
    salt: str | None = None
    connector: str = "NixlConnector"
    mamba: bool = False
    """The connector's scheduler half holds a Mamba group (``_has_mamba``, which vLLM derives
    from a ``MambaSpec`` KV-cache group): P stops its prefill short of the prompt's last token,
    which D recomputes itself (``vllm_sites.P_PROMPT_TRUNCATION``)."""
    skip_prefix_cache: bool = False    # the request's skip_reading_prefix_cache (prompt logprobs)


# ---------------------------------------------------------------------------- vLLM objects


def vllm_config(side: Side, role: str) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(rw.model_dir("llama", 2)), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True, max_model_len=2048)
    sched_kwargs: dict[str, Any] = {"max_num_seqs": 16, "max_num_batched_tokens": 2048,
                                    "max_model_len": 2048, "enable_chunked_prefill": True}
    if "is_encoder_decoder" in inspect.signature(SchedulerConfig).parameters:
        sched_kwargs["is_encoder_decoder"] = False
    cache_config = CacheConfig(block_size=side.block_size, gpu_memory_utilization=0.9,
                               enable_prefix_caching=True,
                               prefix_caching_hash_algo=side.algo)
    if version_of() >= Version("0.29"):
        cache_config.kv_cache_layout = "LBHNC"   # resolved by EngineCore in a real engine
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(**sched_kwargs),
        kv_transfer_config=KVTransferConfig(kv_connector=side.connector, kv_role=role,
                                            engine_id=ENGINE_IDS[role]),
        device_config=DeviceConfig("cpu"),
    )


def scheduler(side: Side, role: str, num_blocks: int = 1000) -> Any:
    """``create_scheduler`` of vLLM's tests: one full-attention group, many blocks."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = vllm_config(side, role)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=side.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cfg.cache_config.num_gpu_blocks = num_blocks
    if hasattr(kv_cache_config, "hash_block_size"):
        # 0.32+: EngineCore stores the resolved hash block size in the config the scheduler and
        # its connector half read (0.34.0 core.py L388-401)
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        kv_cache_config.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, cfg)[1]
    kwargs: dict[str, Any] = {"vllm_config": cfg, "kv_cache_config": kv_cache_config,
                              "log_stats": True,
                              "structured_output_manager": StructuredOutputManager(cfg),
                              "block_size": side.block_size}
    sched = Scheduler(**kwargs)
    if side.mamba:
        # what the half's __init__ sets for a KV-cache config with a MambaSpec group; in the
        # half nothing else reads it than the release's own truncation (P) and load count (D)
        half = sched.connector.connector_scheduler
        assert half._has_mamba is False, "the half no longer says whether it holds Mamba"
        half._has_mamba = True
    return sched


def engine_hash_block_size(sched: Any) -> int:
    """What EngineCore would hand ``get_request_block_hasher`` (the Scheduler's value from
    0.20, ``block_size`` in 0.19)."""
    return getattr(sched, "hash_block_size", None) or sched.block_size


def init_hashing(side: Side) -> Callable[[Any], bytes]:
    """EngineCore's ``init_none_hash`` under this side's PYTHONHASHSEED."""
    from vllm.v1.core import kv_cache_utils as K

    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:                       # <= 0.11
        from vllm.utils import get_hash_fn_by_name
    if side.seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = side.seed
    fn = get_hash_fn_by_name(side.algo)
    K.init_none_hash(fn)
    return fn


def request(side: Side, sched: Any, req_id: str, params: dict | None,
            max_tokens: int) -> Any:
    """``create_request`` of vLLM's tests, hashed by this engine's block hasher."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    fn = init_hashing(side)
    sp = SamplingParams(max_tokens=max_tokens)
    if side.skip_prefix_cache:
        sp.skip_reading_prefix_cache = True
    sp.update_from_generation_config({}, EOS)
    kwargs: dict[str, Any] = {}
    if side.lora is not None:
        from vllm.lora.request import LoRARequest

        kwargs["lora_request"] = LoRARequest(side.lora[0], 1, side.lora[1])
    if side.salt is not None:
        kwargs["cache_salt"] = side.salt
    req = Request(request_id=req_id, prompt_token_ids=list(side.prompt), sampling_params=sp,
                  pooling_params=None,
                  block_hasher=get_request_block_hasher(engine_hash_block_size(sched), fn),
                  **kwargs)
    req.kv_transfer_params = params
    return req


def runner_output(reqs: list[Any], token: int = 7) -> Any:
    """``create_model_runner_output`` of vLLM's tests: one sampled token per request."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = [r.request_id for r in reqs]
    fields = ModelRunnerOutput.__dataclass_fields__
    kwargs: dict[str, Any] = {"req_ids": ids, "sampled_token_ids": [[token] for _ in ids],
                              "logprobs": None, "prompt_logprobs_dict": {}}
    if "req_id_to_index" in fields:     # a required field up to 0.33; 0.34 dropped it
        kwargs["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    if "pooler_output" in fields:
        kwargs["pooler_output"] = None
    return ModelRunnerOutput(**kwargs)


# ---------------------------------------------------------------------------- one exchange


@contextlib.contextmanager
def captured_pdpatch_log() -> Iterator[list[str]]:
    lines: list[str] = []

    class _H(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname} {record.getMessage()}")

    lg = logging.getLogger("pdpatch")
    h = _H(level=logging.DEBUG)
    old = lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)


def prefill(p: Side, req_id: str = "req") -> tuple[dict[str, Any], list[str]]:
    """P finishes a ``do_remote_decode`` request; returns the params vLLM hands back and the
    request's ``block_hashes`` (hex) as P's vLLM computed them."""
    params, hashes, _ = _prefill(p, req_id)
    return params, hashes


def _prefill(p: Side, req_id: str) -> tuple[dict[str, Any], list[str], int]:
    """:func:`prefill`, and how many prompt tokens P computed (fewer than the prompt's where
    its release stops short of the last ones)."""
    sched = scheduler(p, "kv_producer")
    req = request(p, sched, req_id, {"do_remote_prefill": False, "do_remote_decode": True},
                  max_tokens=1)
    sched.add_request(req)
    out = sched.schedule()
    computed = out.num_scheduled_tokens.get(req_id)
    # the whole prompt, as P holds it when it schedules (P may have cut its last tokens)
    assert computed == req.num_prompt_tokens, (out.num_scheduled_tokens, req.num_prompt_tokens)
    outputs = sched.update_from_output(out, runner_output([req]))
    for eco in outputs.values():
        for o in eco.outputs:
            if o.request_id == req_id and o.finished:
                assert o.kv_transfer_params is not None, "P returned no kv_transfer_params"
                params = json.loads(json.dumps(o.kv_transfer_params))  # over HTTP and back
                return params, [h.hex() for h in req.block_hashes], computed
    raise AssertionError(f"P did not finish {req_id}: {outputs}")


def decode(d: Side, params: dict[str, Any], req_id: str = "dreq", steps: int = 1,
           finish: bool = False) -> dict[str, Any]:
    """D receives the request with P's params and schedules it ``steps`` times; ``finish``:
    then a model output with EOS ends it and one more step runs (push mode frees P's blocks
    only when D's request finishes)."""
    from vllm.v1.request import RequestStatus

    sched = scheduler(d, "kv_consumer")
    req = request(d, sched, req_id, copy.deepcopy(params), max_tokens=4)
    sched.add_request(req)
    obs: dict[str, Any] = {"steps": []}
    out = None
    for i in range(steps + (1 if finish else 0)):
        if finish and i == steps:
            assert out is not None and out.num_scheduled_tokens.get(req_id), \
                "finish needs a request D computes itself"
            sched.update_from_output(out, runner_output([req], token=EOS))
        out = sched.schedule()
        meta = out.kv_connector_metadata
        recv = getattr(meta, "reqs_to_recv", {}) or {}
        entry = recv.get(req_id)
        blocks = None
        if entry is not None:
            ids = entry.local_block_ids
            blocks = (sum(len(g) for g in ids) if ids and isinstance(ids[0], (list, tuple))
                      else len(ids))
        obs["steps"].append({
            "status": req.status.name,
            "scheduled_tokens": out.num_scheduled_tokens.get(req_id, 0),
            "recv_listed": entry is not None,
            "recv_blocks": blocks,
        })
    obs["waiting_for_remote"] = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    obs["finished"] = req.is_finished()
    # a receive with no blocks: the worker only notifies P, which frees the request's blocks
    obs["frees_p"] = any(st["recv_listed"] and st["recv_blocks"] == 0 for st in obs["steps"])
    obs["remote_prefill_flag"] = (req.kv_transfer_params or {}).get("do_remote_prefill")
    obs["d_keys"] = len(req.block_hashes)
    obs["d_hbs"] = engine_hash_block_size(sched)
    return obs


def exchange(p: Side, d: Side, mutate: Callable[[dict], Any] | None = None,
             steps: int = 1, finish: bool = False, reset: bool = True) -> dict[str, Any]:
    """P then D; ``mutate(params)`` edits what reaches D (a malicious or broken network);
    ``reset``: start from zero counters and fresh rate limits."""
    from pdpatch import installer
    from pdpatch.patches.block_keys import wrappers as block_keys

    saved_seed = os.environ.get("PYTHONHASHSEED")
    if reset:
        installer.reset_state()
    try:
        with captured_pdpatch_log() as log:
            params, p_hashes, p_computed = _prefill(p, "req")
            sent = copy.deepcopy(params.get(block_keys.PARAMS_KEY))
            if mutate is not None:
                mutate(params)
            obs = decode(d, params, steps=steps, finish=finish)
    finally:
        if saved_seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved_seed
    obs["sent"] = sent
    obs["p_block_hashes"] = p_hashes
    obs["p_computed"] = p_computed
    obs["sent_bytes"] = len(json.dumps(sent)) if sent is not None else 0
    obs["stats"] = block_keys.stats()
    obs["log"] = log
    return obs


# ---------------------------------------------------------------------------- the scenarios

BASE = Side()
LORA_A = ("adapter", "/adapters/a")
# names that differ in every release's key format (0.12-0.30 hash the name only)
LORA_B = ("adapter-b", "/adapters/b")


def _prompt_changed(at: int) -> tuple[int, ...]:
    p = list(BASE.prompt)
    p[at] += 1
    return tuple(p)


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def mutate(params: dict) -> None:
        from pdpatch.patches.block_keys import wrappers as block_keys

        params[block_keys.PARAMS_KEY][key] = value
    return mutate


def _replace_params(value: Any) -> Callable[[dict], None]:
    def mutate(params: dict) -> None:
        from pdpatch.patches.block_keys import wrappers as block_keys

        params[block_keys.PARAMS_KEY] = value
    return mutate


def _drop_params(params: dict) -> None:
    from pdpatch.patches.block_keys import wrappers as block_keys

    params.pop(block_keys.PARAMS_KEY, None)


EVAL_BAIT = "__import__('os').system('touch /tmp/pdpatch-block-keys-pwned')"

#: name -> (P side, D side, mutate, expected causes): P and D hold different requests
MISMATCHES: dict[str, tuple[Side, Side, Any, list[str]]] = {
    "prompt": (BASE, replace(BASE, prompt=_prompt_changed(20)), None, ["prompt"]),
    "prompt_tail": (BASE, replace(BASE, prompt=_prompt_changed(PROMPT_LEN - 1)), None,
                    ["prompt"]),
    "lora": (replace(BASE, lora=LORA_A), replace(BASE, lora=LORA_B), None, ["lora"]),
    "lora_missing_on_d": (replace(BASE, lora=LORA_A), BASE, None, ["lora"]),
    "cache_salt": (replace(BASE, salt="tenant-a"), replace(BASE, salt="tenant-b"), None,
                   ["cache_salt"]),
    # with another block size and seed on D: still the request decides
    "cache_salt_block_size_seed": (BASE, replace(BASE, salt="x", block_size=32, seed="1"),
                                   None, ["cache_salt"]),
}

MALFORMED: dict[str, Any] = {
    "not_a_dict": _replace_params("v1:" + "ab" * 20),
    "eval_bait_digest": _set("kd", EVAL_BAIT),
    "pickle_bait": _replace_params({"v": 3, "fp": "gASVCAAAAAAAAACMBHBvc2l4lC4=", "n": 1}),
    "oversized_keys": _set("keys", ["00" * 32] * 100_000),
    "huge_string": _set("kd", "a" * 10_000_000),
    "bool_as_int": _set("n", True),
    "too_many_fields": _replace_params({f"f{i}": i for i in range(10_000)}),
    "bad_algo": lambda p: p["pdpatch_block_keys"]["fp"].__setitem__("algo", "md5"),
    "not_canonical": lambda p: p["pdpatch_block_keys"]["fp"].__setitem__("algo", "sha256"),
}

#: name -> (P side, D side): the same request; the engines may name blocks differently
MATCHES: dict[str, tuple[Side, Side]] = {
    "default": (BASE, BASE),
    "xxhash_cbor_seeded": (replace(BASE, algo="xxhash_cbor"), replace(BASE, algo="xxhash_cbor")),
    "lora_and_salt": (replace(BASE, lora=LORA_A, salt="s"), replace(BASE, lora=LORA_A, salt="s")),
    "short_prompt": (replace(BASE, prompt=tuple(range(5, 15))),
                     replace(BASE, prompt=tuple(range(5, 15)))),
    "block_size_differs": (BASE, replace(BASE, block_size=32)),
    # the engines' own block names differ; the KV they hold for the request does not
    "seed_differs": (BASE, replace(BASE, seed="1")),
    "algo_differs": (BASE, replace(BASE, algo="sha256_cbor")),
    "block_size_and_seed": (BASE, replace(BASE, block_size=32, seed="1")),
    "short_prompt_seed": (replace(BASE, prompt=tuple(range(5, 15))),
                          replace(BASE, prompt=tuple(range(5, 15)), seed="1")),
    # vLLM's default: PYTHONHASHSEED unset, NONE_HASH from os.urandom in each engine for
    # xxhash (every release) and for every algorithm up to 0.28
    "xxhash_seed_unset": (replace(BASE, algo="xxhash_cbor", seed=None),
                          replace(BASE, algo="xxhash_cbor", seed=None)),
    "sha256_seed_unset": (replace(BASE, seed=None), replace(BASE, seed=None)),
}

MAMBA = replace(BASE, mamba=True)

#: name -> (P side, D side, expected causes): Mamba hybrids, whose P computes all but the
#: prompt's last token and whose D loads that prefix and computes the last token itself
#: (0.19+; 0.31+ also MTP's lookahead window, 0.32+ bounded replay: the same two methods)
TRUNCATED: dict[str, tuple[Side, Side, list[str]]] = {
    "same_prompt": (MAMBA, MAMBA, []),
    # D recomputes the token P never computed: the KV it loads is its own prompt's
    "last_token_differs": (MAMBA, replace(MAMBA, prompt=_prompt_changed(PROMPT_LEN - 1)), []),
    "last_loaded_token_differs": (MAMBA, replace(MAMBA, prompt=_prompt_changed(PROMPT_LEN - 2)),
                                  ["prompt"]),
    "prompt": (MAMBA, replace(MAMBA, prompt=_prompt_changed(20)), ["prompt"]),
    "cache_salt": (replace(MAMBA, salt="tenant-a"), replace(MAMBA, salt="tenant-b"),
                   ["cache_salt"]),
}

#: the engines' naming differences D reports (once per P) for each match
NAMING: dict[str, list[str]] = {
    "block_size_differs": ["hash_block_size"], "seed_differs": ["seed"],
    "algo_differs": ["algo"], "block_size_and_seed": ["hash_block_size", "seed"],
    "short_prompt_seed": ["seed"], "xxhash_seed_unset": ["seed"],
}


def run_unchecked(name: str) -> dict[str, Any]:
    """P sends no block keys (stock P), or params of another pdpatch version."""
    mutate = _drop_params if name == "stock_p" else _set("v", 2)
    return exchange(BASE, BASE, mutate)


def run_mismatch(name: str, steps: int = 1) -> dict[str, Any]:
    p, d, mutate, _ = MISMATCHES[name]
    return exchange(p, d, mutate, steps=steps)


def run_truncated(name: str) -> dict[str, Any]:
    p, d, _ = TRUNCATED[name]
    return exchange(p, d)


def run_match(name: str) -> dict[str, Any]:
    p, d = MATCHES[name]
    return exchange(p, d)


def run_malformed(name: str) -> dict[str, Any]:
    return exchange(BASE, BASE, MALFORMED[name])


def install_patch() -> dict[str, Any]:
    """Install pdpatch (all patches) in this process; the block_keys targets' states."""
    from pdpatch import installer

    states = installer.install()
    ps = states["block_keys"]
    for ts in ps.targets:               # the post-import hooks wrap as vLLM imports them
        importlib.import_module(ts.target.module)
    return {"status": ps.status, "reason": ps.reason,
            "targets": {ts.target.label: ts.status for ts in ps.targets}}


def installer_state() -> dict[str, Any]:
    from pdpatch import installer

    return installer.install()          # idempotent: the states of this process


def release_report() -> dict[str, Any]:
    """Every scenario under this process's vLLM: stock first (no pdpatch), then patched."""
    out: dict[str, Any] = {"version": str(version_of()), "stock": {}, "patched": {}}
    out["stock"]["match"] = run_match("default")
    out["stock"]["prompt_tail"] = run_mismatch("prompt_tail")
    out["stock"]["truncated:same_prompt"] = run_truncated("same_prompt")
    out["install"] = install_patch()
    for name in MATCHES:
        out["patched"][f"match:{name}"] = run_match(name)
    for name in MISMATCHES:
        out["patched"][f"mismatch:{name}"] = run_mismatch(name)
    for name in MALFORMED:
        out["patched"][f"malformed:{name}"] = run_malformed(name)
    for name in ("stock_p", "other_version"):
        out["patched"][name] = run_unchecked(name)
    for name in TRUNCATED:
        out["patched"][f"truncated:{name}"] = run_truncated(name)
    out["install_after"] = {ts.target.label: ts.status
                            for ts in installer_state()["block_keys"].targets}
    out["hash_block_size"] = {
        str(bs): vllm_sites.hash_block_size(
            scheduler(replace(BASE, block_size=bs), "kv_consumer").vllm_config,
            scheduler(replace(BASE, block_size=bs), "kv_consumer").kv_cache_config,
            version_of())
        for bs in (16, 32)}
    return out


def safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # reported to the test, which fails with it
        import traceback

        return {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}


__all__ = ["BASE", "MALFORMED", "MAMBA", "MATCHES", "MISMATCHES", "NAMING", "TRUNCATED", "Side",
           "exchange", "release_report", "run_malformed", "run_match", "run_mismatch",
           "run_truncated", "run_unchecked"]
