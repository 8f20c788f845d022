#!/usr/bin/env python
"""KV over real NIXL between two processes: fused<->fused, split->fused, fused->split, planned by
pdpatch's own code (the PairPlan tables and desc ids the patches use inside vLLM), on GPU
(cudaMalloc pools and real kvcached VMM pools) or on host memory (``--device cpu``, what CI runs).

Per block size (16-256 KiB per [K|V] block) and request pattern (scattered blocks, runs of 4/16
consecutive blocks) it times, against the fused path of the same run:

* ``fused<-fused merged``  -- the fused path: ids ordered by local address so NIXL merges every
  run (one descriptor per run and layer); the baseline of every ratio;
* ``... vllm-ids``         -- the desc ids exactly as vLLM orders them (region-major);
* ``split->fused`` / ``fused->split`` with ``vllm-ids`` (what the conversion patch does now: one
  descriptor per block segment), ``merged`` (NIXL merging can do nothing here) and ``staged``
  (pdpatch.kv.stage: transfer into a staging buffer in remote order, so remote-contiguous runs
  are one descriptor, then one local copy kernel);

with bytes checked exactly after every repetition (independent oracle: logical K/V views of the
allocator's own tensors, seeded content regenerated on the other side; untouched blocks must
keep their poison), NIXL's ``descCount``, GB/s, and a plain device copy of the same bytes.
It also proves the kvcached registration policy (registration sliced to the planned blocks: a
descriptor past the plan fails that request with NIXL_ERR_NOT_FOUND, the peer lives on, while a
whole-storage registration silently reads zero-page bytes) and records what
:mod:`pdpatch.transport` says about each pool.

Run on the GPU machine: ``python3 scripts/gpu_kv_bench.py --device cuda --json out.json``;
on CPU: ``.venv/bin/python scripts/gpu_kv_bench.py --device cpu --quick``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(sys.path[0], "lab"))

from kv_reference import (
    coalesce,
    nixl_merged_count,
    split_staged,
    stage,
    stage_ids,
    whole_blocks,
)
from pdpatch.kv import (
    BlockIdError,
    KVGeometry,
    PairPlan,
    infer_geometry,
    tensor_info,
)
from pdpatch.kv.stage import CopyPlan, TransportCost, staging_table
from pdpatch.kv.staging import ByteCopier, StagingAgent
from pdpatch.transport import check_transport, cuda_context_current, probe_memory

POISON = 0x5A
HEADS, HEAD_DIM, ES = 8, 128, 2  # bf16; one token of K = 2 KiB
CHUNK = 64 * 1024  # max bytes per copy-kernel thread block


# ============================================================================ pools
@dataclass
class Pool:
    """One side's KV memory for ``layers`` layers of ``num_blocks`` planned blocks."""

    name: str
    kind: str  # host | cuda | kvcached
    layout: str  # fused | split
    tensors: list  # per-layer torch tensors in the allocator's (vLLM) shape
    num_blocks: int
    seg: int  # bytes of one K (or V) segment
    geometry: KVGeometry
    arenas: list  # (base address, flat uint8 tensor) covering every planned byte
    mem: str  # DRAM | VRAM
    whole: tuple[int, int]  # (start, length) of the whole storage (what stock registers)
    keep: list = field(default_factory=list)

    def logical(self, layer: int):
        """uint8 view (planned blocks, 2 [K, V], seg bytes) of one layer, from the tensor's own
        shape and strides -- the oracle never uses pdpatch's geometry."""
        t = self.tensors[layer]
        if self.layout == "split" and self.kind != "kvcached":
            t = t.transpose(0, 1)  # (2, N, ...) -> (N, 2, ...)
        u = t.view(_torch().uint8)  # last dim D*2 bytes
        return u[: self.num_blocks].view(self.num_blocks, 2, self.seg)


def _torch():
    import torch

    return torch


def _dev(device: str):
    return _torch().device("cuda:0" if device == "cuda" else "cpu")


def make_pool(name: str, kind: str, layout: str, layers: int, num_blocks: int, block_bytes: int,
              device: str) -> Pool:
    torch = _torch()
    bs = block_bytes // 2 // (HEADS * HEAD_DIM * ES)
    if bs < 1 or bs * HEADS * HEAD_DIM * ES * 2 != block_bytes:
        raise ValueError(f"block of {block_bytes} B is not whole tokens of {HEADS}x{HEAD_DIM}")
    seg = block_bytes // 2
    if kind == "kvcached":
        return _kvcached_pool(name, layout, layers, num_blocks, bs, seg)
    per_layer = num_blocks * block_bytes
    flat = torch.empty(layers * per_layer + 512, dtype=torch.uint8, device=_dev(device))
    off = (-flat.data_ptr()) % 512
    flat = flat[off: off + layers * per_layer]
    bf = flat.view(torch.bfloat16)
    seg_e = seg // ES
    tensors = []
    for layer in range(layers):
        start = layer * per_layer // ES
        if layout == "fused":
            shape = (num_blocks, 2, bs, HEADS, HEAD_DIM)
            stride = (2 * seg_e, seg_e, HEADS * HEAD_DIM, HEAD_DIM, 1)
        else:
            shape = (2, num_blocks, bs, HEADS, HEAD_DIM)
            stride = (num_blocks * seg_e, seg_e, HEADS * HEAD_DIM, HEAD_DIM, 1)
        # as_strided offsets count from the storage, not from the (aligned) slice
        tensors.append(torch.as_strided(bf, shape, stride,
                                        storage_offset=bf.storage_offset() + start))
    geo = infer_geometry([tensor_info(t) for t in tensors], num_blocks=num_blocks,
                         kv_dim=1 if layout == "fused" else 0, label=name)
    return Pool(name, "host" if device == "cpu" else "cuda", layout, tensors, num_blocks, seg,
                geo, [(flat.data_ptr(), flat)], "DRAM" if device == "cpu" else "VRAM",
                (flat.data_ptr(), flat.numel()), [flat])


def _kvcached_pool(name: str, layout: str, layers: int, num_blocks: int, bs: int,
                   seg: int) -> Pool:
    """Real kvcached 0.1.6 memory (CUDA VMM): fused = its contiguous layout ([layer][K|V] per
    block, all layers in one FTensor), split = its split-half layout (K and V half a pool apart).
    The layout is process-wide (KVCACHED_CONTIGUOUS_LAYOUT, read at import)."""
    torch = _torch()
    want = "true" if layout == "fused" else "false"
    if os.environ.get("KVCACHED_CONTIGUOUS_LAYOUT") != want:
        raise RuntimeError(f"kvcached {layout} pool needs KVCACHED_CONTIGUOUS_LAYOUT={want}")
    from kvcached.integration.vllm import interfaces as kvi
    from kvcached.utils import PAGE_SIZE
    from kvcached.vmm_ops import map_to_kv_tensors

    kvi.init_kvcached(tp_rank=0, world_size=1, is_worker=True, device="cuda:0")
    tensors, meta = kvi.alloc_kv_cache((num_blocks, 2, bs, HEADS, HEAD_DIM), bs, torch.bfloat16,
                                       "cuda:0", layers, return_meta=True)
    raw = meta["raw_kv_tensors"]
    if layout == "fused":
        compound = PAGE_SIZE * layers * 2
        need = num_blocks * layers * 2 * seg
        offsets = [i * compound for i in range(math.ceil(need / compound))]
    else:
        offsets = [i * PAGE_SIZE for i in range(math.ceil(num_blocks * seg / PAGE_SIZE))]
    if not map_to_kv_tensors(offsets):
        raise RuntimeError("kvcached map_to_kv_tensors failed")
    geo = infer_geometry([tensor_info(t) for t in tensors], num_blocks=num_blocks, kv_dim=1,
                         label=name)
    arenas = []
    for t in raw:
        flat = t.view(torch.uint8).view(-1)
        arenas.append((flat.data_ptr(), flat))
    whole = (raw[0].data_ptr(), raw[0].numel() * raw[0].element_size())
    return Pool(name, "kvcached", layout, list(tensors), num_blocks, seg, geo, arenas, "VRAM",
                whole, [tensors, meta])


def layer_content(seed: int, layer: int, num_blocks: int, seg: int, device: str):
    """The seeded bytes of one layer, (N, 2, seg) uint8; identical in every process."""
    torch = _torch()
    g = torch.Generator(device=_dev(device))
    g.manual_seed(seed * 1009 + layer)
    return torch.randint(0, 256, (num_blocks, 2, seg), generator=g, dtype=torch.uint8,
                         device=_dev(device))


