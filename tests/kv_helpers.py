"""Test helpers for KV geometry: real strided layouts in byte buffers, an independent oracle,
a byte-level copy simulator, and the NIXL peer process (spawned by tests/test_nixl_transfer.py).

The oracle never uses pdpatch's geometry: it indexes numpy views built from the same
shape/stride tuples a vLLM/kvcached tensor would have, through logical K/V/head indices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

LAYOUTS = ("fa_split", "fused", "split_half", "packed")
_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}


@dataclass(frozen=True)
class LayoutSpec:
    """How one side's KV memory is laid out (see build_side)."""

    kind: str  # one of LAYOUTS
    head_major: bool = True
    cross_layer: bool = False  # fused/packed: layers interleaved per block (BL* / kvcached)
    block_pad: int = 0  # extra elements after each block
    kv_gap: int = 0  # extra elements between the K and V pools (split kinds)
    overalloc: int = 0  # extra capacity blocks beyond the planned ones
    layer_gap: int = 0  # elements between layers' tensors


@dataclass
class Side:
    """One worker's KV memory: a byte buffer and per-layer views into it."""

    buf: np.ndarray  # uint8, the whole "address space" of this side (address = index + base)
    base: int  # address of buf[0] (0 in simulations, the real pointer under NIXL)
    tensors: list[np.ndarray]  # per-layer KV tensor (element dtype), vLLM/kvcached shape
    infos: list[tuple[tuple[int, ...], tuple[int, ...], int, int]]  # (shape, stride, es, ptr)
    segs: list[list[np.ndarray]] = field(default_factory=list)  # [layer][seg] -> (cap,H,bs,X)
    kv_dim: int | None = None
    spec: LayoutSpec | None = None


def layer_elems(spec: LayoutSpec, num_layers: int, cap: int, bs: int, heads: int,
                head_dim: int) -> int:
    seg = bs * heads * head_dim
    if spec.kind == "packed":
        per_block = 2 * seg + spec.block_pad
        return per_block * cap * (num_layers if spec.cross_layer else 1)
    if spec.kind == "fused":
        per_block = 2 * seg + spec.block_pad
        return per_block * cap * (num_layers if spec.cross_layer else 1)
    return 2 * (seg + spec.block_pad) * cap + spec.kv_gap


def side_nbytes(spec: LayoutSpec, num_layers: int, num_blocks: int, bs: int, heads: int,
                head_dim: int, es: int) -> int:
    cap = num_blocks + spec.overalloc
    per = layer_elems(spec, num_layers, cap, bs, heads, head_dim)
    if spec.cross_layer and spec.kind in ("fused", "packed"):
        return (per + 64) * es
    return (num_layers * (per + spec.layer_gap) + 64) * es


