"""The two checks beside the timings: the kvcached registration policy (registration sliced to
the planned blocks: a request past the plan fails cleanly and the peer lives on, while a
whole-storage registration silently reads) and what :mod:`pdpatch.transport` says about the
pools this run uses."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pdpatch.kv import BlockIdError, KVGeometry, PairPlan
from pdpatch.transport import check_transport

from .agents import register, wait
from .initiator import Bench
from .peer import Peer
from .pools import POISON, check_blocks, layer_content, lazy_torch, make_pool, poison


def policy(bench: Bench, kind: str) -> dict:
    """Sliced registration of an over-allocated pool (real kvcached on GPU): a request past
    the plan fails cleanly, the peer lives on; whole-storage registration reads silently."""
    torch = lazy_torch()
    a = bench.args
    L, bbytes = a.layers, 64 * 1024
    N = 64
    seg = bbytes // 2
    env = {"KVCACHED_CONTIGUOUS_LAYOUT": "true"} if kind == "kvcached" else {}
    peer = bench.peer(f"peer-policy-{kind}", env)
    out: dict[str, Any] = {"pool": kind, "planned_blocks": N}
    remote_kind = kind if kind == "kvcached" else ("host" if bench.device == "cpu" else "cuda")
    # host/cuda stand-in for over-allocation: plan fewer blocks than the pool holds
    # kvcached over-allocates by itself; a host/cuda stand-in holds 2N blocks, plans N
    info = peer.call("pool", "policy", remote_kind, "fused", L,
                     N if kind == "kvcached" else 2 * N, bbytes, 4242, "sliced", N)
    rgeo = KVGeometry.from_wire(info["geometry"], label="policy")
    assert rgeo.num_blocks == N
    out["registered_ranges"] = [[int(s), int(e)] for s, e in info["ranges"]]
    out["register_s"] = info["reg_s"]
    bench.add_remote(peer, info["md"])
    lp = make_pool("policy-local", "host" if bench.device == "cpu" else "cuda", "fused", L, N,
                   bbytes, bench.device)
    lreg = register(bench.agent, lp.geometry.registration_ranges(), lp.mem)
    pair = PairPlan(lp.geometry, rgeo)
    try:
        pair.descs([0], [N])
        out["planner_past_plan"] = "accepted (BAD)"
    except BlockIdError as e:
        out["planner_past_plan"] = f"BlockIdError: {e}"
    past = rgeo.layers[0].segment_addr(0, N + 1)
    loc = np.array([[lp.geometry.layers[0].base, seg, 0]], dtype=np.uint64)
    rem = np.array([[past, seg, 0]], dtype=np.uint64)
    out["sliced_past_plan_read"] = raw_read(bench, peer, loc, rem, lp.mem)
    out["peer_alive_after"] = peer.alive()
    # a valid request afterwards: byte-exact
    lids, rids = np.array([1, 2, 3]), np.array([N - 1, 0, 5])
    plan = pair.descs(lids, rids)
    poison(lp)
    lh = bench.agent.prep_xfer_dlist("NIXL_INIT_AGENT", plan.local_nx3(), lp.mem)
    rh = bench.agent.prep_xfer_dlist(peer.name, plan.remote_nx3(), lp.mem)
    h = bench.agent.make_prepped_xfer("READ", lh, np.arange(len(plan)), rh,
                                      np.arange(len(plan)))
    state = wait(bench.agent, h)
    bench.agent.release_xfer_handle(h)
    bench.agent.release_dlist_handle(lh)
    bench.agent.release_dlist_handle(rh)
    bench.sync()
    dev = lp.logical(0).device
    ridx = torch.as_tensor(rids, dtype=torch.long, device=dev)
    nb = N if kind == "kvcached" else 2 * N
    exp = [layer_content(4242, la, nb, seg, bench.device)[ridx] for la in range(L)]
    err = check_blocks(lp, lids, exp, POISON)
    out["valid_read_after"] = "byte-exact" if state == "DONE" and err is None else (
        f"{state} {err}")
    # contrast: what stock vLLM registers (the whole storage)
    info = peer.call("reregister", "policy", "whole")
    bench.add_remote(peer, info["md"])
    out["whole_registration_bytes"] = int(info["ranges"][0][1] - info["ranges"][0][0])
    out["whole_register_s"] = info["reg_s"]
    lp.logical(0).fill_(POISON)
    out["whole_past_plan_read"] = raw_read(bench, peer, loc, rem, lp.mem)
    bench.sync()
    first = lp.logical(0)[0, 0]
    out["whole_past_plan_bytes"] = (
        "all zero (zero page)" if bool((first == 0).all()) else
        "poison (nothing written)" if bool((first == POISON).all()) else "other bytes")
    out["peer_alive_end"] = peer.alive()
    bench.agent.deregister_memory(lreg)
    peer.call("drop")
    print(f"\n== registration policy ({kind}):")
    for k, v in out.items():
        print(f"   {k}: {v}")
    return out


def raw_read(bench: Bench, peer: Peer, loc, rem, mem: str) -> str:
    try:
        lh = bench.agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, mem)
        rh = bench.agent.prep_xfer_dlist(peer.name, rem, mem)
        h = bench.agent.make_prepped_xfer("READ", lh, np.array([0]), rh, np.array([0]))
        state = wait(bench.agent, h, timeout=60)
        bench.agent.release_xfer_handle(h)
        bench.agent.release_dlist_handle(lh)
        bench.agent.release_dlist_handle(rh)
        return f"succeeded ({state})"
    except Exception as e:
        return f"failed cleanly: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


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
