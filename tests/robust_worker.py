"""Real vLLM NIXL workers on CPU for the robustness tests, on any release 0.19-0.34.

In the style of vLLM's own NIXL unit tests (``tests/v1/kv_connector/unit/test_nixl_connector.py``
of the sdists): the worker class, ``register_kv_caches``, ``add_remote_agent`` (called by the
real ``_background_nixl_handshake`` through an instance-level ``_nixl_handshake``, exactly as
vLLM's ``FakeNixlConnectorWorker`` does), ``start_load_kv``, ``_read_blocks_for_req`` and
``get_finished`` / ``get_transfer_results`` are the release's own.  Only the NIXL agent is
replaced (``NixlWrapper`` in the worker module, where vLLM's tests patch it) by
:class:`RecordingNixlWrapper`, which records descriptor lists, READs and notifications and can
deliver notifications to a peer worker; the TP rank/size functions the worker module imported
are patched for construction, as vLLM's tests do.

Everything here is version-agnostic (names looked up per release) so the same scenarios run in
process under the installed release and in a subprocess under an older release's source tree
(``tests/versions_harness.py``).  Scenario functions return JSON-able observations.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar
from unittest.mock import MagicMock, patch

import kvc_harness
import numpy as np
import torch
from kvc_harness import kv_cache_tensors
from packaging.version import Version

from pdpatch import vllm_sites

BLOCK_SIZE = 16
NUM_LAYERS = 2
HEAD_DIM = 64
DTYPE = torch.bfloat16
HOST, PORT = "127.0.0.1", 5999


# ---------------------------------------------------------------------------- model configs


def model_dir(kind: str = "llama", kv_heads: int = 2) -> Path:
    """A local HF config directory (the worker reads only the config, never weights)."""
    d = Path(tempfile.gettempdir()) / f"pdpatch-robust-{kind}-{kv_heads}"
    d.mkdir(exist_ok=True)
    if kind == "llama":
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_size": 64 * 2 * kv_heads, "intermediate_size": 512,
               "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 2 * kv_heads,
               "num_key_value_heads": kv_heads, "head_dim": HEAD_DIM, "vocab_size": 512,
               "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    elif kind == "mla":
        # A 2-layer DeepSeek-V2-style MLA config: KV cache is one latent (kv_lora_rank +
        # qk_rope_head_dim) per token, replicated on every TP rank.
        cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
               "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
               "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4,
               "num_key_value_heads": 4, "kv_lora_rank": 128, "q_lora_rank": 64,
               "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "first_k_dense_replace": NUM_LAYERS,
               "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
               "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
               "torch_dtype": "bfloat16"}
    else:
        raise ValueError(kind)
    # Atomically: tests in other processes (xdist workers, release children) read this same
    # file, and a plain write_text lets them see it empty (JSONDecodeError in ModelConfig).
    path, text = d / "config.json", json.dumps(cfg)
    if not path.is_file() or path.read_text() != text:
        tmp = d / f"config.json.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(text)
        os.replace(tmp, path)
    return d


def vllm_config(kind: str, kv_heads: int, role: str, tp_size: int,
                extra: dict | None = None, block_size: int = BLOCK_SIZE,
                hybrid_manager: bool = False) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model_dir(kind, kv_heads)), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True, max_model_len=1024)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9)
    if version_of() >= Version("0.29"):
        # Resolved by EngineCore in a real engine (0.29+); head-major as NIXL asks.
        cache_config.kv_cache_layout = "LBHNC"
    sched_kwargs: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 256,
                                    "max_model_len": 1024}
    if "is_encoder_decoder" in inspect.signature(SchedulerConfig).parameters:
        sched_kwargs["is_encoder_decoder"] = False
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(tensor_parallel_size=1),
        scheduler_config=SchedulerConfig(**sched_kwargs),
        kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role=role,
                                            kv_connector_extra_config=extra or {}),
        device_config=DeviceConfig("cpu"),
    )
    # The worker sizes its head split from the TP size in the config; set after validation
    # (one process stands in for one rank of a `tp_size` engine).
    cfg.parallel_config.tensor_parallel_size = tp_size
    if hybrid_manager:
        # What `--no-disable-hybrid-kv-cache-manager` gives on a GPU platform: 0.19-0.21 turn
        # the hybrid KV-cache manager off by default when a KV connector is set (and always
        # on CPU); set after validation, as the TP size above.
        cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    return cfg


# ---------------------------------------------------------------------------- fake NIXL


class RecordingNixlWrapper(kvc_harness.RecordingNixlWrapper):
    """The kvcached harness's recording NIXL stand-in, plus what the robustness tests read and
    drive: the READs posted, the notifications sent, and an inbox of notifications to deliver."""

    instances: ClassVar[list[RecordingNixlWrapper]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[dict[str, Any]] = []
        self.notifs_sent: list[tuple[str, str]] = []
        self.inbox: list[tuple[str, bytes]] = []
        self.remote_agents: list[str] = []

    def get_agent_metadata(self):
        return b"agent:" + str(id(self)).encode()

    def add_remote_agent(self, metadata):
        name = metadata.decode() if isinstance(metadata, bytes) else str(metadata)
        self.remote_agents.append(name)
        return name

    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle, remote_ids,
                          notif_msg=None, *args, **kwargs):
        h = self._new_handle()
        self.reads.append({"op": op, "handle": h, "local": int(local_handle),
                           "local_ids": [int(x) for x in np.asarray(local_ids).ravel()],
                           "remote": int(remote_handle),
                           "remote_ids": [int(x) for x in np.asarray(remote_ids).ravel()],
                           "notif": notif_msg.decode() if notif_msg else None})
        return h

    def send_notif(self, agent, notif_msg=None, *args, **kwargs):
        msg = notif_msg.decode() if isinstance(notif_msg, bytes) else str(notif_msg)
        self.notifs_sent.append((agent, msg))

    def get_new_notifs(self):
        out: dict[str, list[bytes]] = {}
        for agent, msg in self.inbox:
            out.setdefault(agent, []).append(msg)
        self.inbox.clear()
        return out

    def check_remote_metadata(self, *args, **kwargs):
        return True


# ---------------------------------------------------------------------------- the worker


def version_of() -> Version:
    from pdpatch.versions import vllm_version

    v = vllm_version()
    assert v is not None
    return v


def worker_module() -> Any:
    site = vllm_sites.lookup(vllm_sites.NIXL_WRAPPER_HOME, version_of())
    return importlib.import_module(site.module)


def worker_class() -> Any:
    site = vllm_sites.lookup(vllm_sites.READ_BLOCKS_FOR_REQ, version_of())
    return getattr(importlib.import_module(site.module), site.qualname.split(".")[0])


def attention_spec(kind: str, kv_heads: int, block_size: int = BLOCK_SIZE) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if kind == "mla":
        kwargs = {"block_size": block_size, "num_kv_heads": 1, "head_size": 160,
                  "dtype": DTYPE}
        return MLAAttentionSpec(**kwargs)
    return FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=HEAD_DIM,
                             dtype=DTYPE)


def kv_cache_config(num_blocks: int, layer_names: list[str], spec: Any,
                    hma: bool = False) -> Any:
    """One group of ``spec`` for all layers; ``hma``: layer 0 full attention, layer 1 sliding
    window, one group each (a hybrid KV-cache layout, ``_is_hma_required``)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    tensors = kv_cache_tensors(num_blocks, spec.page_size_bytes, layer_names)
    if hma:
        swa = SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                head_size=spec.head_size, dtype=spec.dtype,
                                sliding_window=2 * spec.block_size)
        groups = [KVCacheGroupSpec([layer_names[0]], spec),
                  KVCacheGroupSpec(layer_names[1:], swa)]
    else:
        groups = [KVCacheGroupSpec(layer_names, spec)]
    return KVCacheConfig(num_blocks, tensors, groups)


