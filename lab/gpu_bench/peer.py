"""The remote side: a spawned process holding pools registered with its own NIXL agent, driven
over a pipe (make a pool, re-register it, refill it, check what a WRITE left in it), and
:class:`Peer`, the initiator's handle on it."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Any

import numpy as np

from pdpatch.transport import probe_memory

from .agents import new_agent, register
from .pools import Pool, check_blocks, fill, layer_content, lazy_torch, make_pool


def peer_main(conn, name: str, device: str, env: dict) -> None:
    os.environ.update(env)
    try:
        if device == "cuda" and os.environ.get("PDLAB_BENCH_NO_CTX") != "1":
            lazy_torch().zeros(1, device="cuda:0")  # a CUDA context before UCX starts
            lazy_torch().cuda.synchronize()
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
                    sidx = lazy_torch().as_tensor(src_ids, dtype=lazy_torch().long, device=dev)
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
                    lazy_torch().cuda.empty_cache()
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
