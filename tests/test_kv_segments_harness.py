"""Real vLLM NIXL workers with real attention-backend layouts, for the ``kv_segments`` tests.

No tests here: the helpers are shared by ``test_kv_segments_workers.py`` (the installed vLLM in
process) and the old-release runs (``versions_harness.run_in_release`` imports this module under
a release's source tree).  Built on ``robust_worker`` (configs, KV-cache config, the
``RecordingNixlWrapper`` in vLLM's FakeNixlWrapper style, request metadata, step pumping); what
is added:

* the worker's attention backend is a real vLLM backend class (FlashAttention, Triton), and its
  KV tensors are allocated the way vLLM's model runner allocates them: the backend's
  ``get_kv_cache_shape`` in its ``get_kv_cache_stride_order`` (from 0.29 the packed
  ``(N, H, bs, 2D)`` head-major page every backend uses);
* :class:`CopyingNixlWrapper` moves bytes: a READ it is asked to ``transfer`` copies every
  remote descriptor's bytes into the paired local descriptor, after checking that both lie in
  memory some agent of this process registered (real NIXL answers ``NIXL_ERR_NOT_FOUND``
  otherwise) -- P and D live in one process, so D's descriptors into P's tensors are real
  addresses;
* the handshake is vLLM's own: P's ``NixlHandshakePayload`` is served by the release's real
  ``_nixl_handshake_listener`` over ZMQ on loopback, and D's ``start_load_kv`` reaches it through
  its real background ``_nixl_handshake`` (hash check, msgspec decode, ``add_remote_agent``).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar
from unittest.mock import patch

import kvc_harness
import msgspec
import robust_worker as rw
import torch
from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.versions import release_of

HEAD_DIM = rw.HEAD_DIM
DTYPE = rw.DTYPE
NUM_LAYERS = rw.NUM_LAYERS
HOST = "127.0.0.1"


def version() -> Version:
    return release_of(rw.version_of())


# ----------------------------------------------------------------------------- backends


def backend_class(name: str) -> type:
    """A real vLLM attention backend class by name (importable on CPU in 0.19-0.34)."""
    module, cls = {
        "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
        "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
        "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend"),
    }[name]
    return getattr(importlib.import_module(module), cls)


def logical_shape(backend: type, num_blocks: int, block_size: int, heads: int) -> tuple:
    if hasattr(backend, "get_kv_cache_shape"):
        return tuple(backend.get_kv_cache_shape(num_blocks, block_size, heads, HEAD_DIM))
    return (num_blocks, heads, block_size, 2 * HEAD_DIM)   # >= 0.29: the planner's packed page


def physical_order(backend: type, shape: tuple[int, ...]) -> tuple[tuple[int, ...], list[int]]:
    """The physical shape vLLM's model runner allocates for logical ``shape`` (the backend's
    stride order), and the permutation back to the logical one."""
    order = tuple(range(len(shape)))
    if hasattr(backend, "get_kv_cache_shape"):
        with contextlib.suppress(NotImplementedError, AttributeError):
            order = tuple(backend.get_kv_cache_stride_order())
    return tuple(shape[i] for i in order), [order.index(i) for i in range(len(order))]


def allocate(backend: type, num_blocks: int, block_size: int, heads: int | dict[str, int],
             seed: int, layers: list[str], token_major: bool = False
             ) -> dict[str, torch.Tensor]:
    """Random KV tensors allocated like vLLM's model runner: physical order from the backend's
    stride order (0.29+: from the layout, ``token_major`` LBNHC), then permuted back to the
    logical shape; ``heads`` per layer where a dict; one tensor per layer, in ``layers``'
    order (the ``kv_caches`` dict order)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in layers:
        h = heads[name] if isinstance(heads, dict) else heads
        shape = logical_shape(backend, num_blocks, block_size, h)
        if token_major and not hasattr(backend, "get_kv_cache_shape"):
            # 0.29+: the packed page (N, H, bs, 2D) with its bytes in (N, bs, H, 2D) order
            physical, inverse = (shape[0], shape[2], shape[1], shape[3]), [0, 2, 1, 3]
        else:
            physical, inverse = physical_order(backend, shape)
        raw = torch.randint(-30000, 30000, physical, dtype=torch.int16, generator=gen)
        out[name] = raw.view(DTYPE).permute(*inverse)
    return out


def kv_block(t: torch.Tensor, b: int, which: int) -> torch.Tensor:
    """Logical K (0) or V (1) of block ``b`` as ``(bs, H, D)`` int16, whatever the layout:
    ``(2, N, bs, H, D)`` FlashAttention <= 0.22, ``(N, 2, bs, H, D)`` FlashInfer/Triton and
    FlashAttention 0.23-0.25, ``(2, N, H, bs, D)`` CPU <= 0.22, ``(N, H, bs, 2D)`` packed."""
    x = t.view(torch.int16)
    if x.dim() == 4:
        return x[b].permute(1, 0, 2)[..., which * HEAD_DIM:(which + 1) * HEAD_DIM]
    # K/V-first vs blocks-first (tests never use exactly 2 blocks, so this is unambiguous)
    return x[which][b] if x.shape[0] == 2 and x.shape[1] != 2 else x[b][which]


# ----------------------------------------------------------------------------- fake NIXL