def kv_tensors(kind: str, kv_heads: int, num_blocks: int, layer_names: list[str],
               local_heads: int, padding: int = 0,
               block_size: int = BLOCK_SIZE) -> dict[str, torch.Tensor]:
    """One contiguous tensor per layer: MLA ``(N, bs, C)``; attention in
    :func:`kv_cache_shape`'s shape (head-major, the layout the NIXL connector asks for; from
    0.29 ``(N, H, bs, 2D)`` as the planner lays out LBHNC)."""
    out = {}
    for i, n in enumerate(layer_names):
        if kind == "mla":
            shape: tuple[int, ...] = (num_blocks, block_size, 160)
        else:
            shape = kv_cache_shape(num_blocks, block_size, local_heads, HEAD_DIM)
        numel = int(np.prod(shape))
        t = (torch.arange(numel + padding, dtype=torch.float32) + 1000 * i).to(DTYPE)
        out[n] = t[:numel].view(shape)
    return out


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   cache_dtype_str: str = "auto") -> tuple[int, ...]:
    """The attention KV shape per release, as the GPU backends NIXL serves define it (0.19-0.22:
    K and V as separate regions; 0.23-0.25: FlashAttention's blocks-first ``(N, 2, ...)``, K|V
    virtually split per block; 0.26-0.28: K|V packed in the content dim).  From 0.29 the
    planner decides and the backend has no such method."""
    v = version_of()
    if v < Version("0.23"):
        return (2, num_blocks, num_kv_heads, block_size, head_size)
    if v < Version("0.26"):
        return (num_blocks, 2, num_kv_heads, block_size, head_size)
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def cpu_backend(block_size: int = BLOCK_SIZE) -> Any:
    """The attention backend object the worker consults, mocked as vLLM's tests do; up to
    0.28 the worker derives the K/V layout from ``get_kv_cache_shape``."""
    backend = MagicMock()
    backend.get_name.return_value = "CPU_ATTN"
    backend.get_supported_kernel_block_sizes.return_value = [block_size]
    backend.full_cls_name.return_value = "fake.CPU_ATTN"
    backend.get_kv_cache_shape.side_effect = kv_cache_shape
    return backend


@contextlib.contextmanager
def fake_runtime(tp_rank: int, tp_size: int, block_size: int = BLOCK_SIZE) -> Iterator[Any]:
    """What vLLM's own tests patch: the NIXL agent, the TP group functions, the backends."""
    mod = worker_module()
    patches = [patch.object(mod, "NixlWrapper", RecordingNixlWrapper),
               patch.object(mod, "get_tensor_model_parallel_rank", return_value=tp_rank),
               patch.object(mod, "get_tensor_model_parallel_world_size",
                            return_value=tp_size)]
    for name in ("get_current_attn_backends",):
        if hasattr(mod, name):
            patches.append(patch.object(mod, name, return_value=[cpu_backend(block_size)]))
    if hasattr(mod, "get_current_attn_backend"):
        patches.append(patch.object(mod, "get_current_attn_backend",
                                    return_value=cpu_backend(block_size)))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield mod


