#!/usr/bin/env python
"""Benchmark staged READs larger than the staging buffer (issue 24, item 2): a converted
peer's request of 1-10x the staging capacity read through the :class:`StagingAgent` (one
staged READ at 1x, pipelined chunks above it) vs the per-segment READ vLLM posts for the same
request (what the agent did before for a request that did not fit), over real NIXL (UCX, host
DRAM, two processes on loopback), measured in the same run.

Geometry: a fused peer (P, FlashInfer-style ``[N, 2, bs, H, D]``) and a split local cache (D,
kvcached's split K/V), Llama-3-8B's per-layer segments (16 tokens x 8 KV heads x 128, bf16:
32 KiB), ``--layers`` layers.  Each round moves the same blocks in every mode, modes
interleaved, best wall time from post to ``DONE`` as vLLM would see it, polled every
``--poll-ms`` (vLLM polls once per engine step; 0 polls in a busy loop, which holds the GIL and
leaves the staging agent's chunk driver thread the interpreter's 5 ms switch interval: a worst
case no vLLM engine produces); every mode's bytes are checked in the first round.

Run: ``.venv/bin/python -m scripts.bench_chunked [--quick] [--capacity-mib 8] [--poll-ms 1]``
(``--record`` / ``--json PATH``: every sample into a raw record, :mod:`lab.bench.record`)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np

from lab.bench import record
from lab.bench.descriptors import _geo, _peer
from pdpatch.kv import PairPlan

BS, HEADS, DIM, ES = 16, 8, 128, 2
FACTORS = (1, 2.5, 4, 10)
PEER = "bench-peer"


def _read(agent, lh, rh, lid, rid, poll_s: float) -> float:
    """One READ posted and polled as vLLM does; seconds until it is seen ``DONE``."""
    t0 = time.perf_counter()
    h = agent.make_prepped_xfer("READ", lh, lid, rh, rid, notif_msg=b"bench")
    state = agent.transfer(h)
    while state == "PROC":
        if poll_s:
            time.sleep(poll_s)
        state = agent.check_xfer_state(h)
    dt = time.perf_counter() - t0
    agent.release_xfer_handle(h)
    if state != "DONE":
        raise AssertionError(f"READ ended {state}")
    return dt


def main(argv: list[str] | None = None) -> int:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from pdpatch.kv.staging import StagingAgent

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--capacity-mib", type=float, default=8.0,
                    help="staging buffer (vLLM's default is 128 MiB; scaled to host memory)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--poll-ms", type=float, default=1.0,
                    help="how often the READ is polled (vLLM: once per engine step; 0: busy)")
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    rec = record.Recorder("chunked", args, argv)
    capacity = int(args.capacity_mib * 2**20)
    seg = BS * HEADS * DIM * ES
    per_block = args.layers * 2 * seg
    req_blocks = [max(int(f * capacity) // per_block, 1) for f in FACTORS]
    blocks = 2 * max(req_blocks) + 16
    per_side = args.layers * 2 * blocks * seg

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, per_side, 1234), daemon=True)
    proc.start()
    real = nixl_agent("bench-init", nixl_agent_config(backends=["UCX"]))
    remote_base = conn.recv()
    remote_bytes = np.random.default_rng(1234).integers(0, 256, per_side, dtype=np.uint8)
    local_buf = np.zeros(per_side, dtype=np.uint8)
    local_base = int(local_buf.ctypes.data)
    local = _geo("split", args.layers, blocks, BS, HEADS, DIM, local_base)
    remote = _geo("fused", args.layers, blocks, BS, HEADS, DIM, remote_base)
    real.register_memory([(s, e - s, 0, "") for s, e in local.registration_ranges()], "DRAM")
    conn.send(("register", remote.registration_ranges()))
    real.add_remote_agent(conn.recv())
    pair = PairPlan(local, remote)
    assert pair.converts
    staging = StagingAgent(real, mem_type="DRAM", capacity=capacity,
                           memory=lambda: [torch.from_numpy(local_buf)], gap=0)
    lists = {}
    for name, agent in (("per-segment", real), ("staged", staging)):
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", pair.local_table(), "DRAM")
        rh = agent.prep_xfer_dlist(PEER, pair.remote_table(), "DRAM")
        lists[name] = (agent, lh, rh)
    assert staging.mark_converted(lists["staged"][2], PEER)

    reps = 3 if args.quick else 7
    rng = np.random.default_rng(7)
    poll_s = args.poll_ms / 1e3
    print(f"converted READs (fused P -> split D), {args.layers} layers x {2 * seg >> 10} KiB "
          f"per block, staging {capacity >> 20} MiB, NIXL UCX on host DRAM (loopback), polled "
          f"{'continuously' if not poll_s else f'every {args.poll_ms} ms'}; best of {reps} "
          "interleaved rounds, bytes checked")
    for factor, n in zip(FACTORS, req_blocks, strict=True):
        for pattern in ("scattered", "runs of 16"):
            if pattern == "scattered":
                lids, rids = (rng.choice(blocks, n, replace=False) for _ in range(2))
            else:
                starts = rng.choice(blocks // 16, -(-n // 16), replace=False) * 16
                rids = np.concatenate([np.arange(s, s + 16) for s in starts])[:n]
                lids = rng.choice(blocks, n, replace=False)
            lid, rid = pair.desc_ids(lids, rids)
            plan = pair.descs(lids, rids)
            best: dict[str, float] = {}
            walls: dict[str, list[float]] = {name: [] for name in lists}
            case = f"{factor:g}x staging, {pattern}"
            rec.samples[f"{case} (wall s per READ, one per round)"] = walls
            before = staging.stats.chunks
            for rnd in range(reps):
                for name, (agent, lh, rh) in lists.items():
                    if rnd == 0:
                        local_buf[:] = 0
                    dt = _read(agent, lh, rh, lid, rid, poll_s)
                    walls[name].append(dt)
                    if rnd == 0:
                        _verify(plan, local_buf, local_base, remote_bytes, remote_base)
                    best[name] = min(best.get(name, float("inf")), dt)
            chunks = (staging.stats.chunks - before) // reps
            mib = plan.total_bytes / 2**20
            rec.derived.update({
                f"{case}: MiB": mib, f"{case}: per-segment ms": best["per-segment"] * 1e3,
                f"{case}: staged ms": best["staged"] * 1e3, f"{case}: READs": chunks or 1,
                f"{case}: per-segment / staged": best["per-segment"] / best["staged"]})
            print(f"  {factor:4g}x staging ({mib:6.1f} MiB, {pattern:10s}): per-segment "
                  f"{best['per-segment'] * 1e3:8.2f} ms | staged {best['staged'] * 1e3:8.2f} ms"
                  f" ({chunks or 1} READ{'s' if chunks > 1 else ''}) | ratio per-segment/staged "
                  f"{best['per-segment'] / best['staged']:5.2f}")
    print(f"  staging stats: {staging.stats.staged_reads} staged READs, "
          f"{staging.stats.chunked_reads} chunked in {staging.stats.chunks} chunks, "
          f"{staging.stats.descriptors_staged} descriptors instead of "
          f"{staging.stats.descriptors_stock}; not staged: {dict(staging.stats.not_staged)}")
    for agent, lh, rh in lists.values():
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
    rec.derived.update({"staged READs": staging.stats.staged_reads,
                        "chunked READs": staging.stats.chunked_reads,
                        "chunks": staging.stats.chunks,
                        "descriptors staged": staging.stats.descriptors_staged,
                        "descriptors stock": staging.stats.descriptors_stock})
    staging.close()
    conn.send(("quit", None))
    conn.recv()
    proc.join(10)
    rec.finish()
    return 0


def _verify(plan, local_buf: np.ndarray, local_base: int, remote_bytes: np.ndarray,
            remote_base: int) -> None:
    for la, ra, n in zip(plan.local_addr.tolist(), plan.remote_addr.tolist(),
                         plan.length.tolist(), strict=True):
        lo, ro = la - local_base, ra - remote_base
        if not np.array_equal(local_buf[lo:lo + n], remote_bytes[ro:ro + n]):
            raise AssertionError("transferred bytes differ")


if __name__ == "__main__":
    sys.exit(main())
