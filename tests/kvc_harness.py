"""Real vLLM NIXL worker objects on CPU, for the kvcached-compatibility tests.

In the style of vLLM's own NIXL unit tests (``tests/v1/kv_connector/unit/test_nixl_connector.py``
and ``test_nixl_desc_geometry.py`` of the 0.33 and 0.34 sdists): the worker class, its
``register_kv_caches`` and the handshake metadata are vLLM's; only the NIXL agent is replaced, by
:class:`RecordingNixlWrapper`, which records what would be registered and which descriptor lists
would be prepared, and the distributed runtime is a single gloo-free rank (the TP rank/size
functions the worker module imported).  KV tensors are built the way kvcached builds them:
``as_strided`` views over a storage holding more blocks than planned.

Version-agnostic where it can be: the worker module, its ``NixlWrapper`` global and the worker
class are located through :mod:`pdpatch.vllm_sites`, so the same helper runs against the source
trees of older releases (see ``tests/kvc_matrix.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from unittest.mock import MagicMock, patch

import numpy as np
import torch

from pdpatch import vllm_sites

NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 64
BLOCK_SIZE = 32
DTYPE = torch.bfloat16


def ensure_cpu_platform() -> None:
    """Releases before 0.29 detect the CPU platform from their build string ("+cpu"), which the
    source trees lack; install that release's own ``CpuPlatform`` explicitly, before any module
    binds ``current_platform``."""
    import vllm.platforms as platforms

    try:
        detected = platforms.current_platform.device_type
    except Exception:
        detected = ""
    if not detected:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


def cpu_backend_class() -> type:
    """The attention backend whose KV shape the worker is built for: the release's real CPU
    attention backend, except on 0.23-0.25 where CPU attention's packed pages are not what the
    NIXL code of those releases addresses; there the release's FlashAttention backend class
    (blocks-first ``(N, 2, bs, H, D)``, importable without a GPU) is used."""
    from packaging.version import Version

    from pdpatch import versions

    release = versions.release_of(versions.vllm_version())
    if Version("0.23") <= release < Version("0.26"):
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend


def model_dir() -> Path:
    """A local HF config (no weights needed: the worker reads only the config)."""
    d = Path(tempfile.gettempdir()) / "pdpatch-kvc-model"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": 512,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# ---------------------------------------------------------------------------- fake NIXL


def expand_descs(descs: Any) -> list[tuple[int, int]]:
    """Per-descriptor (addr, len): Nx5 strided rows (0.33) expanded the way NIXL indexes them,
    Nx3 rows (0.26-0.32) and (addr, len, dev) tuples (<=0.25) as they are."""
    arr = np.asarray(descs, dtype=np.uint64)
    if arr.size == 0:
        return []
    if arr.ndim == 2 and arr.shape[1] == 5:
        out = []
        for addr, length, _dev, stride, count in arr.tolist():
            out += [(addr + i * stride, length) for i in range(int(count))]
        return out
    arr = arr.reshape(-1, arr.shape[-1])
    return [(int(r[0]), int(r[1])) for r in arr.tolist()]


class RecordingNixlWrapper:
    """Stand-in for ``nixl._api.nixl_agent`` in vLLM's FakeNixlWrapper style: records
    registrations and descriptor lists; every other call is a no-op that succeeds."""

    instances: ClassVar[list[RecordingNixlWrapper]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.registered: list[list[tuple[int, int, int, str]]] = []
        self.dlists: dict[int, tuple[str, list[tuple[int, int]]]] = {}
        self._next = 1
        type(self).instances.append(self)

    def _new_handle(self) -> int:
        handle = self._next
        self._next += 1
        return handle

    # registration
    def get_reg_descs(self, caches_data, mem_type=None):
        return [tuple(x) for x in caches_data]

    def register_memory(self, descs, backends=None):
        self.registered.append(list(descs))

    def deregister_memory(self, descs):
        pass

    def get_agent_metadata(self):
        return b"recording-agent"

    # descriptor lists
    def get_xfer_descs(self, blocks_data, mem_type=None):
        return blocks_data

    def prep_xfer_dlist(self, agent, descs, mem_type=None, *args, **kwargs):
        handle = self._new_handle()
        self.dlists[handle] = (agent, expand_descs(descs))
        return handle

    def add_remote_agent(self, metadata):
        return "remote-agent"

    def remove_remote_agent(self, agent):
        pass

    def make_prepped_xfer(self, *args, **kwargs):
        return self._new_handle()

    def transfer(self, handle, *args, **kwargs):
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def release_xfer_handle(self, handle):
        pass

    def release_dlist_handle(self, handle):
        pass

    def send_notif(self, agent, notif_msg=None):
        pass

    def get_new_notifs(self):
        return {}

    def get_xfer_telemetry(self, handle):
        return MagicMock(xferDuration=1.0, postDuration=1.0, totalBytes=1, descCount=1)

    def query_memory(self, *args, **kwargs):
        return []


# ------------------------------------------------------------------------- kvcached views


@dataclass
class Allocation:
    """kvcached-style KV tensors and the storages behind them."""

    views: dict[str, torch.Tensor]
    storages: list[torch.Tensor]
    num_blocks: int                     # blocks per layer the views hold
    block_bytes: int                    # bytes of one block of one layer (K+V)
    variant: str
    block_addr: dict[str, Any] = field(default_factory=dict)  # name -> fn(b) -> [(lo, hi)]


def kvcached_views(layer_names: list[str], num_blocks: int, variant: str,
                   layout: str = "HND") -> Allocation:
    """KV tensors laid out like kvcached's, as ``as_strided`` views over storages sized for
    ``num_blocks`` (plus a few spare bytes past the last block, as a VMM reservation rounded up
    to its page would have).

    Packed ``(N, H, bs, 2D)`` pages (vLLM >= 0.25 CPU attention, >= 0.26 every backend), like
    kvcached's ``_build_packed_kv_views``:

    * ``per-layer`` -- kvcached's non-contiguous layout: one storage per layer, blocks one page
      apart (``KVCACHED_CONTIGUOUS_LAYOUT=false``, the mode its NIXL patch requires);
    * ``layer-interleaved`` -- kvcached's contiguous layout: one storage for all layers, block
      ``b`` of layer ``l`` at ``(b * L + l) * page``.

    K/V-first ``(2, N, H, bs, D)`` tensors (CPU attention up to 0.22; FlashAttention's
    ``(2, N, bs, H, D)`` is the same geometry), like kvcached's FlashAttention-style views:

    * ``split-half`` -- per layer, all K blocks in one half of the storage and all V blocks in
      the other: ``stride[0] = v_offset`` (the virtual K region's size), ``stride[1] = hidden``.

    Blocks-first ``(N, 2, bs, H, D)`` tensors (FlashAttention/FlashInfer 0.23-0.25):

    * ``kv-interleaved`` -- ``[K|V]`` per block, ``stride[0] = 2 * hidden`` (kvcached's
      unified pool).  kvcached's split-half form of this shape needs a descriptor conversion
      (issue 6), not a block count.
    """
    heads = NUM_KV_HEADS
    isz = torch.empty((), dtype=DTYPE).element_size()
    L = len(layer_names)
    views, storages, addr = {}, [], {}

    def fresh(n: int) -> torch.Tensor:
        return torch.randn(n, dtype=torch.float32).to(DTYPE)

    if variant in ("per-layer", "layer-interleaved"):
        width = 2 * HEAD_DIM
        page = heads * BLOCK_SIZE * width
        inner = (BLOCK_SIZE * width, width, 1) if layout == "HND" else (width, heads * width, 1)
        shape = (num_blocks, heads, BLOCK_SIZE, width)
        if variant == "per-layer":
            for name in layer_names:
                raw = fresh(num_blocks * page + 64)
                storages.append(raw)
                views[name] = torch.as_strided(raw, shape, (page, *inner), 0)
                base = raw.data_ptr()
                addr[name] = (lambda b, base=base: [(base + b * page * isz,
                                                     base + (b + 1) * page * isz)])
        else:
            raw = fresh(num_blocks * L * page + 64)
            storages.append(raw)
            base = raw.data_ptr()
            for i, name in enumerate(layer_names):
                views[name] = torch.as_strided(raw, shape, (L * page, *inner), i * page)
                addr[name] = (lambda b, i=i: [(base + (b * L + i) * page * isz,
                                               base + (b * L + i + 1) * page * isz)])
        return Allocation(views, storages, num_blocks, page * isz, variant, addr)
    if variant == "kv-interleaved":
        hidden = BLOCK_SIZE * heads * HEAD_DIM
        shape = (num_blocks, 2, BLOCK_SIZE, heads, HEAD_DIM)
        stride = (2 * hidden, hidden, heads * HEAD_DIM, HEAD_DIM, 1)
        for name in layer_names:
            raw = fresh(num_blocks * 2 * hidden + 64)
            storages.append(raw)
            views[name] = torch.as_strided(raw, shape, stride, 0)
            base = raw.data_ptr()
            addr[name] = (lambda b, base=base: [(base + 2 * b * hidden * isz,
                                                 base + 2 * (b + 1) * hidden * isz)])
        return Allocation(views, storages, num_blocks, 2 * hidden * isz, variant, addr)
    if variant == "split-half":
        hidden = heads * BLOCK_SIZE * HEAD_DIM
        v_off = num_blocks * hidden + 32          # the virtual K region, page-rounded
        shape = (2, num_blocks, heads, BLOCK_SIZE, HEAD_DIM)
        stride = (v_off, hidden, BLOCK_SIZE * HEAD_DIM, HEAD_DIM, 1)
        for name in layer_names:
            raw = fresh(2 * v_off)
            storages.append(raw)
            views[name] = torch.as_strided(raw, shape, stride, 0)
            base = raw.data_ptr()
            addr[name] = (lambda b, base=base: [
                (base + b * hidden * isz, base + (b + 1) * hidden * isz),
                (base + (v_off + b * hidden) * isz, base + (v_off + (b + 1) * hidden) * isz)])
        return Allocation(views, storages, num_blocks, 2 * hidden * isz, variant, addr)
    raise ValueError(variant)


@contextlib.contextmanager
def kvcached_running(virtual_blocks: int) -> Iterator[None]:
    """kvcached's module globals as ``init_kvcached()`` and its allocation leave them in a
    worker -- the state pdpatch reads (:mod:`pdpatch.kvcached`); kvcached's own module needs a
    CUDA driver to import, so its globals stand in here, as nowhere else."""
    import sys
    import types

    from pdpatch import kvcached

    mod = types.ModuleType(kvcached.INTERFACES_MODULE)
    mod._kvcached_initialized = True
    mod._is_worker = True
    mod._contiguous_layout = False
    mod._created_kv_tensor_capacity = {0: {"num_blocks": virtual_blocks}}
    saved = sys.modules.get(kvcached.INTERFACES_MODULE)
    sys.modules[kvcached.INTERFACES_MODULE] = mod
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop(kvcached.INTERFACES_MODULE, None)
        else:
            sys.modules[kvcached.INTERFACES_MODULE] = saved


def variants_for(version) -> list[str]:
    """The kvcached variants a release's own NIXL descriptor code can address at all: K/V-first
    tensors only split-half; packed pages per layer, and layer-interleaved rows only once
    per-region block strides exist (0.29)."""
    backend = cpu_backend_class()
    shape = (backend.get_kv_cache_shape(4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
             if hasattr(backend, "get_kv_cache_shape") else (4, NUM_KV_HEADS, BLOCK_SIZE, 128))
    if len(shape) == 5:
        return ["split-half"] if shape[0] == 2 else ["kv-interleaved"]
    from packaging.version import Version

    from pdpatch.versions import release_of

    if release_of(version) >= Version("0.29"):
        return ["per-layer", "layer-interleaved"]
    return ["per-layer"]


# ---------------------------------------------------------------------------- the worker


@dataclass
class Registered:
    worker: Any
    nixl: RecordingNixlWrapper
    alloc: Allocation
    planned: int


def worker_module(version) -> Any:
    site = vllm_sites.lookup(vllm_sites.NIXL_WRAPPER_HOME, version)
    return importlib.import_module(site.module)


def default_worker_class(version) -> type:
    """``NixlConnectorWorker``: the class in 0.19-0.23, the pull worker's alias from 0.24."""
    single = vllm_sites.lookup(vllm_sites.REQUIRED_KV_LAYOUT, version).module
    name = single if single == vllm_sites.NIXL_SINGLE_FILE else f"{vllm_sites.NIXL_PKG}.worker"
    return importlib.import_module(name).NixlConnectorWorker


def vllm_config(kv_role: str = "kv_consumer", extra: dict | None = None,
                layout: str | None = "LBHNC", kv_connector: str = "NixlConnector",
                permute: bool = False) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model_dir()), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True, max_model_len=1024)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9)
    if layout is not None and "kv_cache_layout" in getattr(CacheConfig,
                                                            "__dataclass_fields__", {}):
        cache_config.kv_cache_layout = layout   # >= 0.29: set by resolution in EngineCore
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256,
                                         max_model_len=1024,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(kv_connector=kv_connector, kv_role=kv_role,
                                            enable_permute_local_kv=permute,
                                            kv_connector_extra_config=extra or {}),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(planned: int, layer_names: list[str]) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                             head_size=HEAD_DIM, dtype=DTYPE)
    tensors = kv_cache_tensors(planned, spec.page_size_bytes, layer_names)
    return KVCacheConfig(planned, tensors, [KVCacheGroupSpec(layer_names, spec)])