def build_worker(engine_id: str, *, role: str = "kv_consumer", num_blocks: int = 32,
                 kind: str = "llama", kv_heads: int = 2, tp_rank: int = 0, tp_size: int = 1,
                 extra: dict | None = None, hma: bool = False, padding: int = 0,
                 before_register: Any = None, block_size: int = BLOCK_SIZE,
                 hybrid_manager: bool = False) -> Any:
    """A real worker of the running release with its KV caches registered; ``padding``: each
    layer's tensor is a view of a buffer that many elements longer (a sub-block tail);
    ``before_register(worker)`` runs between construction and registration; ``block_size``:
    tokens per block (logical and kernel); ``hybrid_manager``: the hybrid KV-cache manager
    explicitly on (:func:`vllm_config`)."""
    from vllm.config import set_current_vllm_config

    cfg = vllm_config(kind, kv_heads, role, tp_size, extra, block_size, hybrid_manager)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    local_heads = max(1, kv_heads // tp_size)
    spec = attention_spec(kind, local_heads, block_size)
    kvc = kv_cache_config(num_blocks, layers, spec, hma)
    with fake_runtime(tp_rank, tp_size, block_size), set_current_vllm_config(cfg), \
            patch("threading.Thread"):
        worker = worker_class()(cfg, engine_id, kvc)
        if before_register is not None:
            before_register(worker)
        worker.register_kv_caches(kv_tensors(kind, kv_heads, num_blocks, layers, local_heads,
                                             padding, block_size))
    return worker


def own_metadata(worker: Any) -> Any:
    """The worker's handshake metadata, decoded with the release's own dataclass."""
    import msgspec

    cls = worker_module().NixlAgentMetadata
    return msgspec.msgpack.Decoder(cls).decode(
        worker.xfer_handshake_metadata.agent_metadata_bytes)


def remote_metadata(peer: Any, engine_id: str, agent: str, **changes: Any) -> Any:
    """``peer``'s metadata renamed as rank ``agent`` of engine ``engine_id``, with changes."""
    import dataclasses

    meta = own_metadata(peer)
    return dataclasses.replace(meta, engine_id=engine_id, agent_metadata=agent.encode(),
                               **changes)


def connect_by_handshake(worker: Any, metas: dict[int, Any], remote_tp_size: int,
                         peers: dict[str, tuple[dict[int, Any], int]] | None = None) -> list:
    """Make the worker's real background handshake resolve to ``add_remote_agent`` calls with
    ``metas`` (rank -> metadata), instead of ZMQ -- what vLLM's FakeNixlConnectorWorker does.
    ``peers`` adds more engines (engine id -> (metas, tp size)).  Returns the list that
    collects every exception the handshake raised (what the release's handshake path sees)."""
    tuple_keys = version_of() >= Version("0.26")
    table = dict(peers or {})
    if metas:
        table[next(iter(metas.values())).engine_id] = (metas, remote_tp_size)
    errors: list[str] = []
    real_handshake = worker._nixl_handshake

    def _nixl_handshake(*args: Any, **kwargs: Any) -> Any:
        engine = next((a for a in (*args, *kwargs.values()) if isinstance(a, str) and a in table),
                      None)
        if engine is None:              # not a scripted peer: the release's real ZMQ handshake
            try:
                return real_handshake(*args, **kwargs)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                raise
        rank_metas, tp = table[engine]
        agents = {}
        try:
            for rank, meta in rank_metas.items():
                name = worker.add_remote_agent(meta, rank, tp)
                agents[(0, rank) if tuple_keys else rank] = name
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            raise
        return (agents, 0.0) if tuple_keys else agents

    worker._nixl_handshake = _nixl_handshake
    return errors


def recv_metadata(reqs: list[dict[str, Any]], remote_tp_size: int = 1) -> Any:
    """A real ``NixlConnectorMetadata`` with requests to receive (D side)."""
    meta = worker_module_metadata_cls()()
    for r in reqs:
        params = {"remote_block_ids": r["remote_ids"], "remote_engine_id": r["engine"],
                  "remote_request_id": r.get("remote_req_id", r["req_id"]),
                  "remote_host": HOST, "remote_port": r.get("port", PORT),
                  "tp_size": r.get("tp_size", remote_tp_size), **r.get("params", {})}
        fn = meta.add_new_req_to_recv
        kwargs = {"awaiting_kvs": True} if "awaiting_kvs" in \
            inspect.signature(fn).parameters else {}
        fn(request_id=r["req_id"], local_block_ids=r["local_ids"], kv_transfer_params=params,
           **kwargs)
    return meta


def worker_module_metadata_cls() -> Any:
    mod = worker_module()
    if hasattr(mod, "NixlConnectorMetadata"):
        return mod.NixlConnectorMetadata
    return importlib.import_module(f"{vllm_sites.NIXL_PKG}.metadata").NixlConnectorMetadata


def send_metadata(req_ids: list[str], ttl: float = 600.0) -> Any:
    """A real ``NixlConnectorMetadata`` for the P side: requests whose blocks await readers."""
    meta = worker_module_metadata_cls()()
    for r in req_ids:
        meta.reqs_in_batch.add(r)
        meta.reqs_to_send[r] = time.perf_counter() + ttl
    return meta


def finished(worker: Any) -> dict[str, Any]:
    """One ``get_finished`` (<=0.29) / ``get_transfer_results`` (>=0.30) round, normalised."""
    if hasattr(worker, "get_transfer_results"):
        res = worker.get_transfer_results()
        done_recv = set(getattr(res, "finished_recving", None) or ())
        done_send = set(getattr(res, "finished_sending", None) or ())
        failed = set(getattr(res, "failed_recving", None) or ())
    else:
        done_send, done_recv = worker.get_finished()
        done_send, done_recv, failed = set(done_send or ()), set(done_recv or ()), set()
    invalid = set(worker.get_block_ids_with_load_errors())
    return {"done_recving": sorted(done_recv), "done_sending": sorted(done_send),
            "failed_recving": sorted(failed), "invalid_blocks": sorted(invalid)}


def merge(acc: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {k: sorted(set(acc.get(k, [])) | set(new.get(k, []))) for k in new}


def step(worker: Any, metadata: Any) -> str | None:
    """``start_load_kv`` as the model runner calls it; returns the exception that would have
    killed the worker thread, if any."""
    try:
        worker.start_load_kv(metadata)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def run_until(worker: Any, predicate, timeout: float = 20.0,
              acc: dict[str, Any] | None = None) -> tuple[dict, str | None]:
    """Pump empty scheduler steps (handshake futures complete in the background) until
    ``predicate(results)``; returns the merged results and the first exception that would have
    killed the worker (from ``start_load_kv`` or from the result collection), if any.  ``acc``:
    results the caller collected already, which the predicate sees (else it waits out the
    timeout for requests reported before the call)."""
    acc = dict(acc or {})
    deadline = time.monotonic() + timeout
    while True:
        crash = step(worker, worker_module_metadata_cls()())
        if crash is None:
            try:
                acc = merge(acc, finished(worker))
            except Exception as exc:
                crash = f"{type(exc).__name__}: {exc}"
        if crash or predicate(acc) or time.monotonic() > deadline:
            return acc, crash
        time.sleep(0.02)


# ---------------------------------------------------------------------------- scenarios


def _reads_by_req(worker: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in worker.nixl_wrapper.reads:
        req = (r["notif"] or "").rsplit(":", 1)[0]
        out.setdefault(req, []).append({"local_ids": r["local_ids"],
                                        "remote_ids": r["remote_ids"]})
    return out


def handshaken_decoder(*, hma: bool = False, extra: dict | None = None, d_blocks: int = 32,
                       p_blocks: int = 40, hybrid_manager: bool = False) -> Any:
    """A decode worker ("decode-engine") whose handshake with a prefill worker
    ("prefill-engine", agent P0) a first request completed (a warm-up read of block 0 in each
    group), so that a batch after it is read in one step, in order; ``extra``: the decode
    engine's ``kv_connector_extra_config``; the rest as :func:`build_worker`."""
    d = build_worker("decode-engine", num_blocks=d_blocks, hma=hma, extra=extra,
                     hybrid_manager=hybrid_manager)
    p = build_worker("prefill-engine", role="kv_producer", num_blocks=p_blocks, hma=hma,
                     hybrid_manager=hybrid_manager)
    errors = connect_by_handshake(d, {0: remote_metadata(p, "prefill-engine", "P0")}, 1)
    groups = len(d.kv_cache_config.kv_cache_groups)
    step(d, recv_metadata([{"req_id": "warmup", "local_ids": [[0]] * groups,
                            "remote_ids": [[0]] * groups, "engine": "prefill-engine"}]))
    _, warm = run_until(d, lambda a: "warmup" in a["done_recving"])
    assert warm is None and not errors, (warm, errors)
    return d


def scenario_read_assert(hma: bool = False, extra: dict | None = None) -> dict[str, Any]:
    """Bug 1: a producer that sent fewer blocks than the decode side allocated.

    ``bad`` has 3 local blocks but only 1 remote block (the prefix-trim assert), ``good`` is a
    normal request of the same batch, ``after`` arrives one step later.  Observes whether
    ``start_load_kv`` raised (on the model-runner thread: the worker dies), how each request is
    reported, the blocks marked invalid, and which READs were posted.  ``hma``: the same on a
    hybrid (full + sliding-window) KV-cache layout, two block-id groups per request;
    ``extra``: the decode engine's ``kv_connector_extra_config``.
    """
    d = handshaken_decoder(hma=hma, extra=extra)
    g = 2 if hma else 1
    batch = recv_metadata([
        {"req_id": "bad", "local_ids": [[1, 2, 3]] * g, "remote_ids": [[7]] * g,
         "engine": "prefill-engine"},
        {"req_id": "good", "local_ids": [[4, 5]] * g, "remote_ids": [[8, 9]] * g,
         "engine": "prefill-engine"},
    ])
    crash = step(d, batch)
    acc = finished(d)
    reported = lambda a: {"bad", "good"} <= set(a["done_recving"]) | set(a["failed_recving"])  # noqa: E731
    if crash is None:
        acc, crash = run_until(d, reported, acc=acc)
    after = None
    if crash is None:
        crash = step(d, recv_metadata([{"req_id": "after", "local_ids": [[10]] * g,
                                        "remote_ids": [[11]] * g, "engine": "prefill-engine"}]))
        after, crash2 = run_until(d, lambda a: "after" in a["done_recving"])
        crash = crash or crash2
    return {"crash": crash, "results": acc, "after": after, "reads": _reads_by_req(d),
            "failure_style": vllm_sites.recv_failure_style(version_of()),
            "hma": bool(d._is_hma_required), "worker_meta": worker_meta(d)}


def worker_meta_object(worker: Any) -> Any:
    """What the release's connector facade hands the scheduler with this step's output
    (``build_connector_worker_meta``, 0.22+, called by the model runner right after
    ``get_finished``), from the facade around ``worker`` as the model runner holds it."""
    facade = object.__new__(importlib.import_module(f"{vllm_sites.NIXL_PKG}.connector")
                            .NixlConnector)
    facade.connector_worker = worker
    return facade.build_connector_worker_meta()


def worker_meta(worker: Any) -> list[str] | None:
    """:func:`worker_meta_object` as the request ids of pdpatch's failed HMA receives (None:
    no meta, or a release before 0.22, which has no such hand-over)."""
    if version_of() < Version("0.22"):
        return None
    return failed_ids(worker_meta_object(worker))


def failed_ids(meta: Any) -> list[str] | None:
    """The request ids a worker meta names failed (pdpatch's ``FailedReceives``); None: no
    meta."""
    return None if meta is None else sorted(getattr(meta, "req_ids", ()))


def scenario_mla_notif() -> dict[str, Any]:
    """Bug 3: MLA with P TP 2 > D TP 1.  D reads once (from P rank 0, the cache is replicated)
    and must tell P rank 1 it may free the blocks, under P's request id (``p-req``), not D's
    own (``d-req``).  P rank 1 is a real producer worker holding ``p-req``'s blocks; the
    notification D sent is delivered to it and its ``get_finished`` decides whether it frees."""
    d = build_worker("decode-engine", kind="mla", num_blocks=32)
    prefill = [build_worker("prefill-engine", role="kv_producer", kind="mla", num_blocks=40,
                            tp_rank=r, tp_size=2) for r in range(2)]
    metas = {r: remote_metadata(prefill[r], "prefill-engine", f"P{r}") for r in range(2)}
    connect_by_handshake(d, metas, 2)
    p1 = prefill[1]
    crash = step(p1, send_metadata(["p-req"]))
    assert crash is None, crash
    crash = step(d, recv_metadata([{"req_id": "d-req", "remote_req_id": "p-req",
                                    "local_ids": [[1, 2]], "remote_ids": [[3, 4]],
                                    "engine": "prefill-engine"}], remote_tp_size=2))
    acc = finished(d)
    if crash is None:
        acc, crash = run_until(d, lambda a: "d-req" in a["done_recving"], acc=acc)
    sent = [list(x) for x in d.nixl_wrapper.notifs_sent]
    for agent, msg in sent:
        if agent == "P1":
            p1.nixl_wrapper.inbox.append(("decode-agent", msg.encode()))
    p1_done = finished(p1)
    return {"crash": crash, "use_mla": bool(d.use_mla), "d_results": acc,
            "reads": [{"remote": r["remote"], "notif": r["notif"]} for r in d.nixl_wrapper.reads],
            "notifs_sent": sent, "p1_done_sending": p1_done["done_sending"],
            "p1_still_holding": sorted(getattr(p1, "_reqs_to_send", {}))}


def scenario_division() -> dict[str, Any]:
    """Bug 2: a peer (``prefill-bad``) claims TP 3 for a model with 4 KV heads; the decode
    worker (TP 1) must read a third of each local block from each of its 3 ranks, and 16384 B
    per region block is not divisible by 3.  The peer's block lengths are whatever the
    release's own validation accepts (``L // 3`` up to 0.23, ``L * (4 // 3) // 4`` from 0.24).
    A second, well-formed peer (``prefill-ok``) shows the worker still serves afterwards."""
    import dataclasses

    heads, bad_tp = 4, 3
    d = build_worker("decode-engine", kv_heads=heads, num_blocks=32)
    p = build_worker("prefill-bad", role="kv_producer", kv_heads=heads, num_blocks=40)
    ok = build_worker("prefill-ok", role="kv_producer", kv_heads=heads, num_blocks=40)
    # The length the release divides (the K half where K|V share a block, 0.23-0.25).
    length = int(d.block_len_per_layer[0])
    if version_of() < Version("0.29") and hasattr(d, "get_backend_aware_kv_block_len"):
        length = int(d.get_backend_aware_kv_block_len(0, True, False))
    full = int(d.block_len_per_layer[0])
    if version_of() < Version("0.24"):
        remote_len = full // bad_tp
    else:
        remote_len = full * max(1, heads // bad_tp) // heads
    base = own_metadata(p)
    bad = {r: dataclasses.replace(base, engine_id="prefill-bad", agent_metadata=f"BAD{r}".encode(),
                                  block_lens=[remote_len] * len(base.block_lens))
           for r in range(bad_tp)}
    good = {0: remote_metadata(ok, "prefill-ok", "OK0")}
    errors = connect_by_handshake(d, {}, 1, peers={"prefill-bad": (bad, bad_tp),
                                                  "prefill-ok": (good, 1)})
    before = set(d.nixl_wrapper.dlists)
    crash = step(d, recv_metadata([{"req_id": "r-bad", "local_ids": [[1, 2]],
                                    "remote_ids": [[3, 4]], "engine": "prefill-bad",
                                    "port": PORT + 1, "tp_size": bad_tp}]))
    reported = lambda a: "r-bad" in set(a["done_recving"]) | set(a["failed_recving"])  # noqa: E731
    acc, crash2 = run_until(d, reported)
    crash = crash or crash2
    new = {h: v for h, v in d.nixl_wrapper.dlists.items() if h not in before}
    local_chunks = sorted({n for agent, descs in new.values() if agent == "NIXL_INIT_AGENT"
                           for _, n in descs})
    remote_reads = sorted({n for agent, descs in new.values() if agent.startswith("BAD")
                           for _, n in descs})
    after = None
    if crash is None:
        crash = step(d, recv_metadata([{"req_id": "r-ok", "local_ids": [[5]],
                                        "remote_ids": [[6]], "engine": "prefill-ok",
                                        "port": PORT + 2, "tp_size": 1}]))
        after, crash2 = run_until(d, lambda a: "r-ok" in a["done_recving"])
        crash = crash or crash2
    reads = _reads_by_req(d)
    return {"crash": crash, "block_len": length, "peer_block_len": remote_len,
            "peer_unit": remote_len // 2 if length != full else remote_len,
            "handshake_errors": errors, "results": acc, "after": after,
            "local_split_lens": local_chunks, "remote_read_lens": remote_reads,
            "reads_bad": len(reads.get("r-bad", [])), "reads_ok": len(reads.get("r-ok", []))}


def scenario_spec_types(spec_type_name: str = "MambaSpec") -> dict[str, Any]:
    """Bug 4 (the ``next()`` without default): a decode worker whose KV-cache groups hold no
    attention group, as a pure-SSM model would.  The group classification is seeded on a real
    registered worker (``_group_spec_types``, the tuple vLLM derives from the KV-cache config
    in ``__init__``), the way vLLM's FakeNixlConnectorWorker seeds registration state; the
    handshake, plan and descriptor builders that then run are the release's own."""
    import vllm.v1.kv_cache_interface as kvi

    d = build_worker("decode-engine", num_blocks=32)
    p = build_worker("prefill-engine", role="kv_producer", num_blocks=40)
    d._group_spec_types = (getattr(kvi, spec_type_name),)
    errors = connect_by_handshake(d, {0: remote_metadata(p, "prefill-engine", "P0")}, 1)
    crash = step(d, recv_metadata([{"req_id": "r1", "local_ids": [[1]], "remote_ids": [[2]],
                                    "engine": "prefill-engine"}]))
    acc, crash2 = run_until(
        d, lambda a: "r1" in set(a["done_recving"]) | set(a["failed_recving"]))
    return {"crash": crash or crash2, "handshake_errors": errors, "results": acc}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


#: Every release's handshake waits ``RCVTIMEO`` = 5,000 ms (a literal in its code) for the peer's
#: reply.  To a closed port that wait is the whole failure, so the closed-port scenarios let it
#: last this long: the release's code takes the same path (``zmq.Again`` out of ``recv``),
#: sooner.  Four such scenarios, stock and patched, had waited 40-45 s of each release's report.
CLOSED_PORT_RCVTIMEO_MS = 250


@contextlib.contextmanager
def closed_port_timeout() -> Iterator[None]:
    """The release's 5-second handshake reply timeout shortened to
    :data:`CLOSED_PORT_RCVTIMEO_MS`; other socket options are set as the release sets them."""
    import zmq

    real = zmq.Socket.setsockopt

    def setsockopt(self: Any, option: int, optval: Any, *args: Any) -> Any:
        if option == zmq.RCVTIMEO and optval == 5000:
            optval = CLOSED_PORT_RCVTIMEO_MS
        return real(self, option, optval, *args)

    with patch.object(zmq.Socket, "setsockopt", setsockopt):
        yield


def next_request_served(d: Any, groups: int) -> tuple[dict[str, Any], str | None]:
    """A healthy request (``r-ok``, a live peer) after a failing one: what the worker reports
    for it, and the crash, if any (the worker must go on serving)."""
    crash = step(d, recv_metadata([{"req_id": "r-ok", "local_ids": [[5]] * groups,
                                    "remote_ids": [[6]] * groups, "engine": "prefill-ok",
                                    "port": PORT + 2}]))
    after, crash2 = run_until(d, lambda a: "r-ok" in a["done_recving"])
    return after, crash or crash2


@closed_port_timeout()
def scenario_dead_peer(hma: bool = False, queued: tuple[str, ...] = ("r-dead",)
                       ) -> dict[str, Any]:
    """A prefill engine that is gone before the decode side handshakes with it: the release's
    real ZMQ handshake to a closed port times out (its 5 s shortened:
    :func:`closed_port_timeout`).  ``r-dead`` must fail alone; a request
    to a live peer (``prefill-ok``) afterwards must be served.  ``hma``: the same on a hybrid
    (full + sliding-window) layout with the hybrid KV-cache manager on (vllm#52234: before
    0.30 the release reports the failed request as finished receiving with no failure signal,
    and the scheduler decodes from the KV that never arrived).  ``queued``: the requests
    queued for the dead engine in that step (blocks 1-2, 9-10, ...); the ``pdpatch`` warnings
    logged meanwhile are returned."""
    d = build_worker("decode-engine", num_blocks=32, hma=hma, hybrid_manager=hma)
    ok = build_worker("prefill-ok", role="kv_producer", num_blocks=40, hma=hma,
                      hybrid_manager=hma)
    g = 2 if hma else 1
    errors = connect_by_handshake(d, {0: remote_metadata(ok, "prefill-ok", "OK0")}, 1)
    port = free_port()
    dead = [{"req_id": req_id, "local_ids": [[1 + 8 * i, 2 + 8 * i]] * g,
             "remote_ids": [[3 + 8 * i, 4 + 8 * i]] * g, "engine": "prefill-dead",
             "port": port} for i, req_id in enumerate(queued)]
    with pdpatch_warnings() as warnings:
        crash = step(d, recv_metadata(dead))
        acc, crash2 = run_until(
            d, lambda a: set(queued) <= set(a["done_recving"]) | set(a["failed_recving"]),
            timeout=60)
    crash = crash or crash2
    after = None
    if crash is None:
        after, crash = next_request_served(d, g)
    return {"crash": crash, "handshake_errors": errors, "results": acc, "after": after,
            "reads": _reads_by_req(d), "hma": bool(d._is_hma_required), "warnings": warnings}


def scenario_dead_peer_hma() -> dict[str, Any]:
    return scenario_dead_peer(hma=True)


def scenario_dead_peer_queued() -> dict[str, Any]:
    """Three requests queued for one dead prefill engine in one step."""
    return scenario_dead_peer(queued=("r-dead", "r-dead-2", "r-dead-3"))


def notify_only_recv(req_id: str, engine: str, port: int, hma: bool) -> tuple[Any, bool]:
    """The receive a full local prefix hit puts in the step's connector metadata, built by the
    release's real scheduler half: ``get_num_new_matched_tokens`` with the whole prompt
    already computed locally (whether the scheduler parks the request in
    ``WAITING_FOR_REMOTE_KVS`` is its second value), then ``update_state_after_alloc`` with
    ``num_external_tokens=0`` and ``build_connector_meta``.  The receive carries no local
    blocks (the worker only owes P the notification that frees P's blocks), and from 0.30
    ``awaiting_kvs=False``.  Returns the metadata and whether the request was parked."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    half = scheduler_half("kv_consumer", hma=hma)
    prompt = list(range(100, 100 + 2 * BLOCK_SIZE))
    request = Request(request_id=req_id, prompt_token_ids=prompt,
                      sampling_params=SamplingParams(max_tokens=4), pooling_params=None)
    request.kv_transfer_params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
        "remote_engine_id": engine, "remote_request_id": f"p-{req_id}",
        "remote_host": HOST, "remote_port": port, "tp_size": 1}
    _, parked = half.get_num_new_matched_tokens(request, len(prompt))
    cached = []
    for group in range(2 if hma else 1):
        # hashed: cached blocks, hashed as each release's block pool hashes them
        cached.append([prefix_cache_block(1 + 2 * group + i, f"cached-{group}-{i}".encode())
                       for i in range(2)])
    half.update_state_after_alloc(request, KVCacheBlocks(blocks=tuple(cached)), 0)
    return half.build_connector_meta(SchedulerOutput.make_empty()), bool(parked)


def scheduler_takes_report(req_id: str, reported: list[str]) -> str | None:
    """What the release's real ``Scheduler._update_from_kv_xfer_finished`` does with a worker
    that lists ``reported`` as finished receiving while ``req_id`` is a running request it
    never parked: the exception that would kill the engine core, or None."""
    import block_keys_scenarios as bks
    from vllm.v1.outputs import KVConnectorOutput

    if not reported:
        return None
    sched = bks.scheduler(bks.BASE, "kv_consumer")
    with patch.dict(os.environ):        # the request's hasher sets PYTHONHASHSEED
        sched.add_request(bks.request(bks.BASE, sched, req_id, None, max_tokens=4))
    sched.schedule()
    try:
        sched._update_from_kv_xfer_finished(KVConnectorOutput(finished_recving=set(reported)))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@closed_port_timeout()
def scenario_full_hit_dead_peer(hma: bool = False) -> dict[str, Any]:
    """A prompt D holds entirely in its prefix cache, whose prefill engine is gone: the
    notify-only receive (:func:`notify_only_recv`) sends the release's real ZMQ handshake to
    a closed port, which times out (5 s, shortened: :func:`closed_port_timeout`).  The
    request is running on D and never waits for
    this receive, so the worker must survive and must not list the request as finished or
    failed receiving (the scheduler asserts the request is parked or finished:
    :func:`scheduler_takes_report`); a request to a live peer afterwards must be served.
    Observed over a bounded number of steps after the handshake failed."""
    import logging

    d = build_worker("decode-engine", num_blocks=32, hma=hma, hybrid_manager=hma)
    ok = build_worker("prefill-ok", role="kv_producer", num_blocks=40, hma=hma,
                      hybrid_manager=hma)
    g = 2 if hma else 1
    errors = connect_by_handshake(d, {0: remote_metadata(ok, "prefill-ok", "OK0")}, 1)
    meta, parked = notify_only_recv("r-hit", "prefill-dead", free_port(), hma)
    entry = meta.reqs_to_recv["r-hit"]
    callback_errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    # the log call's template and the exception's type (the message names the future's id)
    handler.emit = lambda r: callback_errors.append(  # type: ignore[method-assign]
        f"{r.msg}: {r.exc_info[0].__name__ if r.exc_info else None}")
    futures_log = logging.getLogger("concurrent.futures")
    futures_log.addHandler(handler)
    try:
        crash = step(d, meta)
        acc: dict[str, Any] = {}
        if crash is None:
            acc, crash = run_until(d, lambda a: bool(errors), timeout=60)
        if crash is None:               # the failure's bookkeeping runs in the next steps
            more, crash = run_until(d, lambda a: False, timeout=1.0)
            acc = merge(acc, more)
    finally:
        futures_log.removeHandler(handler)
    reported = sorted({"r-hit"} & (set(acc.get("done_recving", ()))
                                   | set(acc.get("failed_recving", ()))))
    after = None
    if crash is None:
        after, crash = next_request_served(d, g)
    return {"crash": crash, "handshake_errors": errors, "parked": parked,
            "local_block_ids": [list(x) for x in entry.local_block_ids],
            "awaiting_kvs": getattr(entry, "awaiting_kvs", None), "results": acc,
            "reported": reported, "scheduler": scheduler_takes_report("r-hit", reported),
            "callback_errors": callback_errors,
            "metadata_left": "r-hit" in d._recving_metadata, "after": after,
            "hma": bool(d._is_hma_required)}


def scenario_full_hit_dead_peer_hma() -> dict[str, Any]:
    return scenario_full_hit_dead_peer(hma=True)


def scenario_read_assert_hma() -> dict[str, Any]:
    return scenario_read_assert(hma=True)


def scenario_hma_fail_in_flight() -> dict[str, Any]:
    """``hma_failed_recv``'s channel taking a request whose READs are already posted (another
    patch fails it mid-read): it must wait for them, then name the request failed."""
    from pdpatch.patches.hma_failed_recv import wrappers as channel

    d = handshaken_decoder(hma=True)
    crash = step(d, recv_metadata([{"req_id": "r", "local_ids": [[1, 2]] * 2,
                                    "remote_ids": [[3, 4]] * 2, "engine": "prefill-engine"}]))
    in_flight = bool(d._recving_transfers.get("r"))
    taken = channel.fail_alone(d, "r")
    acc, crash2 = run_until(d, lambda a: "r" in a["done_recving"])
    return {"in_flight": in_flight, "taken": taken, "crash": crash or crash2,
            "done": acc["done_recving"], "invalid_blocks": acc["invalid_blocks"],
            "reads": sorted(_reads_by_req(d)), "worker_meta": worker_meta(d)}


def scenario_read_assert_hma_no_channel() -> dict[str, Any]:
    """The HMA read failure with ``hma_failed_recv`` switched off for this engine."""
    return scenario_read_assert(hma=True, extra={"pdpatch": {"hma_failed_recv": False}})


def scenario_transport() -> dict[str, Any]:
    """``transport_check`` on the release's real ``register_kv_caches``: a decode worker whose
    KV lives on the GPU (the worker's ``kv_buffer_device``, what the check reads; the CPU
    registration path is unchanged) under ``UCX_TLS=tcp``, which keeps same-node KV off
    cuda_ipc.  Returns the ``pdpatch`` warnings that registration logged."""
    import os

    from pdpatch import installer

    saved = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"
    installer.reset_state()          # the check runs once per process: let it run again
    try:
        with pdpatch_warnings() as records:
            build_worker("engine-t",
                         before_register=lambda w: setattr(w, "kv_buffer_device", "cuda"))
    finally:
        if saved is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = saved
    return {"warnings": records}


def scheduler_connector(role: str = "kv_producer", extra: dict | None = None,
                        name: str = "NixlConnector", hma: bool = False) -> Any:
    """The release's real connector facade ``name`` (``NixlPushConnector``: the push mode of
    0.24+) with the scheduler role, as ``EngineCore``'s scheduler builds it (the scheduler
    calls the facade; it forwards to its half); ``hma``: the hybrid layout of
    :func:`kv_cache_config`, with the hybrid KV-cache manager explicitly on."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    facade = getattr(importlib.import_module(
        vllm_sites.lookup(vllm_sites.REQUEST_FINISHED, version_of()).module), name)
    cfg = vllm_config("llama", 2, role, 1, extra, hybrid_manager=hma)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    kvc = kv_cache_config(32, layers, attention_spec("llama", 2), hma)
    with set_current_vllm_config(cfg):
        return facade(cfg, KVConnectorRole.SCHEDULER, kvc)