@dataclass
class _Registered:
    ranges: list[tuple[int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class CopyingNixlWrapper(rw.RecordingNixlWrapper):
    """``RecordingNixlWrapper`` that performs READs with ``memmove`` (see module docstring)."""

    registry: ClassVar[_Registered] = _Registered()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.copied_bytes = 0
        self.errors: list[str] = []

    def register_memory(self, descs, backends=None):
        with self.registry.lock:
            for d in descs:
                self.registry.ranges.append((int(d[0]), int(d[0]) + int(d[1])))

    def _inside(self, lo: int, n: int) -> bool:
        with self.registry.lock:
            return any(a <= lo and lo + n <= b for a, b in self.registry.ranges)

    def transfer(self, handle, *args, **kwargs):
        read = next(r for r in self.reads if r["handle"] == handle)
        local = self.dlists[read["local"]][1]
        remote = self.dlists[read["remote"]][1]
        for li, ri in zip(read["local_ids"], read["remote_ids"], strict=True):
            (dst, n), (src, m) = local[li], remote[ri]
            if n != m or not self._inside(dst, n) or not self._inside(src, m):
                msg = f"descriptor pair {li}/{ri}: local {dst}+{n}, remote {src}+{m}"
                self.errors.append(msg)
                raise RuntimeError(f"NIXL_ERR_NOT_FOUND (fake): {msg}")
            ctypes.memmove(dst, src, n)
            self.copied_bytes += n
        return "PROC"


# ----------------------------------------------------------------------------- workers


@dataclass
class Side:
    worker: Any
    caches: dict[str, torch.Tensor]
    backend: str
    block_size: int
    heads: int          # local KV heads of this rank
    tp_rank: int
    tp_size: int


@contextlib.contextmanager
def runtime(tp_rank: int, tp_size: int, backend: type, layout: str | None = None
            ) -> Iterator[Any]:
    """The worker module as one rank of ``backend`` sees it; ``layout`` (<= 0.28) overrides the
    KV layout name for the worker and the backend's stride order (per side, unlike
    ``VLLM_KV_CACHE_LAYOUT``); 0.29+ read it from the config (:func:`build` sets it)."""
    mod = rw.worker_module()
    patches = [patch.object(mod, "NixlWrapper", CopyingNixlWrapper),
               patch.object(mod, "get_tensor_model_parallel_rank", return_value=tp_rank),
               patch.object(mod, "get_tensor_model_parallel_world_size", return_value=tp_size)]
    if layout is not None:
        for owner in (mod, sys.modules[backend.__module__]):
            if hasattr(owner, "get_kv_cache_layout"):
                patches.append(patch.object(owner, "get_kv_cache_layout", return_value=layout))
    if hasattr(mod, "get_current_attn_backends"):
        patches.append(patch.object(mod, "get_current_attn_backends", return_value=[backend]))
    if hasattr(mod, "get_current_attn_backend"):
        patches.append(patch.object(mod, "get_current_attn_backend", return_value=backend))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield mod


LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def _kv_cache_config(num_blocks: int, layers: list[str], block_size: int,
                     heads: int | dict[str, int]) -> Any:
    """One KV-cache group of every layer, or (``heads`` per layer) one group per distinct head
    count, as vLLM groups layers of different specs (all full attention: no HMA)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    def spec(h: int) -> Any:
        return FullAttentionSpec(block_size=block_size, num_kv_heads=h, head_size=HEAD_DIM,
                                 dtype=DTYPE)

    if not isinstance(heads, dict):
        return rw.kv_cache_config(num_blocks, layers, spec(heads))
    groups = {h: [n for n in LAYERS if heads[n] == h] for h in sorted(set(heads.values()))}
    tensors = [t for h, names in groups.items()
               for t in kvc_harness.kv_cache_tensors(num_blocks, spec(h).page_size_bytes, names)]
    return KVCacheConfig(num_blocks, tensors,
                         [KVCacheGroupSpec(names, spec(h)) for h, names in groups.items()])


def build(engine_id: str, role: str, backend: str, *, num_blocks: int = 12,
          kv_heads: int = 2, tp_rank: int = 0, tp_size: int = 1, block_size: int = 16,
          seed: int = 0, extra: dict | None = None, layout: str | None = None,
          env: dict[str, str] | None = None, permute: bool = False,
          layer_heads: dict[str, int] | None = None, cache_order: list[str] | None = None
          ) -> Side:
    """A real worker of the running release with ``backend``'s KV tensors registered
    (``env``: environment while it is built, e.g. pdpatch settings of that engine;
    ``layer_heads``: KV heads per layer where they differ; ``cache_order``: the order of the
    ``kv_caches`` dict the model runner hands the worker, layer order by default)."""
    from vllm.config import set_current_vllm_config

    cfg = rw.vllm_config("llama", kv_heads, role, tp_size, extra)
    cfg.cache_config.block_size = block_size
    cfg.kv_transfer_config.enable_permute_local_kv = permute
    token_major = layout == "NHD"
    if layout is not None and version() >= vllm_sites.LAYOUT_5D_NAMES_FROM:
        # 0.29+ read the layout EngineCore resolved into the config, not get_kv_cache_layout
        cfg.cache_config.kv_cache_layout = vllm_sites.layout_names(version())[not token_major]
    layers = list(cache_order or LAYERS)
    heads: int | dict[str, int] = max(1, kv_heads // tp_size)
    if layer_heads is not None:
        heads = {n: max(1, h // tp_size) for n, h in layer_heads.items()}
    kvc = _kv_cache_config(num_blocks, layers, block_size, heads)
    cls = backend_class(backend)
    with runtime(tp_rank, tp_size, cls, layout), set_current_vllm_config(cfg), \
            patch("threading.Thread"), patch.dict(os.environ, env or {}):
        worker = rw.worker_class()(cfg, engine_id, kvc)
        caches = allocate(cls, num_blocks, block_size, heads, seed, layers, token_major)
        worker.register_kv_caches(caches)
    most = max(heads.values()) if isinstance(heads, dict) else heads
    return Side(worker, caches, backend, block_size, most, tp_rank, tp_size)


# ----------------------------------------------------------------------- real handshake


def _listener() -> Any:
    """The release's own ``_nixl_handshake_listener`` (a staticmethod of the scheduler)."""
    for name in (vllm_sites.NIXL_SINGLE_FILE, f"{vllm_sites.NIXL_PKG}.base_scheduler",
                 f"{vllm_sites.NIXL_PKG}.scheduler"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for obj in vars(mod).values():
            if isinstance(obj, type) and "_nixl_handshake_listener" in vars(obj):
                return obj._nixl_handshake_listener
    raise LookupError("no _nixl_handshake_listener in this release")


#: Listeners told to stop and not yet joined: the release's listener sees its stop event only
#: when its 1-s receive timeout expires, so each scenario would wait a second for it to end;
#: ``release_report`` joins them all once, at its end.
_STOPPING: list[threading.Thread] = []


@dataclass
class Served:
    port: int
    stop: threading.Event
    thread: threading.Thread

    def close(self) -> None:
        self.stop.set()
        _STOPPING.append(self.thread)


def join_listeners() -> None:
    while _STOPPING:
        _STOPPING.pop().join(timeout=5)


def serve(ranks: dict[int, Side]) -> Served:
    """Serve P's handshake payload(s) (tp rank -> side) like its scheduler does."""
    import os

    port = rw_free_port()
    encoder = msgspec.msgpack.Encoder()
    data: dict[Any, bytes] = {}
    for rank, side in ranks.items():
        blob = encoder.encode(side.worker.xfer_handshake_metadata)
        data[rank] = blob
        data[(0, rank)] = blob          # 0.33+ key by (pp rank, tp rank)
    fn = _listener()
    ready, stop = threading.Event(), threading.Event()
    params = list(inspect.signature(fn).parameters)
    if "host" in params:
        args: tuple = (data, ready, stop, HOST, port)
    else:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = HOST
        args = (data, ready, stop, port)
    t = threading.Thread(target=fn, args=args, daemon=True, name="test-nixl-listener")
    t.start()
    assert ready.wait(10), "listener did not start"
    return Served(port, stop, t)


def rw_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def record_handshake_errors(worker: Any) -> list[str]:
    """Let the real ``_nixl_handshake`` run, recording what it raises (the release turns it
    into a failed request)."""
    real = worker._nixl_handshake
    errors: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        try:
            return real(*args, **kwargs)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            raise

    worker._nixl_handshake = recording
    return errors


# ----------------------------------------------------------------------------- scenario


def proxy_params(d: Side, p: Side, remote_ids: list[int]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a P/D proxy forwards from P besides the block ids and the
    peer's address: ``remote_num_tokens`` (the tokens P computed, here its blocks full), which
    P sends from 0.22 and 0.34's decode worker requires where the engines' block sizes differ
    (0.34.0 pull_worker.py L188-204 declines the READ without it; earlier releases read it
    only in region-mapped pulls or not at all)."""
    if d.block_size == p.block_size:
        return {}
    return {"remote_num_tokens": p.block_size * len(remote_ids)}


def pull(d: Side, p_ranks: dict[int, Side], local_ids: list[int], remote_ids: list[int],
         req: str = "req-1", timeout: float = 30.0, groups: int = 1) -> dict[str, Any]:
    """D pulls ``remote_ids`` of P (engine of ``p_ranks``) into ``local_ids`` through vLLM's own
    ``start_load_kv`` -> background handshake -> ``_read_blocks``, the same ids in each of
    ``groups`` KV-cache groups; returns what happened."""
    served = serve(p_ranks)
    p0 = next(iter(p_ranks.values()))
    errors = record_handshake_errors(d.worker)
    before = {n: t.view(torch.int16).clone() for n, t in d.caches.items()}
    try:
        meta = rw.recv_metadata([{"req_id": req, "local_ids": [local_ids] * groups,
                                  "remote_ids": [remote_ids] * groups,
                                  "engine": p0.worker.engine_id, "port": served.port,
                                  "tp_size": p0.tp_size,
                                  "params": proxy_params(d, p0, remote_ids)}])
        crash = rw.step(d.worker, meta)
        acc, crash2 = rw.run_until(
            d.worker, lambda a: req in set(a["done_recving"]) | set(a["failed_recving"])
            or bool(a["invalid_blocks"]) or bool(errors), timeout=timeout)
        if errors and not (set(acc["failed_recving"]) | set(acc["invalid_blocks"])):
            more, crash3 = rw.run_until(
                d.worker, lambda a: bool(set(a["failed_recving"]) | set(a["invalid_blocks"])
                                         | set(a["done_recving"])), timeout=5)
            acc = rw.merge(acc, more)
            crash2 = crash2 or crash3
    finally:
        served.close()
    nixl = d.worker.nixl_wrapper
    changed = sorted({b for n, t in d.caches.items()
                      for b in range(t.shape[_block_dim(t)])
                      if not torch.equal(_block(t.view(torch.int16), b),
                                         _block(before[n], b))})
    staging = getattr(nixl, "stats", None)
    return {"results": acc, "crash": crash or crash2, "handshake_errors": errors,
            "staging": None if staging is None else {
                **vars(staging), "not_staged": dict(staging.not_staged),
                "free": nixl.staging_free, "allocated": nixl.staging_allocated},
            "copied_bytes": getattr(nixl, "copied_bytes", 0),
            "read_notifs": [r["notif"] for r in getattr(nixl, "reads", [])],
            "notifs_sent": [msg for _, msg in getattr(nixl, "notifs_sent", [])],
            "xfer_stats": _xfer_stats(d.worker),
            "nixl_errors": list(getattr(nixl, "errors", [])), "changed_blocks": changed}


def _xfer_stats(worker: Any) -> dict[str, Any]:
    """What vLLM recorded of its finished READs (``NixlKVConnectorStats.record_transfer``, from
    the agent's ``get_xfer_telemetry``)."""
    stats = getattr(worker, "xfer_stats", None)
    data = getattr(stats, "data", None) or {}
    return {k: list(data.get(k, [])) for k in ("bytes_transferred", "num_descriptors")}


def _block_dim(t: torch.Tensor) -> int:
    return 1 if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] != 2 else 0


def _block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[:, b] if _block_dim(t) == 1 else t[b]


def compare(d: Side, p: Side, pairs: list[tuple[int, int]]) -> list[str]:
    """Logical K and V of each (local block, remote block) pair, D's heads slice of P's."""
    bad = []
    start = (d.tp_rank * d.heads) % max(p.heads, 1) if p.heads > d.heads else 0
    for name in d.caches:
        for lb, rb in pairs:
            for which in (0, 1):
                got = kv_block(d.caches[name], lb, which)
                want = kv_block(p.caches[name], rb, which)[:, start:start + d.heads]
                if not torch.equal(got, want):
                    bad.append(f"{name} local {lb} <- remote {rb} {'KV'[which]}")
    return bad


def compare_ratio(d: Side, p: Side, local_block: int, remote_blocks: list[int]) -> list[str]:
    """Block-size ratio: D's block holds P's blocks back to back in token order (after vLLM's
    own receive post-processing)."""
    bad = []
    r = d.block_size // p.block_size
    for name in d.caches:
        for which in (0, 1):
            got = kv_block(d.caches[name], local_block, which)
            for j, rb in enumerate(remote_blocks[:r]):
                want = kv_block(p.caches[name], rb, which)
                part = got[j * p.block_size:(j + 1) * p.block_size]
                if not torch.equal(part, want):
                    bad.append(f"{name} {'KV'[which]} tokens of remote block {rb}")
    return bad


def safe(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception:
        return {"error": traceback.format_exc()[-3000:]}


# ----------------------------------------------------------------------------- scenarios
#
# Each returns a JSON-able observation; the tests decide what is right.  ``P_BACKEND`` is
# FlashAttention (K/V-first split regions up to 0.22, blocks-first from 0.23, packed from 0.26)
# and ``D_BACKEND`` Triton, whose layout is FlashInfer's (blocks-first ``(N, 2, bs, H, D)``
# up to 0.25, packed from 0.26); FlashInfer itself cannot be imported without its CUDA package.

P_BACKEND = "FLASH_ATTN"
D_BACKEND = "TRITON_ATTN"


def _reset() -> None:
    CopyingNixlWrapper.registry.ranges.clear()
    from pdpatch import installer

    installer.reset_state()


def _stats() -> dict[str, Any]:
    from pdpatch import installer, metrics
    from pdpatch.patches import kv_segments

    state = installer.state_of(kv_segments.NAME)
    return {**{name: getattr(state, name) for name in (
        "advertised", "hash_alternates_accepted", "mixed_accepted", "coalesced", "last_error")},
            "conversions": metrics.total(metrics.PEERS_CONVERTED),
            "rejected": metrics.total(metrics.REFUSALS, kv_segments.NAME)}


def _remote_lists(d: Side, engine: str) -> list[list[tuple[int, int]]]:
    return [descs for agent, descs in d.worker.nixl_wrapper.dlists.values()
            if agent != "NIXL_INIT_AGENT"]


def scenario_pair(p_backend: str = P_BACKEND, d_backend: str = D_BACKEND,
                  d_extra: dict | None = None, block_size: int = 16,
                  p_blocks: tuple[int, ...] = (4, 5, 6),
                  d_blocks: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """P (``p_backend``) -> D (``d_backend``): blocks ``p_blocks`` of P into ``d_blocks``."""
    _reset()
    p = build("prefill", "kv_producer", p_backend, num_blocks=12, seed=1, block_size=block_size)
    d = build("decode", "kv_consumer", d_backend, num_blocks=10, seed=2, extra=d_extra,
              block_size=block_size)
    out = pull(d, {0: p}, list(d_blocks), list(p_blocks))
    out["mismatches"] = compare(d, p, list(zip(d_blocks, p_blocks, strict=True)))
    out["p_regions"] = len(msgspec.msgpack.decode(
        p.worker.xfer_handshake_metadata.agent_metadata_bytes)["kv_caches_base_addr"])
    out["d_regions"] = len(msgspec.msgpack.decode(
        d.worker.xfer_handshake_metadata.agent_metadata_bytes)["kv_caches_base_addr"])
    out["backends"] = [p.worker.backend_name, d.worker.backend_name]
    out["p_shape"] = list(next(iter(p.caches.values())).shape)
    out["d_shape"] = list(next(iter(d.caches.values())).shape)
    out["stats"] = _stats()
    return out


def scenario_pair_reorder(d_env: dict[str, str], d_backend: str = D_BACKEND,
                          permute: bool = False, d_block_size: int = 16,
                          p_backend: str = P_BACKEND) -> dict[str, Any]:
    """Head-major P (``p_backend``, stock layout) -> D token-major (kvcached's layout, forced
    with pdpatch's settings ``d_env``; ``permute``: vLLM's ``enable_permute_local_kv`` set by
    the operator): blocks 4, 5, 6 of P into 1, 2, 3 of D; with ``d_block_size`` 32, P's 16-token
    blocks 4 and 5 into D's block 1 (vLLM's block-size and layout post-processing at once)."""
    _reset()
    p = build("prefill", "kv_producer", p_backend, num_blocks=12, seed=1, layout="HND")
    d = build("decode", "kv_consumer", d_backend, num_blocks=10, seed=2, layout="NHD",
              env=d_env, permute=permute, block_size=d_block_size)
    if d_block_size == p.block_size:
        out = pull(d, {0: p}, [1, 2, 3], [4, 5, 6])
        out["mismatches"] = compare(d, p, [(1, 4), (2, 5), (3, 6)])
    else:
        out = pull(d, {0: p}, [1], [4, 5])
        out["mismatches"] = compare_ratio(d, p, 1, [4, 5])
    out["permute_flag"] = bool(d.worker.kv_transfer_config.enable_permute_local_kv)
    out["stats"] = _stats()
    return out


def scenario_layer_order(reverse_p: bool = True, d_extra: dict | None = None
                         ) -> dict[str, Any]:
    """A mixed pair (FlashAttention P, Triton D) whose layers differ -- 2 KV heads in layer 0,
    1 in layer 1 (two KV-cache groups, as vLLM groups layers of different specs) -- and whose
    P hands its worker the ``kv_caches`` dict in the other order (``reverse_p``).  vLLM pairs
    the layers by name (0.34+), or by position in name order (0.30-0.33, regions sorted by
    ``_region_sort_key``), so layer 0 meets layer 0; by position in dict order (0.29; 0.26-0.28
    register no layers of different sizes) it would pair layer 1 of P with layer 0 of D.
    pdpatch's check must compare the pairs the release transfers: P's advertised geometry
    lists its layers in its dict order.
    ``d_extra``: D's ``kv_connector_extra_config`` (stock with the hash check off shows what
    the release itself does with the pair)."""
    _reset()
    heads = {LAYERS[0]: 2, LAYERS[1]: 1}
    order = LAYERS[::-1] if reverse_p else LAYERS
    p = build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1, layer_heads=heads,
              cache_order=order)
    d = build("decode", "kv_consumer", D_BACKEND, num_blocks=10, seed=2, layer_heads=heads,
              extra=d_extra)
    out = pull(d, {0: p}, [1, 2, 3], [4, 5, 6], groups=len(set(heads.values())))
    out["mismatches"] = compare(d, p, [(1, 4), (2, 5), (3, 6)])
    advertised = msgspec.msgpack.decode(
        p.worker.xfer_handshake_metadata.agent_metadata_bytes).get("pdpatch_kv_geometry")
    out["advertised_names"] = (advertised or {}).get("names")
    out["stats"] = _stats()
    return out


def scenario_readd_known_rank(coalesce: bool = False) -> dict[str, Any]:
    """After a mixed pair's pull, vLLM's ``add_remote_agent`` is called again for the same
    peer rank (as vLLM's own tests do): the release returns the agent it has and does nothing
    else (its ``_remote_agents`` keyed by rank up to 0.25, by ``(pp rank, tp rank)`` from
    0.26), so pdpatch must neither plan, count nor stage that peer a second time."""
    _reset()
    p = build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1)
    backend = P_BACKEND if coalesce else D_BACKEND
    d = build("decode", "kv_consumer", backend, num_blocks=10, seed=2)
    out = pull(d, {0: p}, [1, 2, 3], [4, 5, 6])
    out["mismatches"] = compare(d, p, [(1, 4), (2, 5), (3, 6)])
    out["stats"] = _stats()
    meta = msgspec.msgpack.Decoder(rw.worker_module().NixlAgentMetadata).decode(
        p.worker.xfer_handshake_metadata.agent_metadata_bytes)
    agents = d.worker._remote_agents[meta.engine_id]
    dlists = len(d.worker.nixl_wrapper.dlists)
    try:
        again = d.worker.add_remote_agent(meta, 0, 1)
        out["readd_error"] = None
    except Exception as exc:
        again, out["readd_error"] = None, f"{type(exc).__name__}: {exc}"
    out["readd_same_agent"] = again in set(agents.values())
    out["readd_new_dlists"] = len(d.worker.nixl_wrapper.dlists) - dlists
    out["stats_after"] = _stats()
    return out


def scenario_pair_unstaged() -> dict[str, Any]:
    """``pair`` with staging off (``PDPATCH_KV_STAGING_MIB=0``): per-segment READs."""
    with patch.dict(os.environ, {"PDPATCH_KV_STAGING_MIB": "0"}):
        return scenario_pair()


def scenario_pair_gap() -> dict[str, Any]:
    """``pair`` with P's blocks 3, 5, 8 (no two adjacent) and ``PDPATCH_KV_GAP_KIB=1024``:
    one gap READ per layer and pool, where per-segment READs post one per block."""
    with patch.dict(os.environ, {"PDPATCH_KV_GAP_KIB": "1024"}):
        return scenario_pair(p_blocks=(3, 5, 8))


COALESCE = {"PDPATCH_KV_COALESCE": "1"}


def coalesced(scenario: Any, env: dict[str, str] | None = None) -> Any:
    """``scenario`` with ``PDPATCH_KV_COALESCE=1`` (and ``env``) in both engines: same-layout
    peers' READs staged."""
    def run() -> dict[str, Any]:
        with patch.dict(os.environ, {**COALESCE, **(env or {})}):
            return scenario()
    return run


def scenario_pair_chunked() -> dict[str, Any]:
    """``pair`` with 512-token blocks (128 KiB segments: 1.5 MiB for the request) and 1 MiB
    of staging (``PDPATCH_KV_STAGING_MIB=1``, no gap reads): a READ larger than the staging,
    read in chunks behind the one handle vLLM polls."""
    with patch.dict(os.environ, {"PDPATCH_KV_STAGING_MIB": "1", "PDPATCH_KV_GAP_KIB": "0"}):
        out = scenario_pair(block_size=512)
    return out


REORDER_SIDES = {"p": {"layout": "HND"}, "d": {"layout": "NHD"}}
"""``reorder`` in the TP scenarios: P head-major, D token-major (kvcached's layout)."""


def _reorder(reorder: dict[str, str] | None) -> tuple[dict, dict]:
    """Build arguments of P and D: ``reorder`` None keeps each backend's own layout; else P
    head-major and D token-major, with ``reorder`` as D's environment (pdpatch's settings)."""
    if reorder is None:
        return {}, {}
    return REORDER_SIDES["p"], {**REORDER_SIDES["d"], "env": reorder}


def scenario_tp_up(d_backend: str = D_BACKEND, reorder: dict[str, str] | None = None,
                   block_size: int = 16, d_blocks: tuple[int, ...] = (1, 2),
                   p_blocks: tuple[int, ...] = (7, 8)) -> dict[str, Any]:
    """P TP 1 (2 KV heads) -> D TP 2: each D rank pulls its head from P's one rank."""
    _reset()
    p_args, d_args = _reorder(reorder)
    p = build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1,
              block_size=block_size, **p_args)
    out: dict[str, Any] = {}
    for rank in (0, 1):
        d = build(f"decode-r{rank}", "kv_consumer", d_backend, num_blocks=10, seed=2 + rank,
                  tp_rank=rank, tp_size=2, block_size=block_size, **d_args)
        res = pull(d, {0: p}, list(d_blocks), list(p_blocks), req=f"req-r{rank}")
        res["mismatches"] = compare(d, p, list(zip(d_blocks, p_blocks, strict=True)))
        out[f"rank{rank}"] = res
    out["stats"] = _stats()
    return out


def scenario_tp_down(d_backend: str = D_BACKEND, reorder: dict[str, str] | None = None
                     ) -> dict[str, Any]:
    """P TP 2 (1 head per rank) -> D TP 1: D pulls half of each block from each P rank."""
    _reset()
    p_args, d_args = _reorder(reorder)
    ps = {r: build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1 + r,
                   tp_rank=r, tp_size=2, **p_args) for r in (0, 1)}
    d = build("decode", "kv_consumer", d_backend, num_blocks=10, seed=5, **d_args)
    out = pull(d, ps, [1, 2], [7, 8])
    bad = []
    for r, p in ps.items():
        for name in d.caches:
            for lb, rb in ((1, 7), (2, 8)):
                for which in (0, 1):
                    got = kv_block(d.caches[name], lb, which)[:, r * p.heads:(r + 1) * p.heads]
                    if not torch.equal(got, kv_block(p.caches[name], rb, which)):
                        bad.append(f"{name} {lb}<-{rb} {'KV'[which]} from P rank {r}")
    out["mismatches"] = bad
    out["stats"] = _stats()
    return out


def scenario_block_ratio(p_backend: str = P_BACKEND, d_backend: str = D_BACKEND
                         ) -> dict[str, Any]:
    """P block size 16 -> D block size 32: D's block 1 holds P's blocks 4 and 5."""
    _reset()
    p = build("prefill", "kv_producer", p_backend, num_blocks=12, seed=1, block_size=16)
    d = build("decode", "kv_consumer", d_backend, num_blocks=10, seed=2, block_size=32)
    out = pull(d, {0: p}, [1], [4, 5])
    out["mismatches"] = compare_ratio(d, p, 1, [4, 5])
    out["stats"] = _stats()
    return out


def _tamper(side: Side, **changes: Any) -> None:
    """Rewrite fields of the encoded handshake metadata (a malformed or lying peer)."""
    meta = msgspec.msgpack.decode(side.worker.xfer_handshake_metadata.agent_metadata_bytes)
    for key, fn in changes.items():
        meta[key] = fn(meta.get(key))
    side.worker.xfer_handshake_metadata.agent_metadata_bytes = msgspec.msgpack.encode(meta)


def _halve_segments(wire: dict | None) -> dict | None:
    if wire is None:
        return None
    for layer in wire["layers"]:
        for seg in layer[3]:
            seg[2] //= 2
    return wire


def scenario_span_mismatch(tamper: str = "advertised") -> dict[str, Any]:
    """A peer whose segments cannot span D's blocks: the handshake fails with both geometries
    named, only this peer's request fails, and D's memory is untouched (no READ posted)."""
    _reset()
    p = build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1)
    if tamper == "advertised":
        _tamper(p, pdpatch_kv_geometry=_halve_segments)
    else:  # vLLM's own fields: block lengths that do not match D's
        _tamper(p, block_lens=lambda lens: [x // 2 for x in lens],
                pdpatch_kv_geometry=lambda _: None)
    d = build("decode", "kv_consumer", D_BACKEND, num_blocks=10, seed=2)
    out = pull(d, {0: p}, [1, 2], [4, 5])
    out["remote_dlists"] = len(_remote_lists(d, "prefill"))
    out["reads"] = len(d.worker.nixl_wrapper.reads)
    out["stats"] = _stats()
    return out


def scenario_advert_ignored() -> dict[str, Any]:
    """pdpatch's advertised field through a stock decoder: the stock class decodes P's bytes,
    and a D with kv_segments switched off (stock code path) completes a same-backend pull."""
    _reset()
    p = build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1)
    raw = p.worker.xfer_handshake_metadata.agent_metadata_bytes
    keys = sorted(msgspec.msgpack.decode(raw))
    stock_cls = rw.worker_module().NixlAgentMetadata
    decoded = msgspec.msgpack.Decoder(stock_cls).decode(raw)
    d = build("decode", "kv_consumer", P_BACKEND, num_blocks=10, seed=2,
              extra={"pdpatch": {"kv_segments": False}})
    out = pull(d, {0: p}, [1, 2, 3], [4, 5, 6])
    out["mismatches"] = compare(d, p, [(1, 4), (2, 5), (3, 6)])
    out["wire_keys"] = keys
    out["stock_decoded_type"] = type(decoded).__qualname__
    out["stock_decoded_has_field"] = hasattr(decoded, "pdpatch_kv_geometry")
    out["stats"] = _stats()
    return out


def scenario_globals() -> dict[str, Any]:
    """The worker module's wire classes: vLLM's own outside a handshake, pdpatch's payload
    subclass only while one runs (the metadata vLLM decodes is its own class throughout),
    vLLM's own again after ``pdpatch.uninstall()``."""
    _reset()
    mod = rw.worker_module()
    before = (mod.NixlAgentMetadata, mod.NixlHandshakePayload)
    seen: list[tuple[str, bool]] = []
    p = build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1)
    d = build("decode", "kv_consumer", D_BACKEND, num_blocks=10, seed=2)
    real_add = d.worker.add_remote_agent

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append((mod.NixlHandshakePayload.__module__, type(args[0]) is before[0]))
        return real_add(*args, **kwargs)

    d.worker.add_remote_agent = spy
    res = pull(d, {0: p}, [1], [4])
    during = list(seen)
    after = (mod.NixlAgentMetadata is before[0], mod.NixlHandshakePayload is before[1])
    from pdpatch import installer

    installer.uninstall()
    uninstalled = (mod.NixlAgentMetadata is before[0], mod.NixlHandshakePayload is before[1])
    d2 = build("decode2", "kv_consumer", D_BACKEND, num_blocks=10, seed=3)
    res2 = pull(d2, {0: p}, [1], [4], req="req-after-uninstall")
    return {"during_handshake": during, "restored_after_handshake": after,
            "restored_after_uninstall": uninstalled, "patched": res["results"],
            "after_uninstall": {"results": res2["results"],
                                "handshake_errors": res2["handshake_errors"]},
            "status": installer.status()["patches"]["kv_segments"]["status"]}


