#!/usr/bin/env python
"""Benchmark pdpatch's KV descriptor planning and converted transfers (issue 6).

(a) Descriptor planning, pdpatch vs the installed stock vLLM (0.33 or 0.34), same run,
    equal-layout case:
    * per request: vLLM's real ``NixlBaseConnectorWorker._compute_desc_ids`` (called twice, for
      the remote and the local ids, exactly as ``pull_worker._read_blocks`` does) vs
      ``PairPlan.desc_ids``; goal ratio <= 1.05.
    * per peer (handshake): vLLM's real ``_build_fa_remote`` vs ``PairPlan`` construction
      (validation) + ``remote_rows()``.
    The two vLLM methods run on a ``NixlBaseConnectorWorker`` whose state is seeded with just
    the attributes they read, the way vLLM's unit tests seed ``FakeNixlConnectorWorker``.
    Also printed (no stock counterpart -- stock refuses the pair): the converted split->fused
    per-request address plan, with and without coalescing.
(b) Transfer throughput over real NIXL (UCX, host DRAM, two processes on loopback): fused <-
    fused (unconverted; per-segment descriptors like vLLM <= 0.25) vs fused <- split
    (converted), each with and without coalescing, for scattered blocks and runs of 16;
    GB/s and ratio against the unconverted per-segment path of the same run.  Bytes are checked.

Run: ``.venv/bin/python -m scripts.bench_descriptors [--quick] [--record | --json PATH]``
(``--record``: every sample into a raw record, :mod:`lab.bench.record`)
"""

from __future__ import annotations

import argparse
import inspect
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lab.bench import record
from lab.kv_reference import coalesce, strided_pair_rows
from pdpatch.kv import DescPlan, PairPlan, handshake_kind, infer_geometry, needs_conversion
from pdpatch.versions import vllm_version

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

ES = 2  # bf16


def _kv_infos(kind: str, layers: int, blocks: int, bs: int, heads: int, dim: int, base: int):
    """(shape, stride, es, ptr) per layer for a split (2, N, ...) or fused (N, 2, ...) layout,
    head-major inside a segment, layers back to back from ``base``."""
    seg = bs * heads * dim
    out = []
    for layer in range(layers):
        ptr = base + layer * 2 * blocks * seg * ES
        if kind == "split":
            out.append(((2, blocks, bs, heads, dim), (blocks * seg, seg, dim, bs * dim, 1), ES,
                        ptr))
        elif kind == "fused":
            out.append(((blocks, 2, bs, heads, dim), (2 * seg, seg, dim, bs * dim, 1), ES, ptr))
        else:  # packed (N, H, bs, 2D), vLLM >= 0.26
            out.append(((blocks, heads, bs, 2 * dim), (2 * seg, 2 * bs * dim, 2 * dim, 1), ES,
                        ptr))
    return out


def _geo(kind, layers, blocks, bs, heads, dim, base):
    infos = _kv_infos(kind, layers, blocks, bs, heads, dim, base)
    kv_dim = {"split": 0, "fused": 1, "packed": None}[kind]
    return infer_geometry(infos, kv_dim=kv_dim, label=kind)


