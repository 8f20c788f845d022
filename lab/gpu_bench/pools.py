"""Each side's KV memory and the byte oracle: cudaMalloc / host pools in vLLM's fused and split
shapes, real kvcached (CUDA VMM) pools, seeded content regenerated identically in every
process, poison, and the check of a request's blocks against them (from the tensors' own
shapes and strides, never from pdpatch's geometry)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdpatch.kv import KVGeometry, infer_geometry, tensor_info

POISON = 0x5A
HEADS, HEAD_DIM, ES = 8, 128, 2  # bf16; one token of K = 2 KiB


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
        u = t.view(lazy_torch().uint8)  # last dim D*2 bytes
        return u[: self.num_blocks].view(self.num_blocks, 2, self.seg)


def lazy_torch():
    import torch

    return torch


def torch_device(device: str):
    return lazy_torch().device("cuda:0" if device == "cuda" else "cpu")


def make_pool(name: str, kind: str, layout: str, layers: int, num_blocks: int, block_bytes: int,
              device: str) -> Pool:
    torch = lazy_torch()
    bs = block_bytes // 2 // (HEADS * HEAD_DIM * ES)
    if bs < 1 or bs * HEADS * HEAD_DIM * ES * 2 != block_bytes:
        raise ValueError(f"block of {block_bytes} B is not whole tokens of {HEADS}x{HEAD_DIM}")
    seg = block_bytes // 2
    if kind == "kvcached":
        return _kvcached_pool(name, layout, layers, num_blocks, bs, seg)
    per_layer = num_blocks * block_bytes
    flat = torch.empty(layers * per_layer + 512, dtype=torch.uint8, device=torch_device(device))
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
    torch = lazy_torch()
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
    torch = lazy_torch()
    g = torch.Generator(device=torch_device(device))
    g.manual_seed(seed * 1009 + layer)
    return torch.randint(0, 256, (num_blocks, 2, seg), generator=g, dtype=torch.uint8,
                         device=torch_device(device))


def fill(pool: Pool, seed: int, device: str) -> None:
    for layer in range(len(pool.tensors)):
        lv = pool.logical(layer)
        lv.copy_(layer_content(seed, layer, pool.num_blocks, pool.seg, device))
    for layer in range(len(pool.tensors)):  # read back: catches aliased (unmapped) pages
        if not lazy_torch().equal(pool.logical(layer),
                                  layer_content(seed, layer, pool.num_blocks, pool.seg, device)):
            raise RuntimeError(f"{pool.name}: content does not read back (aliased pages?)")


def poison(pool: Pool) -> None:
    for layer in range(len(pool.tensors)):
        pool.logical(layer).fill_(POISON)


def check_blocks(pool: Pool, ids: np.ndarray, expected: list, other_value: Any) -> str | None:
    """None when pool blocks ``ids`` hold ``expected[layer]`` (N_req, 2, seg) and every other
    planned block equals ``other_value`` (POISON, or a list of per-layer full contents)."""
    torch = lazy_torch()
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