def fill(pool: Pool, seed: int, device: str) -> None:
    for layer in range(len(pool.tensors)):
        lv = pool.logical(layer)
        lv.copy_(layer_content(seed, layer, pool.num_blocks, pool.seg, device))
    for layer in range(len(pool.tensors)):  # read back: catches aliased (unmapped) pages
        if not _torch().equal(pool.logical(layer),
                              layer_content(seed, layer, pool.num_blocks, pool.seg, device)):
            raise RuntimeError(f"{pool.name}: content does not read back (aliased pages?)")


def poison(pool: Pool) -> None:
    for layer in range(len(pool.tensors)):
        pool.logical(layer).fill_(POISON)


def check_blocks(pool: Pool, ids: np.ndarray, expected: list, other_value: Any) -> str | None:
    """None when pool blocks ``ids`` hold ``expected[layer]`` (N_req, 2, seg) and every other
    planned block equals ``other_value`` (POISON, or a list of per-layer full contents)."""
    torch = _torch()
    dev = pool.logical(0).device
    idx = torch.as_tensor(ids, dtype=torch.long, device=dev)
    mask = torch.ones(pool.num_blocks, dtype=torch.bool, device=dev)
    mask[idx] = False
    for layer in range(len(pool.tensors)):
        lv = pool.logical(layer)
        if not torch.equal(lv[idx], expected[layer]):
            bad = int((lv[idx] != expected[layer]).sum())
            return f"layer {layer}: {bad} requested bytes differ"
        rest = lv[mask]
        if isinstance(other_value, list):
            ok = torch.equal(rest, other_value[layer][mask])
        else:
            ok = bool((rest == other_value).all())
        if not ok:
            return f"layer {layer}: bytes outside the request changed"
    return None


# ============================================================================ local copies
_KERNEL = r"""
extern "C" __global__ void pd_copy(const unsigned long long* __restrict__ d, int n) {
    int c = blockIdx.x;
    if (c >= n) return;
    unsigned long long s = d[c], t = d[n + c], len = d[2 * n + c];
    if (((s | t | len) & 15ULL) == 0ULL) {
        const uint4* sp = (const uint4*)s; uint4* tp = (uint4*)t;
        unsigned long long nv = len >> 4, i = threadIdx.x, step = blockDim.x;
        for (; i + 3 * step < nv; i += 4 * step) {  // four 16-byte loads in flight
            uint4 a = sp[i], b = sp[i + step], c2 = sp[i + 2 * step], e = sp[i + 3 * step];
            tp[i] = a; tp[i + step] = b; tp[i + 2 * step] = c2; tp[i + 3 * step] = e;
        }
        for (; i < nv; i += step) tp[i] = sp[i];
    } else {
        const unsigned char* sp = (const unsigned char*)s; unsigned char* tp = (unsigned char*)t;
        for (unsigned long long i = threadIdx.x; i < len; i += blockDim.x) tp[i] = sp[i];
    }
}
"""


class CupyCopier:
    """One kernel launch per CopyPlan: a thread block per chunk, 16-byte vectors; the chunk
    size and block size are picked by :meth:`tune` on the device."""

    name = "cupy-kernel"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.kernel = cupy.RawKernel(_KERNEL, "pd_copy")
        # not the legacy default stream, which would wait for UCX's copies in flight
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.chunk, self.threads = CHUNK, 256
        self.tuning: dict[str, float] = {}

    def tune(self, nbytes: int = 256 << 20, seg: int = 64 << 10) -> dict:
        """GB/s of a scattered segment copy per (chunk, threads), beside torch copy_ of the
        same bytes; keeps the fastest configuration."""
        torch = _torch()
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros_like(src)
        n = nbytes // seg
        perm = np.random.default_rng(0).permutation(n).astype(np.uint64)
        plan = CopyPlan(np.uint64(src.data_ptr()) + perm * np.uint64(seg),
                        np.uint64(dst.data_ptr()) + np.arange(n, dtype=np.uint64) * np.uint64(seg),
                        np.full(n, seg, dtype=np.uint64))

        def timeit(fn) -> float:
            fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            return nbytes / best / 1e9

        self.tuning = {"torch copy_ (flat)": timeit(lambda: dst.copy_(src))}
        best = (0.0, self.chunk, self.threads)
        for chunk in (32 << 10, 64 << 10, 256 << 10):
            for threads in (256, 512):
                self.chunk, self.threads = chunk, threads
                prepared = self.prepare(plan)  # built while NIXL moves the bytes: not timed
                gbs = timeit(lambda p=prepared: self.launch(p))
                self.tuning[f"kernel chunk {chunk >> 10} KiB x {threads} threads"] = gbs
                best = max(best, (gbs, chunk, threads))
        _, self.chunk, self.threads = best
        ok = torch.equal(dst.view(n, seg)[torch.as_tensor(np.arange(n))],
                         src.view(n, seg)[torch.as_tensor(perm.astype(np.int64))])
        self.tuning["byte-exact"] = ok
        return self.tuning

    def prepare(self, plan: CopyPlan) -> tuple[Any, int]:
        """The chunk table, uploaded on the copier's stream: host work a READ does while NIXL
        still moves the bytes."""
        ch = plan.chunks(self.chunk)
        n = len(ch)
        if not n:
            return None, 0
        with self.stream:
            return self.cp.asarray(np.concatenate([ch.src, ch.dst, ch.length])
                                   .astype(np.uint64)), n

    def launch(self, prepared: tuple[Any, int], sync: bool = True) -> None:
        arr, n = prepared
        if n:
            with self.stream:
                self.kernel((n,), (self.threads,), (arr, np.int32(n)))
        if sync:
            self.sync()

    def run(self, plan: CopyPlan, sync: bool = True) -> None:
        self.launch(self.prepare(plan), sync)

    def sync(self) -> None:
        self.stream.synchronize()


# ============================================================================ NIXL
def new_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    # as vLLM 0.33 builds it: UCX, num_threads=4, telemetry on
    return nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))


def register(agent, ranges, mem: str):
    return agent.register_memory([(int(s), int(e - s), 0, "") for s, e in ranges], mem)


def wait(agent, handle, timeout: float = 120.0) -> str:
    """Post ``handle`` and poll it to the end."""
    return poll(agent, handle, agent.transfer(handle), timeout)


def poll(agent, handle, state: str, timeout: float = 120.0) -> str:
    """Poll a posted transfer from its ``state`` at posting to the end."""
    deadline = time.monotonic() + timeout
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        if time.monotonic() > deadline:
            return "TIMEOUT"
    return state


@dataclass
class AgentRun:
    """The repetitions of one READ through the staging agent (see ``Bench.timed_agent``)."""

    times: list[float]
    count: int                 # NIXL's descCount of the last repetition
    copy_times: list[float]
    err: str | None
    expect: int                # the descCount the agent predicted
    plan_s: float              # best time to plan and post
    staged: bool
    wire: int                  # bytes read per READ, gaps included
    gap: int                   # the gap budget the agent measured (0: none)
    phases_ms: list[float] | None = None   # of the best repetition, see timed_agent