def _best_interleaved(fns: dict[str, Callable[[], object]], inner: int, rounds: int,
                      out: dict[str, list[float]] | None = None):
    """Median per-call ns of each fn, measured in interleaved rounds (A B A B ...); ``out``
    gets every round's per-call ns.

    Thread CPU time, not wall time: the CPU box is shared, and time spent preempted by other
    jobs would otherwise land on whichever function happened to be running.
    """
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        for _ in range(max(inner // 10, 1)):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.thread_time_ns()
            for _ in range(inner):
                fn()
            samples[name].append((time.thread_time_ns() - t0) / inner)
    if out is not None:
        out.update(samples)
    return {k: statistics.median(v) for k, v in samples.items()}


def seeded_worker(block_lens: list[int], num_regions: int):
    """A real vLLM (0.33, 0.34) ``NixlBaseConnectorWorker`` seeded with just the attributes its
    descriptor builders read, as vLLM's unit tests seed ``FakeNixlConnectorWorker``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    w = object.__new__(NixlBaseConnectorWorker)
    w.transfer_topo = object()  # only checked for None by the builders
    w._group_spec_types = (FullAttentionSpec,)
    w._transfer_layer_region_indices = []
    w._transfer_layer_group_ids = []
    w._region_is_mla = []
    w._head_sharded_draft_regions = set()
    w.draft_tp_mappings = {}
    w.block_len_per_layer = block_lens
    w._has_mamba = False
    w.num_regions = num_regions
    w.region_group_ids = [0] * num_regions
    w._uses_region_group_mapping = False
    return w


def bench_planning(quick: bool, samples: dict[str, Any] | None = None,
                   derived: dict[str, Any] | None = None) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import TPMapping

    layers, blocks, bs, heads, dim = 32, 8192, 16, 8, 128
    local = _geo("packed", layers, blocks, bs, heads, dim, 1 << 32)
    remote = _geo("packed", layers, blocks, bs, heads, dim, 1 << 40)

    w = seeded_worker([la.segments[0].length for la in local.layers], layers)
    tp_plan = TPMapping(((0,),), (0,), {0: 0}, 0)
    meta = NixlAgentMetadata(
        engine_id="remote", agent_metadata=b"", device_id=0, num_blocks=blocks,
        kv_caches_base_addr=[la.base for la in remote.layers],
        block_lens=[la.segments[0].length for la in remote.layers],
        block_strides=[la.block_stride for la in remote.layers], kv_cache_layout="LBHNC",
        block_size=bs, ssm_sizes=(0, 0), attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1,
    )
    pair = PairPlan(local, remote)
    assert not pair.converts
    assert np.array_equal(pair.remote_rows(), w._build_fa_remote(tp_plan, meta, 1))

    samples = {} if samples is None else samples
    derived = {} if derived is None else derived
    # how the release's pull worker names the one attention group of every region: 0.33 by
    # region group ids, 0.34 by (regions, group) pairs (_RegionPairs)
    params = inspect.signature(w._compute_desc_ids).parameters
    group_args = ({"pairs": (list(range(layers)), [0] * layers)} if "pairs" in params else
                  {"region_group_ids": None, "uses_region_group_mapping": False})
    rng = np.random.default_rng(0)
    inner, rounds = (200, 5) if quick else (1000, 9)
    samples["planning unit"] = "thread CPU ns per call, one per round"
    print(f"(a) planning, vLLM {vllm_version()} packed layout, {layers} layers, {blocks} blocks, "
          f"thread CPU time, median of {rounds} interleaved rounds x {inner} calls")
    for n in (16, 128, 1024):
        lids = rng.choice(blocks, n, replace=False).tolist()
        rids = rng.choice(blocks, n, replace=False).tolist()

        def stock(lids=lids, rids=rids):
            r = w._compute_desc_ids(block_ids=[rids], dst_num_blocks=blocks,
                                    block_size_ratio=None, physical_blocks_per_logical=1,
                                    region_num_blocks=None, **group_args)
            loc = w._compute_desc_ids(block_ids=[lids], dst_num_blocks=blocks,
                                      block_size_ratio=1, physical_blocks_per_logical=1,
                                      region_num_blocks=None, **group_args)
            return loc, r

        def ours(lids=lids, rids=rids):
            return pair.desc_ids(lids, rids)

        s_loc, s_rem = stock()
        o_loc, o_rem = ours()
        assert np.array_equal(s_loc, o_loc) and np.array_equal(s_rem, o_rem)
        got = samples[f"planning per request, {n} blocks"] = {}
        t = _best_interleaved({"stock": stock, "pdpatch": ours}, inner, rounds, got)
        derived[f"planning per request, {n} blocks: stock us"] = t["stock"] / 1e3
        derived[f"planning per request, {n} blocks: pdpatch us"] = t["pdpatch"] / 1e3
        derived[f"planning per request, {n} blocks: pdpatch / stock"] = t["pdpatch"] / t["stock"]
        print(f"    per request, {n:5d} blocks: stock _compute_desc_ids x2 "
              f"{t['stock'] / 1e3:8.2f} us | pdpatch desc_ids {t['pdpatch'] / 1e3:8.2f} us | "
              f"ratio {t['pdpatch'] / t['stock']:.3f} (goal <= 1.05)")

    def stock_peer():
        return w._build_fa_remote(tp_plan, meta, 1)

    def passthrough_peer():
        # what a patched _build_fa_remote does when the layouts agree: a kind test, then stock
        kind = handshake_kind(len(meta.kv_caches_base_addr), layers, layout="packed")
        assert not needs_conversion(local, kind)
        return w._build_fa_remote(tp_plan, meta, 1)

    def ours_peer():
        return PairPlan(local, remote).remote_rows()

    got = samples["planning per peer"] = {}
    t = _best_interleaved({"stock": stock_peer, "pass": passthrough_peer, "pdpatch": ours_peer},
                          inner // 5, rounds, got)
    derived["planning per peer: stock us"] = t["stock"] / 1e3
    derived["planning per peer: pass-through / stock"] = t["pass"] / t["stock"]
    derived["planning per peer: PairPlan / stock"] = t["pdpatch"] / t["stock"]
    print(f"    per peer (handshake): stock _build_fa_remote {t['stock'] / 1e3:8.2f} us | "
          f"patched pass-through {t['pass'] / 1e3:8.2f} us (ratio {t['pass'] / t['stock']:.3f},"
          f" goal <= 1.05) | full pdpatch PairPlan+remote_rows {t['pdpatch'] / 1e3:8.2f} us "
          f"(ratio {t['pdpatch'] / t['stock']:.1f}, one-time, only for converting peers)")

    # converted path (stock has none): split remote -> fused local, address-level plan
    lf = _geo("fused", layers, blocks, bs, heads, dim, 1 << 32)
    rs = _geo("split", layers, blocks, bs, heads, dim, 1 << 40)
    conv = PairPlan(lf, rs)
    t0 = time.perf_counter()
    for _ in range(20):
        tab = conv.remote_table()
    t_tab = (time.perf_counter() - t0) / 20
    derived["converted per peer: remote_table ms"] = t_tab * 1e3
    print(f"    converted split->fused, per peer: PairPlan.remote_table() "
          f"({tab.shape[0]} descs) {t_tab * 1e3:.2f} ms")
    for n in (128, 1024):
        start = int(rng.integers(0, blocks - n))
        lids = np.arange(start, start + n)
        rids = rng.choice(blocks, n, replace=False)
        got = samples[f"converted per request, {n} blocks"] = {}
        t = _best_interleaved({
            "ids": lambda lids=lids, rids=rids: conv.desc_ids(lids, rids),
            "descs": lambda lids=lids, rids=rids: conv.descs(lids, rids),
            "coalesced": lambda lids=lids, rids=rids: coalesce(conv.descs(lids, rids)),
        }, max(inner // 10, 10), rounds, got)
        for key, what in (("ids", "desc_ids"), ("descs", "address plan"),
                          ("coalesced", "address plan + coalesce")):
            derived[f"converted per request, {n} blocks: {what} us"] = t[key] / 1e3
        print(f"    converted split->fused, per request {n:5d} blocks: desc_ids "
              f"{t['ids'] / 1e3:8.2f} us | address plan {t['descs'] / 1e3:8.2f} us | "
              f"+coalesce {t['coalesced'] / 1e3:8.2f} us")


# ------------------------------------------------------------------------- (b) NIXL transfers
def _peer(conn, nbytes: int, seed: int) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-peer", nixl_agent_config(backends=["UCX"]))
    buf = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    conn.send(int(buf.ctypes.data))
    regs = None
    while True:
        cmd, arg = conn.recv()
        if cmd == "register":
            if regs is not None:
                agent.deregister_memory(regs)
            regs = agent.register_memory([(s, e - s, 0, "") for s, e in arg], "DRAM")
            conn.send(agent.get_agent_metadata())
        elif cmd == "quit":
            conn.send(True)
            return


def bench_transfers(quick: bool, samples: dict[str, Any] | None = None,
                    derived: dict[str, Any] | None = None) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    layers, blocks, bs, heads, dim = 4, 2048, 16, 8, 32  # 8 KiB K + 8 KiB V per block
    seg = bs * heads * dim * ES
    per_side = layers * 2 * blocks * seg
    seed = 1234
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    # the peer holds both remote layouts: fused at +0, split at +per_side
    proc = ctx.Process(target=_peer, args=(child, 2 * per_side, seed), daemon=True)
    proc.start()
    agent = nixl_agent("bench-init",
                       nixl_agent_config(backends=["UCX"], capture_telemetry=True))
    remote_base = conn.recv()
    remote_bytes = np.random.default_rng(seed).integers(0, 256, 2 * per_side, dtype=np.uint8)
    local_buf = np.zeros(per_side, dtype=np.uint8)
    local_base = int(local_buf.ctypes.data)
    local = _geo("fused", layers, blocks, bs, heads, dim, local_base)
    agent.register_memory([(s, e - s, 0, "") for s, e in local.registration_ranges()], "DRAM")
    remotes = {"fused": _geo("fused", layers, blocks, bs, heads, dim, remote_base),
               "split": _geo("split", layers, blocks, bs, heads, dim, remote_base + per_side)}
    conn.send(("register", remotes["fused"].registration_ranges()
               + remotes["split"].registration_ranges()))
    agent.add_remote_agent(conn.recv())

    def prep(plan: DescPlan, strided: bool):
        if strided:  # NIXL >= 1.5 compressed rows; NIXL expands them into descriptors
            lrows, rrows = strided_pair_rows(plan)
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, "DRAM")
            rh = agent.prep_xfer_dlist("bench-peer", rrows, "DRAM")
            return lh, rh, len(lrows)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", plan.local_nx3(), "DRAM")
        rh = agent.prep_xfer_dlist("bench-peer", plan.remote_nx3(), "DRAM")
        return lh, rh, len(plan)

    def once(lh, rh, n: int) -> tuple[float, int]:
        idx = np.arange(n)
        h = agent.make_prepped_xfer("READ", lh, idx, rh, idx)
        t0 = time.perf_counter()
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        dt = time.perf_counter() - t0
        assert state == "DONE", state
        count = agent.get_xfer_telemetry(h).descCount
        agent.release_xfer_handle(h)
        return dt, count

    def verify(plan: DescPlan) -> None:
        for la, ra, n in zip(plan.local_addr.tolist(), plan.remote_addr.tolist(),
                             plan.length.tolist(), strict=True):
            lo, ro = la - local_base, ra - remote_base
            if not np.array_equal(local_buf[lo:lo + n], remote_bytes[ro:ro + n]):
                raise AssertionError("transferred bytes differ")

    samples = {} if samples is None else samples
    derived = {} if derived is None else derived
    rng = np.random.default_rng(7)
    n_req = 512
    reps = 5 if quick else 11
    patterns = {
        "scattered": (rng.choice(blocks, n_req, replace=False),
                      rng.choice(blocks, n_req, replace=False)),
        "runs of 16": tuple(
            np.concatenate([np.arange(s, s + 16) for s in
                            rng.choice(blocks // 16, n_req // 16, replace=False) * 16])
            for _ in range(2)),
    }
    mib = n_req * layers * 2 * seg / 2**20
    print(f"(b) NIXL READ over UCX loopback, host DRAM, {layers} layers x {n_req} blocks of "
          f"{2 * seg // 1024} KiB ([K|V]) = {mib:.0f} MiB per transfer; all modes interleaved "
          f"in {reps} rounds, best wall time each; every mode's bytes checked")
    for pname, (lids, rids) in patterns.items():
        cases = {}
        for kind, label in (("fused", "unconverted fused<-fused"),
                            ("split", "converted   fused<-split")):
            pair = PairPlan(local, remotes[kind])
            assert pair.converts == (kind == "split")
            plan = pair.descs(lids, rids)
            for mode, p, strided in (("per-segment", plan, False),
                                     ("strided rows", plan, True),
                                     ("coalesced", coalesce(plan), False)):
                cases[(label, mode)] = (p, *prep(p, strided))
        best = dict.fromkeys(cases, float("inf"))
        counts = {}
        walls: dict[str, list[float]] = {f"{label} {mode}": [] for label, mode in cases}
        samples[f"transfers, {pname} (wall s per READ, one per round)"] = walls
        for rnd in range(reps):
            for key, (p, lh, rh, _rows) in cases.items():
                if rnd == 0:
                    local_buf[:] = 0
                dt, counts[key] = once(lh, rh, len(p))
                walls[f"{key[0]} {key[1]}"].append(dt)
                if rnd == 0:
                    verify(p)
                best[key] = min(best[key], dt)
        base = cases[("unconverted fused<-fused", "per-segment")][0].total_bytes / best[
            ("unconverted fused<-fused", "per-segment")]
        print(f"  {pname}:")
        for key, (p, lh, rh, rows) in cases.items():
            gbs = p.total_bytes / best[key]
            label, mode = key
            derived[f"transfers, {pname}: {label} {mode} GB/s"] = gbs / 1e9
            derived[f"transfers, {pname}: {label} {mode} / unconverted per-segment"] = gbs / base
            derived[f"transfers, {pname}: {label} {mode} rows"] = rows
            derived[f"transfers, {pname}: {label} {mode} NIXL descCount"] = counts[key]
            print(f"    {label} {mode:12s}: {gbs / 1e9:6.2f} GB/s  ({rows:5d} rows/descs, NIXL "
                  f"descCount {counts[key]:5d})  ratio {gbs / base:.2f}")
            agent.release_dlist_handle(lh)
            agent.release_dlist_handle(rh)
    conn.send(("quit", None))
    conn.recv()
    proc.join(10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--only", choices=["planning", "transfers"])
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    rec = record.Recorder("descriptors", args, argv)
    if args.only != "transfers":
        bench_planning(args.quick, rec.samples, rec.derived)
    if args.only != "planning":
        bench_transfers(args.quick, rec.samples, rec.derived)
    rec.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