def scheduler_half(role: str = "kv_producer", extra: dict | None = None,
                   hma: bool = False) -> Any:
    """The release's real scheduler half, built through its connector facade."""
    return scheduler_connector(role, extra, hma=hma).connector_scheduler


def prefix_cache_block(block_id: int, key: bytes | None = None) -> Any:
    """A block D found in its own prefix cache: hashed, as the release's block pool hands it
    (``key``: its hash; by default one naming the block)."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    block = KVCacheBlock(block_id)
    key = key if key is not None else f"prefix-block-{block_id}".encode()
    if hasattr(block, "set_block_hash"):        # 0.32+
        block.set_block_hash(key)
    else:
        block.block_hash = key
    return block


def admit_remote_prefill(sched: Any, req_id: str, hits: list[int], reads: list[int],
                         remote_ids: list[int], engine: str = "prefill-engine",
                         tokens: tuple[Any, int] | None = None,
                         extra: dict[str, Any] | None = None) -> None:
    """What ``Scheduler.schedule`` hands D's scheduler half for a remote-prefill request: its
    blocks (``hits`` from the prefix cache, then the fresh ``reads`` it pulls into) and the
    number of tokens to load; P listed ``remote_ids``.  ``tokens``: (P's computed tokens, sent
    as ``remote_num_tokens`` as P sends it from 0.21 on; D's prompt length); by default D's
    prompt fills its blocks but one token and P's count is not sent.  ``extra``: more params."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import Request

    n_tokens = (len(hits) + len(reads)) * BLOCK_SIZE - 1 if tokens is None else tokens[1]
    request = Request(request_id=req_id, prompt_token_ids=list(range(n_tokens)),
                      sampling_params=SamplingParams(max_tokens=8), pooling_params=None)
    request.kv_transfer_params = {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [remote_ids],
        "remote_engine_id": engine, "remote_request_id": req_id, "remote_host": HOST,
        "remote_port": PORT, "tp_size": 1}
    if tokens is not None:
        request.kv_transfer_params["remote_num_tokens"] = tokens[0]
    request.kv_transfer_params.update(extra or {})
    blocks = KVCacheBlocks(([prefix_cache_block(b) for b in hits] +
                            [KVCacheBlock(b) for b in reads],))
    sched.update_state_after_alloc(request, blocks, n_tokens - len(hits) * BLOCK_SIZE)


# Remote-prefill requests as (D's prefix-cache hits, D's blocks to read into, P's list).
BLOCK_ID_CASES = {
    # issue 25: 22 ids for a 2-block prompt
    "more": ([], [1, 2], list(range(10, 32))),
    "more_hit": ([20, 21], [3, 4], [10, 11, 12, 13, 14]),
    # vllm#50558: D's prompt has P's first token appended and P's prompt ends on a block
    # boundary: D allocates one block more than P lists
    "appended_hit": ([22, 23], [5, 6], [15, 16, 17]),
    "exact": ([], [7, 8], [18, 19]),
    "exact_hit": ([24, 25], [9, 10], [20, 21, 22, 23]),
}


# The same with P's blocks half the size of D's (vLLM's `block_size_ratio` 2; P's list at P's
# block size).
RATIO_CASES = {
    "ratio_full": ([], [1, 2], [10, 11, 12, 13]),
    # D's last block only half read: a prompt of 17-24 tokens
    "ratio_partial": ([], [3, 4], [14, 15, 16]),
    "ratio_hit": ([20], [5], [17, 18, 19, 20]),
    # more ids than D's 2 blocks can hold
    "ratio_more": ([], [6, 7], list(range(21, 39))),
    # vllm#50558: P prefilled 32 tokens (4 blocks of 8, ending on D's block boundary); D's
    # prompt has P's first token appended (33 tokens): D allocates 3 blocks of 16
    "ratio_appended": ([], [8, 9, 10], [25, 26, 27, 28]),
    "ratio_appended_hit": ([21], [12, 13], [29, 30, 31, 32]),
    # a correct list with a local hit, P's last block ending inside D's first half of a block:
    # 20 tokens, 3 of P's blocks, D holds 1 and reads 1
    "ratio_hit_partial": ([22], [14], [33, 34, 35]),
}
# Per case: P's computed tokens (its `remote_num_tokens`, which 0.34 pairs blocks of different
# sizes from and declines such a read without) and D's prompt length.
RATIO_TOKENS = {
    "ratio_full": (31, 31), "ratio_partial": (20, 20), "ratio_hit": (31, 31),
    "ratio_more": (31, 31), "ratio_appended": (32, 33), "ratio_appended_hit": (32, 33),
    "ratio_hit_partial": (20, 20),
}


def _block_id_run(cases: dict[str, tuple[list[int], list[int], list[int]]],
                  p_block_size: int,
                  tokens: dict[str, tuple[Any, int]] | None = None,
                  extra: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    d_blocks, p_blocks = 32, 40
    ratio = BLOCK_SIZE // p_block_size
    d = build_worker("decode-engine", num_blocks=d_blocks)
    p = build_worker("prefill-engine", role="kv_producer", num_blocks=p_blocks,
                     block_size=p_block_size)
    sched = scheduler_half(role="kv_consumer")
    connect_by_handshake(d, {0: remote_metadata(p, "prefill-engine", "P0")}, 1)
    # one of P's blocks, read into one of D's (P's token count where the cases send theirs)
    one_block = None if tokens is None else (p_block_size, p_block_size)
    admit_remote_prefill(sched, "warmup", [], [0], [0], tokens=one_block)
    crash = step(d, sched.build_connector_meta(None))
    _, crash2 = run_until(d, lambda a: "warmup" in a["done_recving"])
    assert crash is None and crash2 is None, (crash, crash2)
    for req_id, (hits, reads, remote_ids) in cases.items():
        admit_remote_prefill(sched, req_id, hits, reads, remote_ids,
                             tokens=(tokens or {}).get(req_id), extra=(extra or {}).get(req_id))
    crash = step(d, sched.build_connector_meta(None))
    acc: dict[str, Any] = finished(d)
    if crash is None:
        acc, crash = run_until(d, lambda a: set(cases) <= set(a["done_recving"]) |
                               set(a["failed_recving"]), acc=acc)
    after = None
    if crash is None:
        admit_remote_prefill(sched, "after", [], [11], [24], tokens=one_block)
        crash = step(d, sched.build_connector_meta(None))
        after, crash2 = run_until(d, lambda a: "after" in a["done_recving"])
        crash = crash or crash2
    # Local descriptors address D's blocks in `ratio` sub-blocks each.
    paired = {req: [{"local": sorted({i % (d_blocks * ratio) for i in r["local_ids"]}),
                     "remote": sorted({i % p_blocks for i in r["remote_ids"]})} for r in reads]
              for req, reads in _reads_by_req(d).items()}
    # Which of P's blocks each of D's (sub-)blocks receives: descriptor i of a READ's local
    # list is read from descriptor i of its remote list.
    pairs = {req: [list(pair) for pair in sorted(
                 {(lo % (d_blocks * ratio), re % p_blocks) for r in reads
                  for lo, re in zip(r["local_ids"], r["remote_ids"], strict=True)})]
             for req, reads in _reads_by_req(d).items()}
    return {"crash": crash, "results": acc, "after": after, "paired": paired, "pairs": pairs,
            "descriptors": _reads_by_req(d),
            "failure_style": vllm_sites.recv_failure_style(version_of())}


def scenario_block_ids() -> dict[str, Any]:
    """Issue 25 case 2 and vllm#50558: remote block lists longer or shorter than D's allocation
    (its prefix-cache hits plus the blocks it reads into), next to correct ones, in one batch
    built by D's real scheduler half (``update_state_after_alloc``, ``build_connector_meta``)
    and read by its real worker; then one more request.  Observes each request's outcome and
    the blocks each READ pairs (descriptor ids reduced to block ids: every region of a block
    list is ``region * num_blocks + block``)."""
    return _block_id_run(BLOCK_ID_CASES, BLOCK_SIZE)


def scenario_block_ids_ratio() -> dict[str, Any]:
    """:func:`scenario_block_ids` with P's blocks half D's size (:data:`RATIO_CASES`)."""
    return _block_id_run(RATIO_CASES, BLOCK_SIZE // 2, RATIO_TOKENS)


LISTENER_WAIT_S = 3.0  # a listener that cannot bind dies within milliseconds


def start_side_channel(port: int, extra: dict | None = None) -> dict[str, Any]:
    """``set_xfer_handshake_metadata`` of a fresh scheduler half whose side channel is
    ``port``, in a thread: did it return, raise, or still wait after ``LISTENER_WAIT_S``, and
    is the listener thread alive?  A caller still waiting on a dead listener waits forever
    (nothing else sets its ``ready_event``)."""
    with patch.dict(os.environ, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                                 "VLLM_NIXL_SIDE_CHANNEL_HOST": HOST}):
        half = scheduler_half(extra=extra)
    outcome: dict[str, Any] = {"port": half.side_channel_port}

    def call() -> None:
        try:
            half.set_xfer_handshake_metadata({})
            outcome["returned"] = True
        except Exception as exc:
            outcome["raised"] = f"{type(exc).__name__}: {exc}"

    t0 = time.monotonic()
    caller = threading.Thread(target=call, daemon=True, name="side-channel-starter")
    caller.start()
    caller.join(LISTENER_WAIT_S)
    outcome["seconds"] = round(time.monotonic() - t0, 2)
    outcome["waiting"] = caller.is_alive()
    listener = half._nixl_handshake_listener_t
    if listener is not None:
        listener.join(1.0)                  # a dying listener may still be unwinding
    outcome["listener_alive"] = bool(listener is not None and listener.is_alive())
    half._stop_event.set()
    if listener is not None:
        listener.join(5.0)
    return outcome


def scenario_side_channel_taken(extra: dict | None = None) -> dict[str, Any]:
    """The scheduler half's NIXL side channel on a port another socket listens on, then on a
    free port (the control)."""
    import socket

    with socket.socket() as blocker:
        blocker.bind((HOST, 0))
        blocker.listen()
        taken = start_side_channel(blocker.getsockname()[1], extra)
    return {"taken": taken, "free": start_side_channel(free_port(), extra)}


# ------------------------------------------ requests the scheduler never allocated (issue 25)


def engine_request(req_id: str, params: dict[str, Any], num_tokens: int = 100) -> Any:
    """A real ``vllm.v1.request.Request`` carrying ``params`` as the API server sends them
    (``SamplingParams.extra_args["kv_transfer_params"]``, read back by the request)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(request_id=req_id, prompt_token_ids=list(range(1, num_tokens + 1)),
                   sampling_params=sp, pooling_params=None)


@contextlib.contextmanager
def pdpatch_warnings() -> Iterator[list[str]]:
    """The ``pdpatch`` logger's warnings while the block runs."""
    import logging

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("pdpatch")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


REJECTED_GOOD = {"do_remote_prefill": True, "do_remote_decode": False,
                 "remote_block_ids": [[3, 4]], "remote_engine_id": "prefill-engine",
                 "remote_host": HOST, "remote_port": PORT, "tp_size": 1}
# (name, changes to REJECTED_GOOD; None drops the key), in the order they reach one engine.
REJECTED_CASES = (
    ("engine-id-list", {"remote_engine_id": ["prefill-engine"]}),
    ("no-engine-id", {"remote_engine_id": None}),
    ("no-block-ids", {"remote_block_ids": None}),
    ("empty-block-ids", {"remote_block_ids": []}),
    ("good", {}),
)


def _abort_unscheduled(connector: Any, request: Any) -> None:
    """What ``EngineCore.add_request`` does with an ``abort_immediately`` request (0.21+,
    and any request aborted before its first allocation): ``Scheduler.add_request`` (which
    calls ``on_new_request``, 0.22+), then ``finish_requests(FINISHED_ABORTED)`` -> the
    connector's ``request_finished_all_groups`` with no blocks (NIXL supports HMA)."""
    from vllm.v1.request import RequestStatus

    if hasattr(connector, "on_new_request"):
        connector.on_new_request(request)
    request.status = RequestStatus.FINISHED_ABORTED
    connector.request_finished_all_groups(request, ([],))


def scenario_rejected(extra: dict | None = None) -> dict[str, Any]:
    """Issue 25, case 1: decode requests that were rejected before the scheduler allocated
    them reach the connector as aborts carrying their ``kv_transfer_params``, one after the
    other on one engine: the release's scheduler facade (``on_new_request``,
    ``request_finished_all_groups``, ``build_connector_meta``) and then its decode worker
    (``start_load_kv`` with the metadata built), whose notification to P frees P's blocks.
    Per request: the exception that would kill EngineCore (scheduler step) or the worker, the
    receives queued, the notifications sent, the receives the worker reported finished and
    pdpatch's warnings.  After a scheduler exception the release's queue is not cleared: the
    requests that follow fail the same way, as every request after it does on a real engine
    whose EngineCore died."""
    d = build_worker("decode-engine", num_blocks=32, extra=extra)
    p = build_worker("prefill-engine", role="kv_producer", num_blocks=40)
    connect_by_handshake(d, {0: remote_metadata(p, "prefill-engine", "P0")}, 1)
    connector = scheduler_connector("kv_consumer", extra)
    out: dict[str, Any] = {}
    for name, changes in REJECTED_CASES:
        params = {**REJECTED_GOOD, "remote_request_id": f"p-{name}", **changes}
        params = {k: v for k, v in params.items() if v is not None}
        request = engine_request(f"r-{name}", params)
        obs: dict[str, Any] = {"crash": None, "recv": [], "notifs": [], "reported": []}
        sent = len(d.nixl_wrapper.notifs_sent)
        with pdpatch_warnings() as warnings:
            try:
                _abort_unscheduled(connector, request)
                meta = connector.build_connector_meta(None)
            except Exception as exc:
                obs["crash"] = f"scheduler: {type(exc).__name__}: {exc}"
            else:
                obs["recv"] = sorted(meta.reqs_to_recv)
                crash = step(d, meta)
                if crash is None:
                    acc, crash = run_until(
                        d, lambda a, n=sent: len(d.nixl_wrapper.notifs_sent) > n, timeout=2.0)
                    # A finished receive of a request the scheduler no longer holds trips
                    # its `assert req_id in self.requests`.
                    obs["reported"] = acc["done_recving"] + acc["failed_recving"]
                obs["crash"] = crash and f"worker: {crash}"
        obs["notifs"] = [msg for _, msg in d.nixl_wrapper.notifs_sent[sent:]]
        obs["warnings"] = warnings
        out[name] = obs
    return out


def scenario_rejected_push() -> dict[str, Any]:
    """Case 1 in push mode (0.24+), on the release's real push scheduler facade: a rejected
    push request names P but no blocks (P picks them); the push scheduler seeds
    ``remote_block_ids`` itself before queueing the notification from 0.26 only.  Each case
    on a fresh engine: the scheduler step's exception, the receives queued, the warnings."""
    out: dict[str, Any] = {}
    for name, changes in (("push-form", {"remote_block_ids": None}),
                          ("no-engine-id", {"remote_block_ids": None,
                                            "remote_engine_id": None})):
        connector = scheduler_connector("kv_consumer", name="NixlPushConnector")
        params = {**REJECTED_GOOD, "remote_request_id": f"p-{name}", **changes}
        request = engine_request(f"r-{name}", {k: v for k, v in params.items()
                                               if v is not None})
        obs: dict[str, Any] = {"crash": None, "recv": []}
        with pdpatch_warnings() as warnings:
            try:
                _abort_unscheduled(connector, request)
                obs["recv"] = sorted(connector.build_connector_meta(None).reqs_to_recv)
            except Exception as exc:
                obs["crash"] = f"scheduler: {type(exc).__name__}: {exc}"
        obs["warnings"] = warnings
        out[name] = obs
    return out


READBACK_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                   "remote_block_ids": [list(range(1, 8))], "remote_engine_id": "decode-peer",
                   "remote_request_id": "turn-1", "remote_host": HOST, "remote_port": PORT,
                   "remote_num_tokens": 100, "tp_size": 1}


def scenario_readback(extra: dict | None = None) -> dict[str, Any]:
    """Issue 25, case 3: a 100-token request asking to read back 100 tokens another engine
    cached (``do_remote_decode`` with the remote fields), on the release's real scheduler
    half: what ``get_num_new_matched_tokens`` promises, and whether the allocation that
    follows (``update_state_after_alloc`` with the blocks the scheduler would hand over)
    queues the receive that alone can end the wait.  ``extra``: the connector's settings
    (``bidirectional_kv_xfer``)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    half = scheduler_half("kv_consumer", extra)
    request = engine_request("r-readback", dict(READBACK_PARAMS))
    with pdpatch_warnings() as warnings:
        count, load_async = half.get_num_new_matched_tokens(request, 0)
        if load_async:
            blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(1, 8)],))
            half.update_state_after_alloc(request, blocks, count)
    return {"promised": [count, load_async], "queued": sorted(half._reqs_need_recv),
            "warnings": warnings}


def finished_prefill(connector: Any, req_id: str) -> dict[str, Any]:
    """P's scheduler half finishing a prefill for D (the proxy's ``do_remote_decode``), through
    the release's connector facade as its scheduler calls it: the params P answers with."""
    from vllm.v1.request import RequestStatus

    request = engine_request(req_id, {"do_remote_decode": True, "do_remote_prefill": False},
                             num_tokens=2 * BLOCK_SIZE)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    request.num_computed_tokens = 2 * BLOCK_SIZE
    _, params = connector.request_finished(request, [3, 4])
    return params