class Clock:
    """The NIXL agent as the staging agent sees it, noting when NIXL itself returned from
    ``transfer`` and first answered DONE: the bench's view inside one staged READ."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self.posted: dict = {}
        self.landed: dict = {}

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def transfer(self, handle, *args, **kwargs):
        state = self._agent.transfer(handle, *args, **kwargs)
        self.posted[handle] = time.perf_counter()
        return state

    def check_xfer_state(self, handle):
        state = self._agent.check_xfer_state(handle)
        if state == "DONE" and handle not in self.landed:
            self.landed[handle] = time.perf_counter()
        return state


# ============================================================================ peer process
def peer_main(conn, name: str, device: str, env: dict) -> None:
    os.environ.update(env)
    try:
        if device == "cuda" and os.environ.get("PDPATCH_BENCH_NO_CTX") != "1":
            _torch().zeros(1, device="cuda:0")  # a CUDA context before UCX starts
            _torch().cuda.synchronize()
        agent = new_agent(name)
        pools: dict[str, Pool] = {}
        regs: dict[str, Any] = {}
        seeds: dict[str, int] = {}
        cache: dict[tuple, list] = {}
    except Exception:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", name))
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "pool":  # name, kind, layout, layers, blocks, block_bytes, seed, reg[, plan]
                pname, kind, layout, layers, blocks, bbytes, seed, reg, *plan = args
                if pname in regs:
                    agent.deregister_memory(regs.pop(pname))
                pools.pop(pname, None)
                pool = make_pool(pname, kind, layout, layers, blocks, bbytes, device)
                fill(pool, seed, device)
                if plan:  # plan fewer blocks than the pool holds (over-allocation stand-in)
                    pool.geometry = pool.geometry.with_num_blocks(int(plan[0]))
                pools[pname], seeds[pname] = pool, seed
                ranges = (pool.geometry.registration_ranges() if reg == "sliced"
                          else [(pool.whole[0], pool.whole[0] + pool.whole[1])])
                t0 = time.perf_counter()
                regs[pname] = register(agent, ranges, pool.mem)
                t_reg = time.perf_counter() - t0
                facts = probe_memory(pool.geometry.layers[0].base, pname)
                conn.send(("ok", {
                    "geometry": pool.geometry.to_wire(), "md": agent.get_agent_metadata(),
                    "ranges": ranges, "reg_s": t_reg, "facts": facts.__dict__,
                }))
            elif cmd == "reregister":
                pname, reg = args
                pool = pools[pname]
                agent.deregister_memory(regs.pop(pname))
                ranges = (pool.geometry.registration_ranges() if reg == "sliced"
                          else [(pool.whole[0], pool.whole[0] + pool.whole[1])])
                t0 = time.perf_counter()
                regs[pname] = register(agent, ranges, pool.mem)
                conn.send(("ok", {"md": agent.get_agent_metadata(), "ranges": ranges,
                                  "reg_s": time.perf_counter() - t0}))
            elif cmd == "refill":
                fill(pools[args[0]], seeds[args[0]], device)
                conn.send(("ok", True))
            elif cmd == "check_write":  # pool, remote ids (here), source seed, source ids
                pname, ids, src_seed, src_ids = args
                pool = pools[pname]
                key = (pname, src_seed, tuple(src_ids[:4]), len(src_ids))
                if key not in cache:
                    dev = pool.logical(0).device
                    sidx = _torch().as_tensor(src_ids, dtype=_torch().long, device=dev)
                    cache.clear()
                    cache[key] = [layer_content(src_seed, la, pool.num_blocks, pool.seg,
                                                device)[sidx] for la in range(len(pool.tensors))]
                own = [layer_content(seeds[pname], la, pool.num_blocks, pool.seg, device)
                       for la in range(len(pool.tensors))]
                conn.send(("ok", check_blocks(pool, np.asarray(ids), cache[key], own)))
            elif cmd == "ping":
                conn.send(("ok", os.getpid()))
            elif cmd == "drop":
                for pname in list(pools):
                    if pname in regs:
                        agent.deregister_memory(regs.pop(pname))
                pools.clear()
                cache.clear()
                if device == "cuda":
                    _torch().cuda.empty_cache()
                conn.send(("ok", True))
            elif cmd == "quit":
                conn.send(("ok", True))
                return
            else:
                conn.send(("err", f"unknown command {cmd!r}"))
        except Exception:
            conn.send(("err", traceback.format_exc()))


class Peer:
    def __init__(self, name: str, device: str, env: dict | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=peer_main, args=(child, name, device, env or {}),
                                daemon=True)
        self.proc.start()
        self.call_raw()

    def call_raw(self, timeout: float = 600.0):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name} did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer {self.name}: {value}")
        return value

    def call(self, *msg, timeout: float = 600.0):
        self.conn.send(msg)
        return self.call_raw(timeout)

    def alive(self) -> bool:
        if not self.proc.is_alive():
            return False
        try:
            return self.call("ping", timeout=30) > 0
        except Exception:
            return False

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("quit", timeout=30)
        except Exception:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ============================================================================ initiator
def requests(pattern: str, num_blocks: int, n_req: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """``scattered``: n_req random blocks (half the pool by default); ``sparse``: a quarter of
    that (1 block in 8); ``runsK``: runs of K consecutive blocks at random aligned starts."""
    if pattern in ("scattered", "sparse"):
        n = n_req if pattern == "scattered" else max(n_req // 4, 1)
        return (rng.choice(num_blocks, n, replace=False),
                rng.choice(num_blocks, n, replace=False))
    k = int(pattern.removeprefix("runs"))
    slots = num_blocks // k

    def side():
        starts = rng.choice(slots, n_req // k, replace=False) * k
        return np.concatenate([np.arange(s, s + k) for s in starts])

    return side(), side()


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.device = args.device
        self.ctx_at_agent = cuda_context_current()
        self.agent = new_agent("pdpatch-bench-init")
        self.results: list[dict] = []
        self.peers: dict[str, Peer] = {}
        self.known: dict[str, bool] = {}
        self.copiers: dict[str, Any] = {}
        self.notes: list[str] = []
        self.copy_tuning: dict = {}

    def sync(self) -> None:
        if self.device == "cuda":
            _torch().cuda.synchronize()

    def peer(self, name: str, env: dict | None = None) -> Peer:
        if name not in self.peers:
            self.peers[name] = Peer(name, self.device, env)
        return self.peers[name]

    def add_remote(self, peer: Peer, md: bytes) -> None:
        if self.known.get(peer.name):
            self.agent.remove_remote_agent(peer.name)
        self.agent.add_remote_agent(md)
        self.known[peer.name] = True

    def copier(self, arenas: list, kind: str):
        if kind == "cupy":
            if "cupy" not in self.copiers:
                try:
                    self.copiers["cupy"] = CupyCopier()
                    self.copy_tuning = self.copiers["cupy"].tune()
                    print(f"   copy kernel tuning (GB/s): {self.copy_tuning}", flush=True)
                except Exception as e:  # fall back, and say so
                    self.notes.append(f"cupy copy kernel unavailable ({e!r}); torch-index used")
                    self.copiers["cupy"] = None
            if self.copiers["cupy"] is not None:
                return self.copiers["cupy"]
        return ByteCopier(arenas)

    # ---------------------------------------------------------------- one transfer, timed
    def timed(self, op: str, dlists, lidx, ridx, copies: CopyPlan | None, copier,
              before, after) -> tuple[list[float], int, list[float], str | None]:
        """Repetitions of one transfer.  ``dlists()`` gives the local and remote dlist handles
        of a repetition and a function that releases them: tables prepared once (vLLM's form)
        or per-request lists, whose preparation is then inside the timing."""
        times, copy_times, count, err = [], [], 0, None
        for _ in range(self.args.reps):
            before()
            self.sync()
            t0 = time.perf_counter()
            if copies is not None and op == "WRITE":
                copier.run(copies)
            tc = time.perf_counter()
            lh, rh, release = dlists()
            h = self.agent.make_prepped_xfer(op, lh, lidx, rh, ridx)
            state, pending = self._read_then_copy(h, op, copies, copier)
            tx = time.perf_counter()
            if pending is not None:
                copier.launch(pending)
            tcopy = time.perf_counter()
            count = int(self.agent.get_xfer_telemetry(h).descCount)
            self.agent.release_xfer_handle(h)
            release()
            t1 = time.perf_counter()
            if state != "DONE":
                err = f"transfer state {state}"
            times.append(t1 - t0)
            copy_times.append((tc - t0) + (tcopy - tx))
            err = err or after()
            if err:
                break
        return times, count, copy_times, err

    # ---------------------------------------------------------------- a block size
    def run_block_size(self, pool_kind: str, block_bytes: int, cases: list[tuple[str, str]],
                       patterns: list[str], ops: list[str], remote_kind: str | None = None,
                       remote_env: dict | None = None, local_kinds: dict | None = None) -> None:
        torch = _torch()
        a = self.args
        L = a.layers
        N = max(a.pool_mib * 2**20 // (L * block_bytes), 8)
        n_req = max(int(N * a.request_frac), 1)
        seg = block_bytes // 2
        remote_kind = remote_kind or pool_kind
        local_kinds = local_kinds or {}
        tag = f"{pool_kind} {block_bytes // 1024} KiB"
        print(f"\n== {tag}: {L} layers x {N} blocks per pool, requests of {n_req} blocks "
              f"({n_req * L * block_bytes / 2**20:.0f} MiB)", flush=True)
        layouts_r = sorted({r for _, r in cases})
        layouts_l = sorted({lo for lo, _ in cases})
        # remote pools, one peer per remote layout when kvcached (its layout is process-wide)
        rinfo: dict[str, dict] = {}
        rpeer: dict[str, Peer] = {}
        for lay in layouts_r:
            pname = f"remote-{lay}"
            env = dict(remote_env or {})
            if remote_kind == "kvcached":
                env["KVCACHED_CONTIGUOUS_LAYOUT"] = "true" if lay == "fused" else "false"
                peer = self.peer(f"peer-kvcached-{lay}", env)
            else:
                peer = self.peer("peer-main", env)
            info = peer.call("pool", pname, remote_kind, lay, L, N, block_bytes,
                             1000 + block_bytes // 1024 + (7 if lay == "split" else 0), "sliced")
            self.add_remote(peer, info["md"])
            rinfo[lay], rpeer[lay] = info, peer
        rgeo = {lay: KVGeometry.from_wire(i["geometry"], label=f"remote-{lay}")
                for lay, i in rinfo.items()}
        rseed = {lay: 1000 + block_bytes // 1024 + (7 if lay == "split" else 0)
                 for lay in layouts_r}
        # local pools + staging
        lpools: dict[str, Pool] = {}
        lregs = []
        for lay in layouts_l:
            kind = local_kinds.get(lay, pool_kind)
            lpools[lay] = make_pool(f"local-{lay}", kind, lay, L, N, block_bytes, self.device)
            lregs.append(register(self.agent, lpools[lay].geometry.registration_ranges(),
                                  lpools[lay].mem))
        slots = 2 * L * n_req
        # room for the request, and for gap reads (at most the whole remote pool)
        st_bytes = max(slots * seg, L * N * block_bytes if a.gap_kib != 0 else 0)
        staging = torch.empty(st_bytes + 512, dtype=torch.uint8, device=_dev(self.device))
        st_off = (-staging.data_ptr()) % 512
        staging = staging[st_off: st_off + st_bytes]
        st_base = staging.data_ptr()
        st_mem = "DRAM" if self.device == "cpu" else "VRAM"
        lregs.append(register(self.agent, [(st_base, st_base + st_bytes)], st_mem))
        sth = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                         staging_table(st_base, seg, slots), st_mem)
        arenas = [(st_base, staging)] + [ar for p in lpools.values() for ar in p.arenas]
        # mirrors of the remote contents for the READ oracle
        mirror = {lay: [layer_content(rseed[lay], la, N, seg, self.device) for la in range(L)]
                  for lay in layouts_r}
        # device-copy ceiling: the same bytes, one flat copy
        nbytes = n_req * L * block_bytes
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=_dev(self.device))
        dst = torch.empty_like(src)
        ct = []
        for _ in range(max(a.reps, 5)):
            self.sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            self.sync()
            ct.append(time.perf_counter() - t0)
        assert torch.equal(dst, src)
        d2d = nbytes / min(ct) / 1e9
        del src, dst
        print(f"   plain device copy of the same bytes: {d2d:8.1f} GB/s", flush=True)
        self.results.append({"pool": tag, "pool_kind": pool_kind, "block_kib": block_bytes // 1024,
                             "case": "device copy", "mode": "torch copy_", "gbs": d2d,
                             "bytes": nbytes, "ok": True})
        gap = self.gap_for(lpools, rgeo, rpeer)
        rng = np.random.default_rng(block_bytes)
        for pattern in patterns:
            k = 1 if pattern in ("scattered", "sparse") else int(pattern.removeprefix("runs"))
            if 4 * k > N or n_req < k:
                continue
            lids, rids = requests(pattern, N, n_req - n_req % k, rng)
            base_gbs: dict[str, float] = {}
            for op in ops:
                for lay_l, lay_r in cases:
                    self.run_case(op, pattern, tag, pool_kind, remote_kind, block_bytes,
                                  lpools[lay_l], rgeo[lay_r], rpeer[lay_r], f"remote-{lay_r}",
                                  mirror[lay_r], lids, rids, st_base, slots, sth, arenas, d2d,
                                  base_gbs, st_bytes, gap)
        self.agent.release_dlist_handle(sth)
        for r in lregs:
            self.agent.deregister_memory(r)
        for peer in set(rpeer.values()):
            peer.call("drop")
        del lpools, mirror, staging, arenas
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def gap_for(self, lpools: dict[str, Pool], rgeo: dict[str, KVGeometry],
                rpeer: dict[str, Peer]) -> int:
        """The max gap of staged+gap READs: ``--gap-kib`` when given, else the budget of this
        transport measured now (two fused READs: one descriptor per isolated block, then one
        descriptor per layer over the same bytes' worth of pool)."""
        a = self.args
        if a.gap_kib is not None:
            return a.gap_kib * 1024
        if "fused" not in lpools or "fused" not in rgeo:
            return 0
        lp, rg, peer = lpools["fused"], rgeo["fused"], rpeer["fused"]
        wp = PairPlan(whole_blocks(lp.geometry), whole_blocks(rg))
        half = max(lp.num_blocks // 2, 1)
        spaced = np.arange(0, 2 * half, 2)
        many = wp.descs(spaced, spaced)
        one = coalesce(wp.descs(np.arange(half), np.arange(half)))
        timings = []
        for plan in (many, one):
            lists = (plan.local_nx3(), plan.remote_nx3())
            times, _, _, err = self.timed_lists("READ", lp.mem, peer.name, lists, None, None,
                                                lambda: None, lambda: None)
            if err:
                raise RuntimeError(f"gap calibration READ failed: {err}")
            timings.append((len(plan), int(plan.length.sum()), min(times)))
        try:
            cost = TransportCost.from_timings(*timings)
        except ValueError as e:  # noise can defeat the model: then no gap reads, and say so
            self.notes.append(f"{lp.geometry.label}: gap calibration failed ({e}); no gap reads")
            return 0
        gap = cost.gap_budget()
        print(f"   transport calibration: {cost.desc_cost_s * 1e6:.2f} us per descriptor, "
              f"{cost.bandwidth_bps / 1e9:.1f} GB/s -> gap budget {gap / 1024:.0f} KiB",
              flush=True)
        self.notes.append(f"{lp.geometry.label}: {cost} gap budget {gap} B")
        return gap

    def run_case(self, op, pattern, tag, pool_kind, remote_kind, block_bytes, lp: Pool,
                 rg: KVGeometry, peer: Peer, rname, mirror, lids, rids, st_base, slots, sth,
                 arenas, d2d, base_gbs, st_bytes, gap_bytes: int) -> None:
        """All modes of one (local layout <- remote layout) case for one request."""
        a = self.args
        L, N, seg = len(lp.tensors), lp.num_blocks, lp.seg
        pair = PairPlan(lp.geometry, rg)
        fused_pair = lp.layout == "fused" and rg.kind == "fused"
        case = (f"{lp.layout}<-{rg.kind}" if op == "READ" else f"{lp.layout}->{rg.kind}")
        modes: list[tuple[str, Any]] = []
        if fused_pair:
            modes.append(("whole-blocks", None))  # the fused path: baseline of every ratio
        modes.append(("vllm-ids", None))
        if fused_pair:
            modes.append(("coalesced", None))
        if pair.converts and op == "READ":
            modes.append(("vllm-agent", None))  # what the kv_segments patch runs inside vLLM
            if a.gap_kib != 0:                  # ... with its gap reads (vLLM's default)
                modes.append(("vllm-agent+gap", None))
        if pair.converts:
            modes += [(f"staged/{c}", c) for c in a.executors]
            if rg.kind == "split":
                modes.append((f"staged-ids/{a.executors[0]}", a.executors[0]))
        if pair.converts and a.pipe > 1:
            modes.append((f"staged-pipe/{a.executors[0]}", a.executors[0]))
        if op == "READ" and gap_bytes > 0 and (pair.converts or fused_pair):
            modes.append((f"staged+gap/{a.executors[0]}", a.executors[0]))
            if a.pipe > 1:
                modes.append((f"staged-pipe+gap/{a.executors[0]}", a.executors[0]))
        before, after = self._hooks(op, lp, peer, rname, lids, rids, mirror, L, N, seg)
        st_table = staging_table(st_base, seg, slots)
        for mode, executor in modes:
            copies, copier, per_request = None, None, None
            wire = len(lids) * L * 2 * seg
            t0 = time.perf_counter()
            if mode == "whole-blocks":
                wp = PairPlan(whole_blocks(lp.geometry), whole_blocks(rg))
                lt, rt = wp.local_table(), wp.remote_table()
                li, ri = wp.desc_ids(lids, rids)
            elif mode == "vllm-ids":
                lt, rt = pair.local_table(), pair.remote_table()
                li, ri = pair.desc_ids(lids, rids)
            elif mode.startswith("vllm-agent"):
                pass  # the agent plans each request itself (timed)
            elif mode == "coalesced":
                c = coalesce(pair.descs(lids, rids))
                per_request = (c.local_nx3(), c.remote_nx3())
            elif mode.startswith("staged-ids"):
                lt, rt = st_table, pair.remote_table()
                li0, ri0 = pair.desc_ids(lids, rids)
                sid = stage_ids(pair.local_table(), rt, li0, ri0, st_base, seg, slots, op=op)
                li, ri, copies = sid.staging_ids, sid.remote_ids, sid.copies
            else:
                gap = gap_bytes if "+gap" in mode else 0
                sp = stage(pair.descs(lids, rids), st_base, op=op, staging_bytes=st_bytes,
                           max_gap=gap, remote_ranges=rg.registration_ranges() if gap else None)
                per_request = (sp.transfer.local_nx3(), sp.transfer.remote_nx3())
                copies, wire = sp.copies, sp.staging_bytes
            t_plan = time.perf_counter() - t0
            if copies is not None:
                copier = self.copier(arenas, executor)
            if per_request is not None:
                expect = nixl_merged_count(per_request[0], per_request[1],
                                           np.arange(len(per_request[0])),
                                           np.arange(len(per_request[0])))
            run = None
            if mode.startswith("vllm-agent"):
                li, ri = pair.desc_ids(lids, rids)
                gaps = "+gap" in mode
                run = self.timed_agent(lp, peer.name, pair, li, ri, before, after,
                                       read_ranges=rg.read_ranges() if gaps else None,
                                       capacity=max(st_bytes, wire) + (1 << 20) if gaps
                                       else None)
                times, count, ctimes, err, expect = (run.times, run.count, run.copy_times,
                                                     run.err, run.expect)
                t_plan, wire = run.plan_s, run.wire
            elif "pipe" in mode:
                pieces = split_staged(sp, a.pipe)
                times, count, ctimes, err = self.timed_pipe(op, lp.mem, peer.name, per_request,
                                                            pieces, copier, before, after)
            elif per_request is not None:
                times, count, ctimes, err = self.timed_lists(op, lp.mem, peer.name,
                                                             per_request, copies, copier,
                                                             before, after)
            else:
                expect = nixl_merged_count(lt, rt, li, ri)
                lh = (sth if lt is st_table else
                      self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", lt, lp.mem))
                rh = self.agent.prep_xfer_dlist(peer.name, rt, lp.mem)
                once = (lh, rh, lambda: None)  # tables prepared once, as vLLM does
                times, count, ctimes, err = self.timed(op, lambda t=once: t, li, ri, copies,
                                                       copier, before, after)
                if lh is not sth:
                    self.agent.release_dlist_handle(lh)
                self.agent.release_dlist_handle(rh)
            xbytes = len(lids) * L * 2 * seg
            gbs = xbytes / min(times) / 1e9
            if mode == "whole-blocks":
                base_gbs[op] = gbs
            row = {
                "pool": tag, "pool_kind": pool_kind, "remote_kind": remote_kind,
                "local_kind": lp.kind, "block_kib": block_bytes // 1024, "pattern": pattern,
                "op": op, "case": case, "mode": mode,
                "executor": ByteCopier.name if mode.startswith("vllm-agent")
                else getattr(copier, "name", None),
                "descs": len(lids) * L * (1 if mode == "whole-blocks" else 2),
                "nixl_descs": count, "expected_nixl_descs": expect, "gbs": gbs,
                "gbs_median": xbytes / statistics.median(times) / 1e9,
                "copy_ms": min(ctimes) * 1e3 if copies is not None else 0.0,
                "plan_us": t_plan * 1e6, "bytes": xbytes, "wire_bytes": wire, "d2d_gbs": d2d,
                "max_gap": run.gap if run else gap_bytes if "+gap" in mode else 0,
                "agent_staged": run.staged if run else None,
                # the agent counts a span per read range; NIXL merges touching spans of one
                # registration (this bench's peers register a pool as one), so it may post fewer
                "expect_at_most": mode == "vllm-agent+gap",
                "phases_ms": run.phases_ms if run else None,
                "ok": err is None, "error": err, "reps": len(times),
            }
            row["ratio"] = gbs / base_gbs[op] if op in base_gbs else None
            self.results.append(row)
            self._print(row)
        if op == "WRITE":  # leave the remote as the READ oracle expects it
            peer.call("refill", rname)

    def timed_agent(self, lp: Pool, peer_name: str, pair: PairPlan, li, ri, before, after,
                    read_ranges=None, capacity=None):
        """Repetitions of one READ posted the way vLLM's worker posts it (tables prepared once,
        ``make_prepped_xfer`` with its desc ids, ``transfer``, then ``check_xfer_state`` until
        DONE) through :class:`pdpatch.kv.staging.StagingAgent` -- the object the kv_segments
        patch puts in front of the worker's agent -- with the peer marked converted.  The
        timing includes the agent's planning and its gather into the local pool.

        With ``read_ranges`` the agent also reads gaps, with the budget it measures itself at
        the first READ (as inside vLLM unless PDPATCH_KV_GAP_KIB is set); that first
        repetition's time includes the measurement, the best repetition does not."""
        wire = len(li) * int(pair.local_table()[0, 1])
        clock = Clock(self.agent)
        agent = StagingAgent(clock, mem_type=lp.mem,
                             capacity=capacity or wire + (1 << 20), memory=lambda: lp.tensors)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", pair.local_table(), lp.mem)
        rh = agent.prep_xfer_dlist(peer_name, pair.remote_table(), lp.mem)
        times, copy_times, plan_times, count, err = [], [], [], 0, None
        phases = []
        try:
            if not agent.mark_converted(rh, peer_name, read_ranges):
                return AgentRun([float("inf")], 0, [0.0], "staging agent refused the peer", 0,
                                0.0, False, wire, 0)
            for _ in range(self.args.reps):
                before()
                self.sync()
                t0 = time.perf_counter()
                h = agent.make_prepped_xfer("READ", lh, li, rh, ri)
                tp = time.perf_counter()
                posted = agent.transfer(h)
                tg = time.perf_counter()
                state = poll(agent, h, posted)
                t1 = time.perf_counter()
                plan_times.append(tp - t0)
                landed = clock.landed.get(h, t1)
                # ms: planning, NIXL's transfer(), the gather's planning (overlaps the wire),
                # posting to NIXL's DONE, and DONE to the gather's end
                phases.append((t1 - t0, [round(1e3 * x, 3) for x in (
                    tp - t0, clock.posted.get(h, tp) - tp, tg - clock.posted.get(h, tp),
                    landed - clock.posted.get(h, tp), t1 - landed)]))
                count = int(agent.get_xfer_telemetry(h).descCount)
                agent.release_xfer_handle(h)
                if state != "DONE":
                    err = f"transfer state {state}"
                times.append(t1 - t0)
                copy_times.append(0.0)
                err = err or after()
                if err:
                    break
            st = agent.stats
            if st.staged_reads and st.not_staged:
                err = err or f"staged only sometimes: {dict(st.not_staged)}"
            if st.not_staged:   # the agent judged staging not worth it: vLLM's own READ ran
                self.notes.append(f"{lp.geometry.label} vllm-agent not staged: "
                                  f"{sorted(st.not_staged)}")
                expect = nixl_merged_count(pair.local_table(), pair.remote_table(), li, ri)
            else:
                expect = st.descriptors_staged // max(st.staged_reads, 1)
            if st.gap_reads not in (0, st.staged_reads):
                err = err or f"gap reads only sometimes: {st.gap_reads} of {st.staged_reads}"
            if read_ranges is not None and peer_name not in st.gap_budgets:
                self.notes.append(f"{lp.geometry.label} vllm-agent+gap: the agent measured "
                                  "no gap budget (see its log line); no gap reads")
            wire += st.gap_bytes // max(st.staged_reads, 1)
            return AgentRun(times, count, copy_times, err, expect, min(plan_times),
                            st.staged_reads > 0, wire, st.gap_budgets.get(peer_name, 0),
                            min(phases)[1] if phases else None)
        finally:
            agent.release_dlist_handle(lh)
            agent.release_dlist_handle(rh)
            agent.close()

    def _read_then_copy(self, h, op: str, copies: CopyPlan | None, copier):
        """Run transfer ``h``; for a staged READ, build the copy table while NIXL moves the
        bytes and return it for launching once they have landed."""
        if copies is None or op != "READ":
            return wait(self.agent, h), None
        posted = self.agent.transfer(h)
        pending = copier.prepare(copies)  # host work that needs no bytes yet
        return poll(self.agent, h, posted), pending

    def timed_pipe(self, op: str, mem: str, peer_name: str, lists, pieces, copier, before,
                   after):
        """Staged transfer in pieces: all pieces posted at once (READ), each piece's copy
        launched as soon as it lands, so copying overlaps the rest of the transfer; WRITE
        copies piece i in, posts it, copies piece i+1 while i moves."""
        times, count, err = [], 0, None
        llist, rlist = lists
        sizes = [len(p.transfer) for p in pieces]
        starts = np.concatenate(([0], np.cumsum(sizes)))
        for _ in range(self.args.reps):
            before()
            self.sync()
            t0 = time.perf_counter()
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", llist, mem)
            rh = self.agent.prep_xfer_dlist(peer_name, rlist, mem)
            handles, states = [], []
            for i, p in enumerate(pieces):
                if op == "WRITE":
                    copier.run(p.copies, sync=True)
                idx = np.arange(starts[i], starts[i + 1])
                h = self.agent.make_prepped_xfer(op, lh, idx, rh, idx)
                states.append(self.agent.transfer(h))
                handles.append(h)
            deadline = time.monotonic() + 120
            for i, h in enumerate(handles):
                state = states[i]
                while state == "PROC" and time.monotonic() < deadline:
                    state = self.agent.check_xfer_state(h)
                if state != "DONE":
                    err = f"piece {i} transfer state {state}"
                if op == "READ":
                    copier.run(pieces[i].copies, sync=False)
            self.sync()
            t1 = time.perf_counter()
            count = sum(int(self.agent.get_xfer_telemetry(h).descCount) for h in handles)
            for h in handles:
                self.agent.release_xfer_handle(h)
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)
            times.append(t1 - t0)
            err = err or after()
            if err:
                break
        return times, count, [0.0] * len(times), err

    def timed_lists(self, op: str, mem: str, peer_name: str, lists, copies, copier, before,
                    after):
        """Per-request descriptor lists: prep_xfer_dlist + release are inside the timing."""
        llist, rlist = lists
        idx = np.arange(len(llist))

        def dlists():
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", llist, mem)
            rh = self.agent.prep_xfer_dlist(peer_name, rlist, mem)
            return lh, rh, lambda: (self.agent.release_dlist_handle(lh),
                                    self.agent.release_dlist_handle(rh))

        return self.timed(op, dlists, idx, idx, copies, copier, before, after)

    def _hooks(self, op, lp: Pool, peer: Peer, rname: str, lids, rids, mirror, L, N, seg):
        torch = _torch()
        if op == "READ":
            dev = lp.logical(0).device
            ridx = torch.as_tensor(rids, dtype=torch.long, device=dev)
            expected = [mirror[la][ridx] for la in range(L)]

            def before():
                poison(lp)

            def after():
                self.sync()
                return check_blocks(lp, lids, expected, POISON)

            return before, after
        lseed = 77

        def before_w():
            fill(lp, lseed, self.device)
            peer.call("refill", rname)

        def after_w():
            return peer.call("check_write", rname, np.asarray(rids).tolist(), lseed,
                             np.asarray(lids).tolist())

        return before_w, after_w

    def _print(self, r: dict) -> None:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "  - "
        flag = "ok" if r["ok"] else f"FAIL {r['error']}"
        print(f"   {r['pattern']:9s} {r['op']:5s} {r['case']:13s} {r['mode']:17s} "
              f"descs {r['descs']:6d} -> NIXL {r['nixl_descs']:6d} "
              f"(exp {r['expected_nixl_descs']:6d})"
              f" {r['gbs']:8.2f} GB/s  x{ratio} of fused  copy {r['copy_ms']:6.2f} ms"
              f"  plan {r['plan_us']:7.0f} us  {flag}"
              + (f"  [plan/post/gather-plan/wire/gather ms {r['phases_ms']}]"
                 if r.get("phases_ms") else ""), flush=True)

    # ---------------------------------------------------------------- registration policy
    def policy(self, kind: str) -> dict:
        """Sliced registration of an over-allocated pool (real kvcached on GPU): a request past
        the plan fails cleanly, the peer lives on; whole-storage registration reads silently."""
        torch = _torch()
        a = self.args
        L, bbytes = a.layers, 64 * 1024
        N = 64
        seg = bbytes // 2
        env = {"KVCACHED_CONTIGUOUS_LAYOUT": "true"} if kind == "kvcached" else {}
        peer = self.peer(f"peer-policy-{kind}", env)
        out: dict[str, Any] = {"pool": kind, "planned_blocks": N}
        remote_kind = kind if kind == "kvcached" else ("host" if self.device == "cpu" else "cuda")
        # host/cuda stand-in for over-allocation: plan fewer blocks than the pool holds
        # kvcached over-allocates by itself; a host/cuda stand-in holds 2N blocks, plans N
        info = peer.call("pool", "policy", remote_kind, "fused", L,
                         N if kind == "kvcached" else 2 * N, bbytes, 4242, "sliced", N)
        rgeo = KVGeometry.from_wire(info["geometry"], label="policy")
        assert rgeo.num_blocks == N
        out["registered_ranges"] = [[int(s), int(e)] for s, e in info["ranges"]]
        out["register_s"] = info["reg_s"]
        self.add_remote(peer, info["md"])
        lp = make_pool("policy-local", "host" if self.device == "cpu" else "cuda", "fused", L, N,
                       bbytes, self.device)
        lreg = register(self.agent, lp.geometry.registration_ranges(), lp.mem)
        pair = PairPlan(lp.geometry, rgeo)
        try:
            pair.descs([0], [N])
            out["planner_past_plan"] = "accepted (BAD)"
        except BlockIdError as e:
            out["planner_past_plan"] = f"BlockIdError: {e}"
        past = rgeo.layers[0].segment_addr(0, N + 1)
        loc = np.array([[lp.geometry.layers[0].base, seg, 0]], dtype=np.uint64)
        rem = np.array([[past, seg, 0]], dtype=np.uint64)
        out["sliced_past_plan_read"] = self._raw_read(peer, loc, rem, lp.mem)
        out["peer_alive_after"] = peer.alive()
        # a valid request afterwards: byte-exact
        lids, rids = np.array([1, 2, 3]), np.array([N - 1, 0, 5])
        plan = pair.descs(lids, rids)
        poison(lp)
        lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", plan.local_nx3(), lp.mem)
        rh = self.agent.prep_xfer_dlist(peer.name, plan.remote_nx3(), lp.mem)
        h = self.agent.make_prepped_xfer("READ", lh, np.arange(len(plan)), rh,
                                         np.arange(len(plan)))
        state = wait(self.agent, h)
        self.agent.release_xfer_handle(h)
        self.agent.release_dlist_handle(lh)
        self.agent.release_dlist_handle(rh)
        self.sync()
        dev = lp.logical(0).device
        ridx = torch.as_tensor(rids, dtype=torch.long, device=dev)
        nb = N if kind == "kvcached" else 2 * N
        exp = [layer_content(4242, la, nb, seg, self.device)[ridx] for la in range(L)]
        err = check_blocks(lp, lids, exp, POISON)
        out["valid_read_after"] = "byte-exact" if state == "DONE" and err is None else (
            f"{state} {err}")
        # contrast: what stock vLLM registers (the whole storage)
        info = peer.call("reregister", "policy", "whole")
        self.add_remote(peer, info["md"])
        out["whole_registration_bytes"] = int(info["ranges"][0][1] - info["ranges"][0][0])
        out["whole_register_s"] = info["reg_s"]
        lp.logical(0).fill_(POISON)
        out["whole_past_plan_read"] = self._raw_read(peer, loc, rem, lp.mem)
        self.sync()
        first = lp.logical(0)[0, 0]
        out["whole_past_plan_bytes"] = (
            "all zero (zero page)" if bool((first == 0).all()) else
            "poison (nothing written)" if bool((first == POISON).all()) else "other bytes")
        out["peer_alive_end"] = peer.alive()
        self.agent.deregister_memory(lreg)
        peer.call("drop")
        print(f"\n== registration policy ({kind}):")
        for k, v in out.items():
            print(f"   {k}: {v}")
        return out

    def _raw_read(self, peer: Peer, loc, rem, mem: str) -> str:
        try:
            lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, mem)
            rh = self.agent.prep_xfer_dlist(peer.name, rem, mem)
            h = self.agent.make_prepped_xfer("READ", lh, np.array([0]), rh, np.array([0]))
            state = wait(self.agent, h, timeout=60)
            self.agent.release_xfer_handle(h)
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)
            return f"succeeded ({state})"
        except Exception as e:
            return f"failed cleanly: {type(e).__name__}: {str(e).splitlines()[0][:160]}"

    def close(self) -> None:
        for p in self.peers.values():
            p.close()


# ============================================================================ main
def environment(device: str) -> dict:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                            "device": device}
    torch = _torch()
    info["torch"] = torch.__version__
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl")
    except Exception:
        info["nixl"] = "?"
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            info["driver"] = "?"
        try:
            from importlib.metadata import version

            info["kvcached"] = version("kvcached")
        except Exception:
            info["kvcached"] = None
    info["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return info


def detect(bench: Bench) -> dict:
    """pdpatch.transport on the pools this run uses (GPU: cudaMalloc and kvcached memory)."""
    out: dict[str, Any] = {}
    kinds = ["host"] if bench.device == "cpu" else ["cuda"]
    if bench.device == "cuda" and "kvcached" in bench.args.pools:
        kinds.append("kvcached")
    for kind in kinds:
        env = {"KVCACHED_CONTIGUOUS_LAYOUT": "true"} if kind == "kvcached" else {}
        peer = bench.peer(f"peer-detect-{kind}", env)
        info = peer.call("pool", "detect", kind, "fused", 2, 8, 64 * 1024, 5, "sliced")
        facts = info["facts"]
        from pdpatch.transport import MemoryFacts

        mf = MemoryFacts(**facts)
        out[kind] = {
            "facts": facts,
            "findings_with_env": [f.line() for f in check_transport(os.environ, memory=[mf])],
            "findings_default_env": [f.line() for f in check_transport({}, memory=[mf])],
        }
        peer.call("drop")
        peer.close()
        bench.peers.pop(peer.name)
    print("\n== pdpatch.transport findings")
    for kind, v in out.items():
        print(f"   {kind}: facts {v['facts']}")
        for line in v["findings_with_env"] or ["(none with this run's environment)"]:
            print(f"      {line}")
    return out


def summary(results: list[dict]) -> None:
    print("\n== summary: READ GB/s (ratio to the fused path: fused<-fused whole-blocks) "
          "[NIXL descs]")
    rows = [r for r in results if r.get("op") == "READ"]
    keys = sorted({(r["pool"], r["block_kib"], r["pattern"]) for r in rows},
                  key=lambda k: (k[0].split()[0], k[1], k[2]))
    for key in keys:
        sel = [r for r in rows if (r["pool"], r["block_kib"], r["pattern"]) == key]
        parts = []
        for r in sel:
            if r["case"] == "fused<-fused" and r["mode"] != "whole-blocks":
                continue
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
            label = "fused" if r["case"] == "fused<-fused" else f"{r['case']} {r['mode']}"
            mark = "" if r["ok"] else " FAIL"
            parts.append(f"{label}: {r['gbs']:.1f} ({ratio}) [{r['nixl_descs']}]{mark}")
        print(f"   {key[0]:>14s} {key[2]:9s} | " + " | ".join(parts))



def summary_gap(results: list[dict]) -> None:
    """The calibrated gap policy: every path may read gaps, the fused one too, so the fair
    baseline is the fused path with the same policy; bytes read are shown beside it."""
    rows = [r for r in results if r.get("op") == "READ" and "+gap" in r["mode"]
            and "pipe" not in r["mode"]]
    if not rows:
        return
    print("\n== summary: READ with the calibrated gap budget: GB/s, ratio to the fused path "
          "(whole-blocks) / to the fused path with the same gap policy, bytes read per byte "
          "requested")
    base = {(r["pool"], r["pattern"]): r for r in results
            if r.get("op") == "READ" and r["mode"] == "whole-blocks"}
    fgap = {(r["pool"], r["pattern"]): r for r in rows if r["case"] == "fused<-fused"}
    for r in sorted(rows, key=lambda r: (r["pool"].split()[0], r["block_kib"], r["pattern"],
                                         r["case"])):
        b, f = base.get((r["pool"], r["pattern"])), fgap.get((r["pool"], r["pattern"]))
        if b is None:
            continue
        vs_gap = f"{r['gbs'] / f['gbs']:.2f}" if f else "-"
        print(f"   {r['pool']:>14s} {r['pattern']:9s} {r['case']:13s} {r['gbs']:8.1f} GB/s  "
              f"x{r['gbs'] / b['gbs']:.2f} of fused  x{vs_gap} of fused+gap  "
              f"read x{r['wire_bytes'] / r['bytes']:.1f}  gap {r['max_gap'] >> 10} KiB"
              f"{'' if r['ok'] else '  FAIL'}")

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--pools", default=None,
                    help="comma list: cuda,kvcached (GPU) / host (CPU); default all available")
    ap.add_argument("--block-kib", default="16,64,256")
    ap.add_argument("--patterns", default="sparse,scattered,runs4,runs16")
    ap.add_argument("--cases", default="ff,sf,fs",
                    help="ff = fused<-fused, sf = split->fused (remote split, local fused), "
                         "fs = fused->split, ss = split<-split")
    ap.add_argument("--ops", default="READ")
    ap.add_argument("--write-kib", default="64", help="block sizes that also run WRITE")
    ap.add_argument("--executors", default=None, help="staged copy executors: cupy,torch")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pool-mib", type=int, default=1024, help="per pool, per side")
    ap.add_argument("--request-frac", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gap-kib", type=int, default=None,
                    help="max gap of staged+gap READs (default: the calibrated transport's "
                         "TransportCost.gap_budget(); 0: no gap reads)")
    ap.add_argument("--pipe", type=int, default=1,
                    help="pieces of staged-pipe modes (1: off; measured slower on H200)")
    ap.add_argument("--reps-large", type=int, default=9, help="reps for blocks >= 256 KiB")
    ap.add_argument("--no-ctx-first", action="store_true",
                    help="create the NIXL agents before any CUDA context (diagnosis)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--diag-ctx", action="store_true",
                    help="mini runs with/without a CUDA context before NIXL, UCX_PROTO_INFO=y")
    ap.add_argument("--kvc-pool-mib", type=int, default=64)
    ap.add_argument("--kvc-block-kib", default="64")
    ap.add_argument("--quick", action="store_true", help="small CPU-sized run")
    ap.add_argument("--no-policy", action="store_true")
    ap.add_argument("--no-detect", action="store_true")
    ap.add_argument("--env-compare", action="store_true",
                    help="rerun one cudaMalloc config without UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.device == "cuda" and os.environ.get("PDPATCH_BENCH_NO_IPC_DEFAULT") != "1":
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    if a.quick:
        a.layers, a.pool_mib, a.reps = 2, 4, 2
        a.block_kib = a.block_kib if a.block_kib != "16,64,256" else "16,64"
        a.patterns = (a.patterns if a.patterns != "sparse,scattered,runs4,runs16"
                      else "scattered,runs4")
    pools = (a.pools or ("host" if a.device == "cpu" else "cuda,kvcached")).split(",")
    a.pools = pools
    a.executors = (a.executors or ("cupy,torch" if a.device == "cuda" else "torch")).split(",")
    case_map = {"ff": ("fused", "fused"), "sf": ("fused", "split"), "fs": ("split", "fused"),
                "ss": ("split", "split")}
    cases = [case_map[c] for c in a.cases.split(",")]
    if ("fused", "fused") not in cases:
        cases.insert(0, ("fused", "fused"))
    patterns = a.patterns.split(",")
    if a.no_ctx_first:
        os.environ["PDPATCH_BENCH_NO_CTX"] = "1"
    elif a.device == "cuda":
        import torch

        torch.zeros(1, device="cuda:0")  # a CUDA context before UCX starts (see --diag-ctx)
        torch.cuda.synchronize()
    env_info = environment(a.device)
    print(f"environment: {json.dumps(env_info)}", flush=True)
    bench = Bench(a)
    env_info["cuda_context_at_agent"] = bench.ctx_at_agent
    print(f"cuda context current at NIXL agent creation: {bench.ctx_at_agent}", flush=True)
    report: dict[str, Any] = {"environment": env_info, "args": vars(a)}
    failures = 0

    def save() -> None:
        if a.json:
            report["results"] = bench.results
            report["notes"] = bench.notes
            report["copy_tuning"] = bench.copy_tuning
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1, default=str)

    def section(name: str, fn) -> Any:
        nonlocal failures
        try:
            out = fn()
            save()
            return out
        except Exception:
            print(f"\n!! section {name} failed:", flush=True)
            traceback.print_exc()
            failures += 1
            report.setdefault("section_errors", []).append(
                f"{name}: {traceback.format_exc().strip().splitlines()[-1]}")
            return None

    def host_pools(pk: str) -> None:
        for kib in map(int, a.block_kib.split(",")):
            ops = a.ops.split(",")
            if str(kib) in a.write_kib.split(",") and "WRITE" not in ops:
                ops = [*ops, "WRITE"]
            reps = a.reps
            if kib >= 256 and a.device == "cuda":
                a.reps = max(a.reps, a.reps_large)
            section(f"{pk} {kib} KiB",
                    lambda kib=kib, ops=ops: bench.run_block_size(pk, kib * 1024, cases,
                                                                  patterns, ops))
            a.reps = reps

    def kvcached_pools() -> None:
        saved, kv_reps = a.pool_mib, a.reps
        a.pool_mib, a.reps = a.kvc_pool_mib, min(a.reps, 2)
        try:
            for kib in map(int, a.kvc_block_kib.split(",")):
                # local: kvcached fused (contiguous) + a cudaMalloc split pool; remote: kvcached
                # fused and kvcached split-half, each in its own peer process
                os.environ["KVCACHED_CONTIGUOUS_LAYOUT"] = "true"
                bench.run_block_size("kvcached", kib * 1024,
                                     [("fused", "fused"), ("fused", "split"), ("split", "fused")],
                                     ["scattered", "runs16"], ["READ"],
                                     local_kinds={"split": "cuda"})
        finally:
            a.pool_mib, a.reps = saved, kv_reps

    try:
        if a.diag_ctx and a.device == "cuda":
            report["diag_ctx"] = section("diag_ctx", lambda: diag_ctx(a))
        if not a.no_detect:
            report["detect"] = section("detect", lambda: detect(bench))
        if not a.no_warmup and pools[0] in ("host", "cuda"):
            saved = (a.pool_mib, a.reps)
            a.pool_mib, a.reps = 64, 1
            section("warmup", lambda: bench.run_block_size(
                pools[0], 64 * 1024, [("fused", "fused")], ["scattered"], ["READ"]))
            a.pool_mib, a.reps = saved
            report["warmup"] = [{k: r.get(k) for k in ("mode", "gbs", "nixl_descs", "ok")}
                                for r in bench.results]
            bench.results.clear()
        for pk in pools:
            if pk in ("host", "cuda"):
                host_pools(pk)
            elif pk == "kvcached":
                section("kvcached", kvcached_pools)
        if not a.no_policy:
            kinds = ["kvcached"] if "kvcached" in pools else []
            kinds.append("host" if a.device == "cpu" else "cuda")
            report["policy"] = [p for p in (section(f"policy {k}", lambda k=k: bench.policy(k))
                                            for k in kinds) if p is not None]
        if a.env_compare and a.device == "cuda":
            report["env_compare"] = section("env_compare", lambda: env_compare(a))
    finally:
        bench.close()
    report["results"] = bench.results
    report["notes"] = bench.notes
    report["copy_tuning"] = bench.copy_tuning
    summary(bench.results)
    summary_gap(bench.results)
    failures += sum(1 for r in bench.results if not r["ok"])
    pol = report.get("policy") or []
    for p in pol:
        if "failed cleanly" not in p["sliced_past_plan_read"] or not p["peer_alive_end"] or (
                p["valid_read_after"] != "byte-exact") or "BlockIdError" not in p[
                "planner_past_plan"]:
            failures += 1
            print(f"POLICY CHECK FAILED: {p}")
    if bench.notes:
        print("notes:", *bench.notes, sep="\n   ")
    save()
    print(f"\n{len(bench.results)} measurements, {failures} failures")
    return 1 if failures else 0