def kv_cache_tensors(num_blocks: int, page: int, layer_names: list[str]) -> list[Any]:
    """One ``KVCacheTensor`` per layer, in the field names of the installed release."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    fields = KVCacheTensor.__dataclass_fields__
    tensors = []
    for n in layer_names:
        if "layer_stride" in fields:            # >= 0.29: placement is part of the plan
            tensors.append(KVCacheTensor(size=num_blocks * page, layers=[n],
                                         layer_stride=num_blocks * page, block_stride=page))
        elif "shared_by" in fields:
            tensors.append(KVCacheTensor(size=num_blocks * page, shared_by=[n]))
        else:
            tensors.append(KVCacheTensor(size=num_blocks * page, layers=[n]))
    return tensors


@contextlib.contextmanager
def fake_runtime(version, tp_size: int = 1) -> Iterator[Any]:
    """Patch what vLLM's own tests patch: the NIXL agent, the TP group, the backends, and the
    handshake listener thread."""
    mod = worker_module(version)
    patches = [patch.object(mod, "NixlWrapper", RecordingNixlWrapper),
               patch.object(mod, "get_tensor_model_parallel_rank", return_value=0),
               patch.object(mod, "get_tensor_model_parallel_world_size", return_value=tp_size),
               patch("threading.Thread")]
    if hasattr(mod, "get_current_attn_backends"):
        patches.append(patch.object(mod, "get_current_attn_backends",
                                    return_value=[cpu_backend_class()]))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield mod


def register(alloc: Allocation, planned: int, version, worker_cls=None, extra: dict | None = None,
             before_register=None, engine_id: str = "engine-under-test",
             tp_size: int = 1) -> Registered:
    """Build a real worker for an engine that planned ``planned`` blocks and register ``alloc``."""
    from vllm.config import set_current_vllm_config

    ensure_cpu_platform()
    cfg = vllm_config(extra=extra)
    kvc = kv_cache_config(planned, list(alloc.views))
    with fake_runtime(version, tp_size), set_current_vllm_config(cfg):
        if worker_cls is None:
            worker_cls = default_worker_class(version)
        RecordingNixlWrapper.instances.clear()
        worker = worker_cls(cfg, engine_id, kvc)
        nixl = worker.nixl_wrapper
        if before_register is not None:
            before_register(worker)
        worker.register_kv_caches(alloc.views)
    return Registered(worker, nixl, alloc, planned)


# ----------------------------------------------------------------------- geometry checks


def merge(intervals) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(a, b) for a, b in out]


def planned_bytes(alloc: Allocation, planned: int) -> list[tuple[int, int]]:
    return merge(iv for name in alloc.views for b in range(planned)
                 for iv in alloc.block_addr[name](b))


def registered_bytes(nixl: RecordingNixlWrapper) -> list[tuple[int, int]]:
    return merge((int(d[0]), int(d[0]) + int(d[1])) for descs in nixl.registered for d in descs)


def region_counts(worker: Any) -> list[int]:
    counts = list(getattr(worker, "region_num_blocks", None) or [])
    return counts or [worker.num_blocks] * worker.num_regions


def check_descs_resolve(descs: list[tuple[int, int]], counts: list[int], alloc: Allocation,
                        planned: int, registered: list[tuple[int, int]] | None = None) -> None:
    """vLLM's layout-blind contract (its ``test_register_kv_caches``): desc id
    ``offset(region) + b`` covers bytes of logical block ``b`` only, and the descriptors of block
    ``b`` together cover exactly block ``b``'s bytes in every layer.  (A region may be one layer,
    or a whole row of layers where vLLM registers block-outermost storage as rows.)"""
    assert len(descs) == sum(counts), (len(descs), counts)
    assert all(c == planned for c in counts), counts
    block = {b: merge(iv for name in alloc.views for iv in alloc.block_addr[name](b))
             for b in range(planned)}
    covered: dict[int, list[tuple[int, int]]] = {}
    i = 0
    for count in counts:
        for b in range(count):
            lo, length = descs[i]
            lo, hi = int(lo), int(lo) + int(length)
            assert any(blo <= lo and hi <= bhi for blo, bhi in block[b]), \
                f"desc {i} [{lo}, {hi}) is not inside block {b}"
            if registered is not None:
                assert any(rlo <= lo and hi <= rhi for rlo, rhi in registered), \
                    f"desc {i} [{lo}, {hi}) lies outside the registered memory"
            covered.setdefault(b, []).append((lo, hi))
            i += 1
    for b in range(planned):
        assert merge(covered.get(b, [])) == block[b], f"block {b} not covered exactly"


def local_descs(reg: Registered) -> list[tuple[int, int]]:
    w = reg.worker
    handle = w.src_xfer_handles_by_block_size[w.block_size]
    return reg.nixl.dlists[handle][1]


def peer_remote_descs(peer: Registered, meta: Any, version) -> list[tuple[int, int]]:
    """Have a real peer worker build its remote descriptors from ``meta`` (the handshake)."""
    before = set(peer.nixl.dlists)
    with fake_runtime(version):
        peer.worker.add_remote_agent(meta, 0, 1)
    remote = [descs for k, (agent, descs) in peer.nixl.dlists.items()
              if k not in before and agent == "remote-agent"]
    assert len(remote) == 1, remote
    return remote[0]


def decoded_metadata(worker: Any) -> Any:
    import msgspec

    mod = importlib.import_module(type(worker).__mro__[0].__module__)
    meta_cls = getattr(mod, "NixlAgentMetadata", None)
    if meta_cls is None:
        for klass in type(worker).__mro__:
            meta_cls = getattr(importlib.import_module(klass.__module__), "NixlAgentMetadata",
                               None)
            if meta_cls is not None:
                break
    payload = worker.xfer_handshake_metadata
    return msgspec.msgpack.decode(payload.agent_metadata_bytes, type=meta_cls)