def build_side(spec: LayoutSpec, num_layers: int, num_blocks: int, bs: int, heads: int,
               head_dim: int, es: int, buf: np.ndarray | None = None, base: int = 0) -> Side:
    """Lay out ``num_layers`` KV tensors in ``buf`` the way the named allocator does."""
    dtype = _DTYPES[es]
    cap = num_blocks + spec.overalloc
    if buf is None:
        buf = np.zeros(side_nbytes(spec, num_layers, num_blocks, bs, heads, head_dim, es),
                       dtype=np.uint8)
    typed = buf[: (buf.size // es) * es].view(dtype)
    seg = bs * heads * head_dim
    D = head_dim
    if spec.head_major:  # (bs, H, D) logical, heads outermost physically
        s_bs, s_h = D, bs * D
    else:
        s_bs, s_h = heads * D, D
    tensors: list[np.ndarray] = []
    segs: list[list[np.ndarray]] = []
    infos = []
    kv_dim: int | None = None
    offset = 0
    for layer in range(num_layers):
        if spec.kind == "packed":
            C = 2 * D
            ps_bs, ps_h = (C, bs * C) if spec.head_major else (heads * C, C)
            per_block = heads * bs * C + spec.block_pad
            if spec.cross_layer:
                start, bstride = layer * per_block, num_layers * per_block
            else:
                start, bstride = offset, per_block
                offset += per_block * cap + spec.layer_gap
            shape = (cap, heads, bs, C)
            strides = (bstride, ps_h, ps_bs, 1)
            t = _strided(typed, start, shape, strides, es)
            segs.append([t])
        else:
            if spec.kind == "fa_split":
                bstride = seg + spec.block_pad
                kvs = cap * bstride + spec.kv_gap
                shape, strides = (2, cap, bs, heads, D), (kvs, bstride, s_bs, s_h, 1)
                kv_dim = 0
                start = offset
                offset += 2 * cap * bstride + spec.kv_gap + spec.layer_gap
            elif spec.kind == "split_half":
                bstride = seg + spec.block_pad
                kvs = cap * bstride + spec.kv_gap
                shape, strides = (cap, 2, bs, heads, D), (bstride, kvs, s_bs, s_h, 1)
                kv_dim = 1
                start = offset
                offset += 2 * cap * bstride + spec.kv_gap + spec.layer_gap
            elif spec.kind == "fused":
                per_block = 2 * seg + spec.block_pad
                if spec.cross_layer:
                    start, bstride = layer * per_block, num_layers * per_block
                else:
                    start, bstride = offset, per_block
                    offset += per_block * cap + spec.layer_gap
                shape, strides = (cap, 2, bs, heads, D), (bstride, seg, s_bs, s_h, 1)
                kv_dim = 1
            else:
                raise ValueError(spec.kind)
            t = _strided(typed, start, shape, strides, es)
            k, v = (t[0], t[1]) if spec.kind == "fa_split" else (t[:, 0], t[:, 1])
            segs.append([k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)])
        tensors.append(t)
        infos.append((shape, strides, es, base + start * es))
    return Side(buf, base, tensors, infos, segs, kv_dim, spec)


def _strided(typed: np.ndarray, start: int, shape, strides, es: int) -> np.ndarray:
    last = start + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    assert last < typed.size, "layout does not fit its buffer"
    return as_strided(typed[start:], shape, tuple(st * es for st in strides))


def phys_bytes(block_view: np.ndarray, head_major: bool) -> np.ndarray:
    """A writable uint8 view of one segment of one block, in memory order."""
    v = block_view if head_major else block_view.transpose(1, 0, 2)  # (H,bs,X) or (bs,H,X)
    assert v.flags.c_contiguous, "segment is not dense in the expected order"
    return v.reshape(-1).view(np.uint8)


def expected_copy(dst: Side, src: Side, dst_ids, src_ids, *, ratio: int = 1,
                  dst_slice: tuple[int, int] = (1, 0), src_slice: tuple[int, int] = (1, 0),
                  dst_is_local: bool = True) -> None:
    """Apply, through logical views only, what a transfer must do to ``dst``.

    ``ratio``: local blocks hold ``ratio`` remote blocks (vLLM's byte-chunk semantics).  The
    local side is ``dst`` for a READ and ``src`` for a WRITE (``dst_is_local``).
    """
    local, remote = (dst, src) if dst_is_local else (src, dst)
    l_ids, r_ids = (dst_ids, src_ids) if dst_is_local else (src_ids, dst_ids)
    l_sl, r_sl = (dst_slice, src_slice) if dst_is_local else (src_slice, dst_slice)
    (p, pi), (q, qi) = l_sl, r_sl
    l_ids, r_ids = list(l_ids), list(r_ids)
    if ratio == 1:
        pairs = [(lb, 0, rb) for lb, rb in zip(l_ids, r_ids, strict=True)]
    else:
        sub = [lb * ratio + j for lb in l_ids for j in range(ratio)][: len(r_ids)]
        pairs = [(s // ratio, s % ratio, rb) for s, rb in zip(sub, r_ids, strict=True)]
    for layer in range(len(local.segs)):
        for s in range(len(local.segs[layer])):
            lv, rv = local.segs[layer][s], remote.segs[layer][s]
            for lb, j, rb in pairs:
                if ratio == 1:
                    hl = lv.shape[1] // p
                    hr = rv.shape[1] // q
                    assert hl == hr
                    lsl = lv[lb, pi * hl:(pi + 1) * hl]
                    rsl = rv[rb, qi * hr:(qi + 1) * hr]
                    if dst_is_local:
                        lsl[...] = rsl
                    else:
                        rsl[...] = lsl
                else:
                    lbytes = phys_bytes(lv[lb], local.spec.head_major).reshape(ratio, p, -1)
                    rbytes = phys_bytes(rv[rb], remote.spec.head_major).reshape(q, -1)
                    if dst_is_local:
                        lbytes[j, pi] = rbytes[qi]
                    else:
                        rbytes[qi] = lbytes[j, pi]


def simulate(local_buf: np.ndarray, local_base: int, remote_buf: np.ndarray, remote_base: int,
             local_addr, remote_addr, length, op: str = "READ") -> None:
    """Byte-level effect of a descriptor list, as NIXL would apply it."""
    for la, ra, n in zip(np.asarray(local_addr).tolist(), np.asarray(remote_addr).tolist(),
                         np.asarray(length).tolist(), strict=True):
        lo, ro = la - local_base, ra - remote_base
        assert lo >= 0 and lo + n <= local_buf.size, "local descriptor outside the buffer"
        assert ro >= 0 and ro + n <= remote_buf.size, "remote descriptor outside the buffer"
        if op == "READ":
            local_buf[lo:lo + n] = remote_buf[ro:ro + n]
        else:
            remote_buf[ro:ro + n] = local_buf[lo:lo + n]


# ----------------------------------------------------------------------------- NIXL peer
def peer_main(conn, name: str = "pdpatch-peer") -> None:
    """The target side of the NIXL tests: owns a registered host buffer; driven over a Pipe.

    Commands: ("alloc", nbytes) -> (agent metadata, buffer address);
    ("register", [(start, end), ...]) -> True; ("add_remote", metadata) -> name;
    ("set", bytes) / ("get",) -> buffer contents; ("notifs",) -> the notifications received
    since the last ask, per sending agent; ("quit",).
    """
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buf: np.ndarray | None = None
    regs: list = []
    try:
        while True:
            cmd, *args = conn.recv()
            try:
                if cmd == "alloc":
                    for r in regs:
                        agent.deregister_memory(r)
                    regs = []
                    buf = np.zeros(int(args[0]), dtype=np.uint8)
                    conn.send(("ok", int(buf.ctypes.data)))
                elif cmd == "register":
                    for r in regs:
                        agent.deregister_memory(r)
                    regs = [agent.register_memory(
                        [(int(s), int(e - s), 0, "") for s, e in args[0]], "DRAM")]
                    conn.send(("ok", agent.get_agent_metadata()))
                elif cmd == "add_remote":
                    conn.send(("ok", agent.add_remote_agent(args[0])))
                elif cmd == "set":
                    buf[:] = np.frombuffer(args[0], dtype=np.uint8)
                    conn.send(("ok", True))
                elif cmd == "get":
                    conn.send(("ok", buf.tobytes()))
                elif cmd == "notifs":
                    conn.send(("ok", {k: list(v) for k, v in agent.get_new_notifs().items()}))
                elif cmd == "quit":
                    conn.send(("ok", True))
                    return
                else:
                    conn.send(("err", f"unknown command {cmd!r}"))
            except Exception as e:  # report, keep serving
                conn.send(("err", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()