def diag_ctx(a) -> dict:
    """Two phases (block sizes 64, 64) in fresh process pairs, with and without a CUDA context
    before the NIXL agent is made, UCX_PROTO_INFO=y: which transport each phase used."""
    out = {}
    outdir = os.path.dirname(os.path.abspath(a.json)) if a.json else "/tmp"
    for label, extra in (("agent before CUDA context", ["--no-ctx-first"]),
                         ("CUDA context first", [])):
        path = f"/tmp/pdpatch_diag_{os.getpid()}_{len(out)}.json"
        env = {**os.environ, "UCX_PROTO_INFO": "y"}
        cmd = [sys.executable, os.path.abspath(__file__), "--device", "cuda", "--pools", "cuda",
               "--block-kib", "64,64", "--patterns", "scattered", "--cases", "ff",
               "--write-kib", "0", "--gap-kib", "0", "--pool-mib", "64", "--reps", "2",
               "--no-policy", "--no-detect", "--no-warmup", "--json", path, *extra]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        text = p.stdout + p.stderr
        with open(os.path.join(outdir, f"diag_ctx_{len(out)}.txt"), "w") as f:
            f.write(text)
        lines = [ln.strip() for ln in text.splitlines()
                 if "cuda context current at NIXL agent" in ln]
        lines += [ln.strip() for ln in text.splitlines()
                  if ("cuda_ipc" in ln or "tcp" in ln) and "|" in ln][:12]
        try:
            with open(path) as f:
                rows = json.load(f)["results"]
            gbs = [round(r["gbs"], 2) for r in rows
                   if r.get("mode") == "whole-blocks" and r.get("op") == "READ"]
        except Exception:
            gbs = None
        out[label] = {"rc": p.returncode, "whole_blocks_gbs_per_phase": gbs,
                      "proto_lines": lines}
    print("\n== CUDA context before the NIXL agent? (64 KiB whole-blocks READ, two phases)")
    for label, v in out.items():
        print(f"   {label}: GB/s per phase {v['whole_blocks_gbs_per_phase']} rc {v['rc']}")
        for ln in v["proto_lines"][:6]:
            print(f"      {ln[:150]}")
    return out