# P's leases for the lease scenario: (P request id, seconds its lease has left when D reads it,
# plus the release's safety margin where marked "+margin"; a heartbeat sent for it first), read
# in this order.
LEASE_CASES = (
    ("p-expired", -1.0, False),           # ran out a second ago, no heartbeat: P may reuse
    ("p-in-margin", "margin-1", False),   # inside the margin the release keeps for readbacks
    ("p-late-heartbeat", -1.0, True),     # the only heartbeat went out after it ran out
    ("p-heartbeat", "margin+0.5", True),  # a heartbeat in time; read 0.6 s later, in the margin
    ("p-no-lease", None, False),          # a P without pdpatch: no expiry in its params
    ("p-fresh", 60.0, False),             # read well before it runs out
)


def _lease_left(spec: float | str, margin: float) -> float:
    return margin + float(spec[len("margin"):]) if isinstance(spec, str) else spec


def scenario_lease() -> dict[str, Any]:
    """A decode worker READs blocks of prefill requests whose leases on P (0.26+:
    ``kv_lease_duration``, extended by D's heartbeats) have run out or not: the release's real
    scheduler half answers for P, its metadata carries the receives, its worker reads (the
    handshake scripted: both clocks are this process's, offset 0).  Per P request: whether the
    worker posted its READ, what it reported, and pdpatch's warnings."""
    from pdpatch import vllm_sites

    mod = importlib.import_module(f"{vllm_sites.NIXL_PKG}.metadata")
    p_facade = scheduler_connector("kv_producer")
    p_params = finished_prefill(p_facade, "p-prefilled")
    d = build_worker("decode-engine", num_blocks=32)
    p = build_worker("prefill-engine", role="kv_producer", num_blocks=40)
    connect_by_handshake(d, {0: remote_metadata(p, "prefill-engine", "P0")}, 1)
    # a first request meets P (the handshake measures its clock), as any before these would
    crash = step(d, recv_metadata([{"req_id": "d-first", "engine": "prefill-engine",
                                    "local_ids": [[20]], "remote_ids": [[20]]}]))
    acc, crash2 = run_until(d, lambda a: "d-first" in a["done_recving"])
    crash = crash or crash2
    margin = vllm_sites.expiry_margin()
    now = time.perf_counter()
    reqs = []
    for i, (rid, left, _) in enumerate(LEASE_CASES):
        params = {} if left is None else \
            {"pdpatch_kv_lease_expiry": now + _lease_left(left, margin)}
        reqs.append({"req_id": f"d-{rid}", "remote_req_id": rid, "engine": "prefill-engine",
                     "local_ids": [[1 + 2 * i, 2 + 2 * i]], "remote_ids": [[3 + 2 * i, 4 + 2 * i]],
                     "params": params})
    with pdpatch_warnings() as warnings:
        crash = crash or step(d, recv_metadata(reqs[:2]))
        heartbeat = worker_module_metadata_cls()()
        heartbeat.heartbeat_by_engine = {"prefill-engine": mod.HeartbeatInfo(
            req_ids={rid for rid, _, beat in LEASE_CASES if beat}, host=HOST, port=PORT,
            tp_size=1)}
        crash = crash or step(d, heartbeat)
        crash = crash or step(d, recv_metadata(reqs[2:3]))
        time.sleep(0.6)
        crash = crash or step(d, recv_metadata(reqs[3:]))
        names = {r["req_id"] for r in reqs}
        res, crash2 = run_until(
            d, lambda a: names <= set(a["done_recving"]) | set(a["failed_recving"]), acc=acc)
    reads = _reads_by_req(d)
    return {"crash": crash or crash2, "results": res, "warnings": warnings,
            "read": sorted(r["remote_req_id"] for r in reqs
                           if reads.get(r["remote_req_id"]) or reads.get(r["req_id"])),
            "heartbeats": [str(n) for _, n in d.nixl_wrapper.notifs_sent if "HB:" in str(n)],
            "p_params_expiry": p_params.get("pdpatch_kv_lease_expiry"),
            "p_lease": p_facade.connector_scheduler._reqs_need_send.get("p-prefilled")}


