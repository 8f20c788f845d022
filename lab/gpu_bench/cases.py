"""What is measured: per block size, pools on both sides and a staging buffer; per request
pattern, operation and (local <- remote) layout case, every mode -- the fused path, vLLM's ids,
coalesced, the staging agent with and without gap reads, staged plans and ids, pieces -- each
timed, byte-checked and compared with NIXL's predicted ``descCount``."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from lab.kv_reference import (
    coalesce,
    nixl_merged_count,
    split_staged,
    stage,
    stage_ids,
    whole_blocks,
)
from pdpatch.kv import KVGeometry, PairPlan
from pdpatch.kv.staging import ByteCopier
from pdpatch.kv.staging.plans import TransportCost, staging_table

from .agents import register
from .initiator import Bench
from .peer import Peer
from .pools import (
    POISON,
    Pool,
    check_blocks,
    fill,
    layer_content,
    lazy_torch,
    make_pool,
    poison,
    torch_device,
)
from .report import print_row


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


def run_block_size(bench: Bench, pool_kind: str, block_bytes: int, cases: list[tuple[str, str]],
                   patterns: list[str], ops: list[str], remote_kind: str | None = None,
                   remote_env: dict | None = None, local_kinds: dict | None = None) -> None:
    torch = lazy_torch()
    a = bench.args
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
            peer = bench.peer(f"peer-kvcached-{lay}", env)
        else:
            peer = bench.peer("peer-main", env)
        info = peer.call("pool", pname, remote_kind, lay, L, N, block_bytes,
                         1000 + block_bytes // 1024 + (7 if lay == "split" else 0), "sliced")
        bench.add_remote(peer, info["md"])
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
        lpools[lay] = make_pool(f"local-{lay}", kind, lay, L, N, block_bytes, bench.device)
        lregs.append(register(bench.agent, lpools[lay].geometry.registration_ranges(),
                              lpools[lay].mem))
    slots = 2 * L * n_req
    # room for the request, and for gap reads (at most the whole remote pool)
    st_bytes = max(slots * seg, L * N * block_bytes if a.gap_kib != 0 else 0)
    staging = torch.empty(st_bytes + 512, dtype=torch.uint8, device=torch_device(bench.device))
    st_off = (-staging.data_ptr()) % 512
    staging = staging[st_off: st_off + st_bytes]
    st_base = staging.data_ptr()
    st_mem = "DRAM" if bench.device == "cpu" else "VRAM"
    lregs.append(register(bench.agent, [(st_base, st_base + st_bytes)], st_mem))
    sth = bench.agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                      staging_table(st_base, seg, slots), st_mem)
    arenas = [(st_base, staging)] + [ar for p in lpools.values() for ar in p.arenas]
    # mirrors of the remote contents for the READ oracle
    mirror = {lay: [layer_content(rseed[lay], la, N, seg, bench.device) for la in range(L)]
              for lay in layouts_r}
    # device-copy ceiling: the same bytes, one flat copy
    nbytes = n_req * L * block_bytes
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=torch_device(bench.device))
    dst = torch.empty_like(src)
    ct = []
    for _ in range(max(a.reps, 5)):
        bench.sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        bench.sync()
        ct.append(time.perf_counter() - t0)
    assert torch.equal(dst, src)
    d2d = nbytes / min(ct) / 1e9
    del src, dst
    print(f"   plain device copy of the same bytes: {d2d:8.1f} GB/s", flush=True)
    bench.results.append({"pool": tag, "pool_kind": pool_kind, "block_kib": block_bytes // 1024,
                          "case": "device copy", "mode": "torch copy_", "gbs": d2d,
                          "bytes": nbytes, "ok": True})
    gap = gap_for(bench, lpools, rgeo, rpeer)
    rng = np.random.default_rng(block_bytes)
    for pattern in patterns:
        k = 1 if pattern in ("scattered", "sparse") else int(pattern.removeprefix("runs"))
        if 4 * k > N or n_req < k:
            continue
        lids, rids = requests(pattern, N, n_req - n_req % k, rng)
        base_gbs: dict[str, float] = {}
        for op in ops:
            for lay_l, lay_r in cases:
                run_case(bench, op, pattern, tag, pool_kind, remote_kind, block_bytes,
                         lpools[lay_l], rgeo[lay_r], rpeer[lay_r], f"remote-{lay_r}",
                         mirror[lay_r], lids, rids, st_base, slots, sth, arenas, d2d,
                         base_gbs, st_bytes, gap)
    bench.agent.release_dlist_handle(sth)
    for r in lregs:
        bench.agent.deregister_memory(r)
    for peer in set(rpeer.values()):
        peer.call("drop")
    del lpools, mirror, staging, arenas
    if bench.device == "cuda":
        torch.cuda.empty_cache()


def gap_for(bench: Bench, lpools: dict[str, Pool], rgeo: dict[str, KVGeometry],
            rpeer: dict[str, Peer]) -> int:
    """The max gap of staged+gap READs: ``--gap-kib`` when given, else the budget of this
    transport measured now (two fused READs: one descriptor per isolated block, then one
    descriptor per layer over the same bytes' worth of pool)."""
    a = bench.args
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
        times, _, _, err = bench.timed_lists("READ", lp.mem, peer.name, lists, None, None,
                                             lambda: None, lambda: None)
        if err:
            raise RuntimeError(f"gap calibration READ failed: {err}")
        timings.append((len(plan), int(plan.length.sum()), min(times)))
    try:
        cost = TransportCost.from_timings(*timings)
    except ValueError as e:  # noise can defeat the model: then no gap reads, and say so
        bench.notes.append(f"{lp.geometry.label}: gap calibration failed ({e}); no gap reads")
        return 0
    gap = cost.gap_budget()
    print(f"   transport calibration: {cost.desc_cost_s * 1e6:.2f} us per descriptor, "
          f"{cost.bandwidth_bps / 1e9:.1f} GB/s -> gap budget {gap / 1024:.0f} KiB",
          flush=True)
    bench.notes.append(f"{lp.geometry.label}: {cost} gap budget {gap} B")
    return gap


def run_case(bench: Bench, op, pattern, tag, pool_kind, remote_kind, block_bytes, lp: Pool,
             rg: KVGeometry, peer: Peer, rname, mirror, lids, rids, st_base, slots, sth,
             arenas, d2d, base_gbs, st_bytes, gap_bytes: int) -> None:
    """All modes of one (local layout <- remote layout) case for one request."""
    a = bench.args
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
    before, after = hooks(bench, op, lp, peer, rname, lids, rids, mirror, L, N, seg)
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
            copier = bench.copier(arenas, executor)
        if per_request is not None:
            expect = nixl_merged_count(per_request[0], per_request[1],
                                       np.arange(len(per_request[0])),
                                       np.arange(len(per_request[0])))
        run = None
        if mode.startswith("vllm-agent"):
            li, ri = pair.desc_ids(lids, rids)
            gaps = "+gap" in mode
            run = bench.timed_agent(lp, peer.name, pair, li, ri, before, after,
                                    read_ranges=rg.read_ranges() if gaps else None,
                                    capacity=max(st_bytes, wire) + (1 << 20) if gaps
                                    else None)
            times, count, ctimes, err, expect = (run.times, run.count, run.copy_times,
                                                 run.err, run.expect)
            t_plan, wire = run.plan_s, run.wire
        elif "pipe" in mode:
            pieces = split_staged(sp, a.pipe)
            times, count, ctimes, err = bench.timed_pipe(op, lp.mem, peer.name, per_request,
                                                         pieces, copier, before, after)
        elif per_request is not None:
            times, count, ctimes, err = bench.timed_lists(op, lp.mem, peer.name,
                                                          per_request, copies, copier,
                                                          before, after)
        else:
            expect = nixl_merged_count(lt, rt, li, ri)
            lh = (sth if lt is st_table else
                  bench.agent.prep_xfer_dlist("NIXL_INIT_AGENT", lt, lp.mem))
            rh = bench.agent.prep_xfer_dlist(peer.name, rt, lp.mem)
            once = (lh, rh, lambda: None)  # tables prepared once, as vLLM does
            times, count, ctimes, err = bench.timed(op, lambda t=once: t, li, ri, copies,
                                                    copier, before, after)
            if lh is not sth:
                bench.agent.release_dlist_handle(lh)
            bench.agent.release_dlist_handle(rh)
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
        bench.results.append(row)
        print_row(row)
    if op == "WRITE":  # leave the remote as the READ oracle expects it
        peer.call("refill", rname)


def hooks(bench: Bench, op, lp: Pool, peer: Peer, rname: str, lids, rids, mirror, L, N, seg):
    torch = lazy_torch()
    if op == "READ":
        dev = lp.logical(0).device
        ridx = torch.as_tensor(rids, dtype=torch.long, device=dev)
        expected = [mirror[la][ridx] for la in range(L)]

        def before():
            poison(lp)

        def after():
            bench.sync()
            return check_blocks(lp, lids, expected, POISON)

        return before, after
    lseed = 77

    def before_w():
        fill(lp, lseed, bench.device)
        peer.call("refill", rname)

    def after_w():
        return peer.call("check_write", rname, np.asarray(rids).tolist(), lseed,
                         np.asarray(lids).tolist())

    return before_w, after_w