def env_compare(a) -> dict:
    """Same cudaMalloc config in fresh processes with UCX_CUDA_IPC_ENABLE_GET_ZCOPY unset
    (UCX's default), to show what pdpatch.transport warns about."""
    out = {}
    for label, val in (("unset (auto)", None), ("on", "on")):
        env = dict(os.environ)
        env.pop("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", None)
        if val:
            env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = val
        else:
            env["PDPATCH_BENCH_NO_IPC_DEFAULT"] = "1"
        path = f"/tmp/pdpatch_envcmp_{os.getpid()}_{val}.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--device", "cuda", "--pools", "cuda",
               "--block-kib", "64", "--patterns", "scattered,runs16", "--cases", "ff",
               "--write-kib", "0", "--pool-mib", "256", "--reps", "3", "--no-policy",
               "--no-detect", "--json", path]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        try:
            with open(path) as f:
                rows = json.load(f)["results"]
            out[label] = [{k: r.get(k) for k in ("pattern", "mode", "gbs", "nixl_descs", "ok")}
                          for r in rows if r.get("case") == "fused<-fused"]
        except Exception:
            out[label] = {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-2000:]}
    print("\n== UCX_CUDA_IPC_ENABLE_GET_ZCOPY comparison (cudaMalloc, 64 KiB, READ)")
    for label, rows in out.items():
        print(f"   {label}: {rows}")
    return out


if __name__ == "__main__":
    if os.environ.get("PDPATCH_BENCH_NO_IPC_DEFAULT") == "1":
        os.environ.pop("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", None)
    sys.exit(main())