SCENARIOS = {
    "block_ids": scenario_block_ids,
    "block_ids_ratio": scenario_block_ids_ratio,
    "transport": scenario_transport,
    "side_channel": scenario_side_channel_taken,
    "read_assert_hma": scenario_read_assert_hma,
    "read_assert_hma_no_channel": scenario_read_assert_hma_no_channel,
    "hma_fail_in_flight": scenario_hma_fail_in_flight,
    "dead_peer": scenario_dead_peer,
    "dead_peer_hma": scenario_dead_peer_hma,
    "dead_peer_queued": scenario_dead_peer_queued,
    "full_hit_dead_peer": scenario_full_hit_dead_peer,
    "full_hit_dead_peer_hma": scenario_full_hit_dead_peer_hma,
    "read_assert": scenario_read_assert,
    "mla_notif": scenario_mla_notif,
    "division": scenario_division,
    "spec_types": scenario_spec_types,
    "rejected": scenario_rejected,
    "rejected_push": scenario_rejected_push,
    "readback": scenario_readback,
    "lease": scenario_lease,
    "readback_bidirectional": lambda: scenario_readback({"bidirectional_kv_xfer": True}),
}


def run_scenarios(scenarios: dict[str, Callable[[], Any]], names: list[str]) -> dict[str, Any]:
    """``names`` of ``scenarios``, each run; one that cannot run on this release is reported as
    ``{"error": ...}`` (the test shows it)."""
    import traceback

    out = {}
    for name in names:
        try:
            out[name] = scenarios[name]()
        except Exception:
            out[name] = {"error": traceback.format_exc()[-3000:]}
    return out