def scenario_restore() -> dict[str, Any]:
    """0.33+ sleep/wake: ``restore_kv_caches`` re-encodes the metadata through vLLM's class; the
    advertisement must survive it."""
    _reset()
    p = build("prefill", "kv_producer", P_BACKEND, num_blocks=12, seed=1)

    def keys() -> list[str]:
        return sorted(msgspec.msgpack.decode(
            p.worker.xfer_handshake_metadata.agent_metadata_bytes))

    before = keys()
    p.worker.unregister_kv_caches()
    p.worker.restore_kv_caches()
    return {"before": "pdpatch_kv_geometry" in before,
            "after": "pdpatch_kv_geometry" in keys(), "same_keys": before == keys()}


SCENARIOS = {
    "restore": scenario_restore,
    "pair": scenario_pair,
    "pair_reverse": lambda: scenario_pair(D_BACKEND, P_BACKEND),
    "pair_same": lambda: scenario_pair(P_BACKEND, P_BACKEND),
    "pair_unstaged": scenario_pair_unstaged,
    # same-layout peers with PDPATCH_KV_COALESCE (opt-in): P's adjacent blocks into D's
    # blocks apart (what NIXL cannot merge), TP both ways, a READ larger than 1 MiB of staging
    "pair_coalesced": coalesced(
        lambda: scenario_pair(P_BACKEND, P_BACKEND, d_blocks=(1, 3, 5))),
    # D's head of each of P's blocks: merged only by gap reads, across the other head's bytes
    "tp_up_coalesced": coalesced(lambda: scenario_tp_up(P_BACKEND), {"PDPATCH_KV_GAP_KIB": "1024"}),
    "tp_down_coalesced": coalesced(lambda: scenario_tp_down(P_BACKEND)),
    # D's head of nine of P's 256-token blocks (1.125 MiB a rank) through 1 MiB of staging:
    # the gap READ in chunks
    "tp_up_coalesced_chunked": coalesced(
        lambda: scenario_tp_up(P_BACKEND, block_size=256, d_blocks=tuple(range(1, 10)),
                               p_blocks=tuple(range(2, 11))),
        {"PDPATCH_KV_STAGING_MIB": "1", "PDPATCH_KV_GAP_KIB": "1024"}),
    "pair_coalesced_chunked": coalesced(
        lambda: scenario_pair(P_BACKEND, P_BACKEND, block_size=256, p_blocks=(2, 3, 4, 5, 6, 7),
                              d_blocks=(0, 2, 4, 6, 8, 1)),
        {"PDPATCH_KV_STAGING_MIB": "1", "PDPATCH_KV_GAP_KIB": "0"}),
    "pair_gap": scenario_pair_gap,
    "pair_chunked": scenario_pair_chunked,
    "pair_no_enforce": lambda: scenario_pair(
        d_extra={"enforce_handshake_compat": False}),
    # CPU attention wants blocks of a multiple of 32 tokens from 0.23
    "pair_cpu": lambda: scenario_pair("CPU_ATTN", P_BACKEND, block_size=32),
    "pair_reorder": lambda: scenario_pair_reorder({"PDPATCH_LAYOUT_FORCE": "1"}),
    "pair_reorder_off": lambda: scenario_pair_reorder(
        {"PDPATCH_LAYOUT_FORCE": "1", "PDPATCH_LAYOUT_PERMUTE": "0"}),
    # the operator's own enable_permute_local_kv, same backend on both sides (stock vLLM)
    "pair_reorder_same": lambda: scenario_pair_reorder({}, P_BACKEND, permute=True),
    # the same backend on both sides with D's blocks twice P's (16 -> 32 tokens): vLLM's block
    # size and layout post-processing at once, turned on by pdpatch or by the operator
    "pair_reorder_ratio": lambda: scenario_pair_reorder({"PDPATCH_LAYOUT_FORCE": "1"},
                                                        P_BACKEND, d_block_size=32),
    "pair_reorder_ratio_same": lambda: scenario_pair_reorder({}, P_BACKEND, permute=True,
                                                             d_block_size=32),
    "pair_reorder_ratio_fused": lambda: scenario_pair_reorder(
        {"PDPATCH_LAYOUT_FORCE": "1"}, D_BACKEND, d_block_size=32, p_backend=D_BACKEND),
    "layer_order": scenario_layer_order,
    "layer_order_same": lambda: scenario_layer_order(reverse_p=False),
    "layer_order_no_enforce": lambda: scenario_layer_order(
        d_extra={"enforce_handshake_compat": False}),
    "readd_known_rank": scenario_readd_known_rank,
    "readd_known_rank_coalesced": coalesced(lambda: scenario_readd_known_rank(coalesce=True)),
    "tp_up": scenario_tp_up,
    "tp_down": scenario_tp_down,
    # head-major P, token-major D (kvcached's layout, forced by pdpatch) with TP on either side
    "tp_up_reorder": lambda: scenario_tp_up(reorder={"PDPATCH_LAYOUT_FORCE": "1"}),
    "tp_down_reorder": lambda: scenario_tp_down(reorder={"PDPATCH_LAYOUT_FORCE": "1"}),
    "block_ratio": scenario_block_ratio,
    "block_ratio_reverse": lambda: scenario_block_ratio(D_BACKEND, P_BACKEND),
    "block_ratio_same_split": lambda: scenario_block_ratio(P_BACKEND, P_BACKEND),
    "block_ratio_same_fused": lambda: scenario_block_ratio(D_BACKEND, D_BACKEND),
    "span_advertised": scenario_span_mismatch,
    "span_stock_fields": lambda: scenario_span_mismatch("stock"),
    "advert_ignored": scenario_advert_ignored,
    "globals": scenario_globals,
}


def release_report(stock: list[str], patched: list[str]) -> dict[str, Any]:
    """Run ``stock`` scenarios on unpatched vLLM, then install pdpatch and run ``patched``."""
    from pdpatch import installer

    report: dict[str, Any] = {"stock": {n: safe(SCENARIOS[n]) for n in stock}}
    installer.install()
    report["summary"] = installer.summary_line()
    report["patched"] = {n: safe(SCENARIOS[n]) for n in patched}
    join_listeners()
    return report