def stock_then_patched(scenarios: dict[str, Callable[[], Any]], names: list[str],
                       summary: bool = False) -> dict[str, Any]:
    """:func:`run_scenarios` on stock vLLM (``"stock"``), then pdpatch installed: the patches'
    states (``"status"``, with the installer's ``"summary"`` line first if asked) and the
    scenarios again (``"patched"``)."""
    from pdpatch import installer

    report: dict[str, Any] = {"stock": run_scenarios(scenarios, names)}
    installer.install()
    if summary:
        report["summary"] = installer.summary_line()
    report["status"] = {n: s["status"] for n, s in installer.status()["patches"].items()}
    report["patched"] = run_scenarios(scenarios, names)
    return report


def release_report(names: list[str]) -> dict[str, Any]:
    """Run ``names`` on stock vLLM, then again with pdpatch installed; a scenario that cannot
    run on this release is reported as ``{"error": ...}`` (the test shows it)."""
    import harmless_scenarios
    import metrics_scenarios

    from pdpatch import installer

    scenarios = {**SCENARIOS, **harmless_scenarios.SCENARIOS, **metrics_scenarios.SCENARIOS}
    report = stock_then_patched(scenarios, names, summary=True)
    # Every target of every active patch resolves in this release: import the target modules
    # (the scenarios import only the NIXL ones) and read the installer's verdict.
    for ps in installer.status()["patches"].values():
        for label in ps["targets"]:
            with contextlib.suppress(Exception):
                importlib.import_module(label.split(":")[0])
    report["targets"] = {n: {t: list(v) for t, v in s["targets"].items()}
                         for n, s in installer.status()["patches"].items()}
    return report
