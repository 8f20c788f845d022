#!/usr/bin/env python
"""Benchmark what sets the chunked READ's pace on the KV cache's own device (issue 24, item 2).

Why: in the engines (run cv, one H200) a chunk of ~31 MiB spent 0.54-1.88 ms in NIXL, so a
READ through the default 128 MiB staging buffer (two lanes of 32 MiB) moved at most ~70 GB/s,
where vLLM's own READ of 32 descriptors moved ~200 GB/s.  Which of a fixed cost per NIXL READ,
the bytes per READ, or the READs in flight sets that pace decides what to change: more lanes,
larger lanes, or the whole buffer for one READ.  Two sections, over real NIXL (UCX; cuda_ipc
between two processes on one GPU with ``--device cuda``, loopback on host memory otherwise):

* **raw**: NIXL READs of one contiguous range of each size, in 1 and in 8 descriptors, and 1,
  2 or 4 such READs in flight at once, polled as the chunk driver polls (every 20 us): the
  milliseconds from post to ``DONE`` and GB/s.
* **chunked**: a converted request (fused P -> split D, Llama-3-8B's 32 KiB segments, P's
  blocks in runs of ``--p-runs``, D's scattered) of each size, read per segment (the READ
  vLLM posts for it: the baseline, measured in the same run) and through the
  :class:`~pdpatch.kv.staging.StagingAgent` for every staging capacity x lanes x share (the
  module constants ``LANES`` and ``CHUNKED_SHARE``, set here for the run only) x gather
  (prepared once per READ, or per chunk as before), best of
  ``--reps`` wall times from post to ``DONE``, polled every ``--poll-ms`` as vLLM polls once
  per engine step; every path's bytes checked once; then one more READ at DEBUG for the
  chunk driver's own breakdown (NIXL, gather, a lane's next post).

What it showed (one H200, ``docs/gpu_results.md`` "Runs cz-da"): NIXL lands a 32 MiB chunk in
0.04-0.14 ms; the chunk driver's own host work (~0.4 ms a chunk, most of it preparing each
chunk's gather) set the pace, so the READ's gather is now prepared once (``--gather`` measures
both ways in one run); more lanes only add chunks.  NIXL's UCX needs
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` for a READ over cuda_ipc, as vLLM's engines are run.

Run on the GPU machine from the checkout root: ``PYTHONPATH=<site>:.
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on python3 -m scripts.bench_chunk_pace --device cuda --json
out.json``; on CPU: ``.venv/bin/python -m
scripts.bench_chunk_pace --device cpu --quick``.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import re
import sys
import time
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np

from lab.bench.chunked import _verify
from lab.bench.descriptors import _geo
from pdpatch.kv import PairPlan

BS, HEADS, DIM = 16, 8, 128
PEER = "bench-peer"
POLL_S = 20e-6                  # the chunk driver's sleep (pdpatch.kv.staging.chunked.POLL_S)
NUM_THREADS = 4                 # vLLM's default for its NIXL agent ("num_threads")


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(num_threads=NUM_THREADS, capture_telemetry=True))


def _memory(nbytes: int, seed: int, device: str) -> Any:
    import torch

    host = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes,
                                                                   dtype=np.uint8))
    return host.to(device) if device == "cuda" else host


def _peer(conn, nbytes: int, seed: int, device: str) -> None:
    import torch

    if device == "cuda":
        torch.zeros(1, device="cuda")       # a CUDA context before UCX starts, as vLLM's
    agent = _agent(PEER)
    buf = _memory(nbytes, seed, device)
    conn.send(int(buf.data_ptr()))
    mem = "VRAM" if device == "cuda" else "DRAM"
    regs = agent.register_memory([(int(buf.data_ptr()), nbytes, 0, "")], mem)
    conn.send(agent.get_agent_metadata())
    conn.recv()
    agent.deregister_memory(regs)
    conn.send(True)


def _wait(agent: Any, handles: list, poll_s: float) -> None:
    pending = list(handles)
    while pending:
        states = [agent.check_xfer_state(h) for h in pending]
        if any(s not in ("PROC", "DONE") for s in states):
            raise AssertionError(f"a READ ended {states}")
        pending = [h for h, s in zip(pending, states, strict=True) if s == "PROC"]
        if pending and poll_s:
            time.sleep(poll_s)


def _timed(agent: Any, lh, rh, ids: list[tuple[np.ndarray, np.ndarray]], poll_s: float
           ) -> tuple[float, float]:
    """Post one READ per (local, remote) pair of id arrays at once: (ms making them, ms from
    the first post until all are ``DONE``)."""
    t0 = time.perf_counter()
    handles = [agent.make_prepped_xfer("READ", lh, li, rh, ri) for li, ri in ids]
    t1 = time.perf_counter()
    for h in handles:
        if agent.transfer(h) not in ("PROC", "DONE"):
            raise AssertionError("a READ was refused")
    _wait(agent, handles, poll_s)
    t2 = time.perf_counter()
    for h in handles:
        agent.release_xfer_handle(h)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def raw(agent: Any, local: int, remote: int, mem: str, sizes: list[int], reps: int) -> list:
    """The raw section (see the module doc)."""
    out = []
    print(f"raw NIXL READs ({mem}), polled every {POLL_S * 1e6:.0f} us; best of {reps}")
    for size in sizes:
        for pieces in (1, 8):
            p = size // pieces
            span = 4 * size                                    # room for 4 in flight
            table = [(local + o, p, 0) for o in range(0, span, p)]
            lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, mem)
            rh = agent.prep_xfer_dlist(PEER, [(remote + a - local, n, d) for a, n, d in table],
                                       mem)
            for flight in (1, 2, 4):
                ids = [(np.arange(k * pieces, (k + 1) * pieces, dtype=np.int64),) * 2
                       for k in range(flight)]
                best = min((_timed(agent, lh, rh, ids, POLL_S) for _ in range(reps)),
                           key=lambda t: t[1])
                gbs = flight * size / best[1] / 1e6
                out.append({"size_mib": size >> 20, "pieces": pieces, "in_flight": flight,
                            "make_ms": best[0], "ms": best[1], "gb_s": gbs})
                print(f"  {size >> 20:5d} MiB x {flight} in flight, {pieces} descriptor"
                      f"{'s' if pieces > 1 else ' '} each: {best[1]:7.3f} ms ({gbs:6.1f} GB/s;"
                      f" making {best[0]:.3f} ms)")
            agent.release_dlist_handle(lh)
            agent.release_dlist_handle(rh)
    return out


@contextmanager
def _constants(lanes: int, share: int):
    """The staging's lane count and share for one configuration (restored after)."""
    from pdpatch.kv.staging import agent as ag
    from pdpatch.kv.staging import chunked as ch
    from pdpatch.kv.staging import reads as rd

    saved = ch.LANES, rd.CHUNKED_SHARE
    ch.LANES = rd.LANES = ag.LANES = lanes
    rd.CHUNKED_SHARE = share
    try:
        yield
    finally:
        ch.LANES = rd.LANES = ag.LANES = saved[0]
        rd.CHUNKED_SHARE = saved[1]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "chunked READ from" in msg and "DONE" in msg:
            self.lines.append(msg)


BREAKDOWN = {"nixl_ms": r"in NIXL median ([\d.]+)", "gather_ms": r"gathers median ([\d.]+)",
             "next_post_ms": r"next post after its gather: median ([\d.]+)",
             "make_ms": r"chunk's READ median ([\d.]+)", "chunks": r"DONE: (\d+) chunks"}


def _breakdown(line: str) -> dict[str, float]:
    out = {}
    for key, pat in BREAKDOWN.items():
        m = re.search(pat, line)
        if m:
            out[key] = float(m.group(1))
    return out


def main() -> int:
    import torch

    from pdpatch.log import logger

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--request-mib", default="188,500,2000",
                    help="request sizes (8B geometry: 1,500 / 4,000 / 16,000 tokens)")
    ap.add_argument("--capacity-mib", default="128,256,1024")
    ap.add_argument("--lanes", default="2,4,8")
    ap.add_argument("--share", default="2,1")
    ap.add_argument("--raw-mib", default="4,16,32,64,256")
    ap.add_argument("--p-runs", default="16",
                    help="P's blocks come in runs of this many (a fresh P: one run per request)")
    ap.add_argument("--gather", default="whole,per-chunk",
                    help="whole: the READ's gather prepared once (pdpatch's); per-chunk: "
                         "prepared chunk by chunk (before; the baseline of that change)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--poll-ms", type=float, default=1.0,
                    help="how often a READ is polled from outside (vLLM: once per step)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.request_mib, args.capacity_mib, args.raw_mib = "24,64", "8,32", "1,4"
        args.reps = min(args.reps, 2)
    mib = lambda s: [int(float(x) * 2**20) for x in s.split(",")]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    device, mem = args.device, ("VRAM" if args.device == "cuda" else "DRAM")
    seg = BS * HEADS * DIM * 2
    per_block = args.layers * 2 * seg
    req_blocks = [max(b // per_block, 1) for b in mib(args.request_mib)]
    blocks = 2 * max(req_blocks) + 16
    per_side = args.layers * 2 * blocks * seg
    raw_sizes = [s for s in mib(args.raw_mib) if 4 * s <= per_side]

    if device == "cuda":
        torch.zeros(1, device="cuda")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_peer, args=(child, per_side, 1234, device), daemon=True)
    proc.start()
    real = _agent("bench-init")
    remote_base = conn.recv()
    real.add_remote_agent(conn.recv())
    remote_bytes = np.random.default_rng(1234).integers(0, 256, per_side, dtype=np.uint8)
    local_t = torch.zeros(per_side, dtype=torch.uint8, device=device)
    local_base = int(local_t.data_ptr())
    reg = real.register_memory([(local_base, per_side, 0, "")], mem)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda"
                              else "cpu", "args": vars(args)}
    report["raw"] = raw(real, local_base, remote_base, mem, raw_sizes, args.reps)

    local = _geo("split", args.layers, blocks, BS, HEADS, 128, local_base)
    remote = _geo("fused", args.layers, blocks, BS, HEADS, 128, remote_base)
    pair = PairPlan(local, remote)
    lines = _Lines()
    logger.addHandler(lines)
    rng = np.random.default_rng(7)
    poll_s = args.poll_ms / 1e3
    report["chunked"] = []
    print(f"converted READs (fused P -> split D), {args.layers} layers x {2 * seg >> 10} KiB "
          f"per block, polled every {args.poll_ms} ms; best of {args.reps}, bytes checked")

    def zero() -> None:
        local_t.zero_()
        if device == "cuda":
            torch.cuda.synchronize()    # NIXL's copies run on UCX's stream, not torch's

    def check(plan) -> None:
        _verify(plan, local_t.cpu().numpy(), local_base, remote_bytes, remote_base)

    for run, n in ((r, n) for r in ints(args.p_runs) for n in req_blocks):
        run = min(run, n)
        starts = rng.choice(blocks // run, -(-n // run), replace=False) * run
        rids = np.concatenate([np.arange(s, s + run) for s in starts])[:n]
        lids = rng.choice(blocks, n, replace=False)
        lid, rid = pair.desc_ids(lids, rids)
        plan = pair.descs(lids, rids)
        size = plan.total_bytes
        lh = real.prep_xfer_dlist("NIXL_INIT_AGENT", pair.local_table(), mem)
        rh = real.prep_xfer_dlist(PEER, pair.remote_table(), mem)
        zero()
        base_ms = min(_timed(real, lh, rh, [(lid, rid)], poll_s)[1] if r else
                      _first(real, lh, rh, (lid, rid), poll_s, partial(check, plan))
                      for r in range(args.reps))
        real.release_dlist_handle(lh)
        real.release_dlist_handle(rh)
        print(f"  {size / 2**20:7.1f} MiB, P's blocks in runs of {run}, {lid.size} descriptors "
              f"per segment: {base_ms:8.2f} ms")
        for cap, lanes, share, gather in ((c, la, sh, g) for c in mib(args.capacity_mib)
                                          for la in ints(args.lanes) for sh in ints(args.share)
                                          for g in args.gather.split(",")):
            row = _staged(real, pair, (lid, rid), mem, local_t, (cap, lanes, share,
                          gather), args.reps, poll_s, (zero, partial(check, plan)),
                          lines)
            row.update(request_mib=size / 2**20, per_segment_ms=base_ms, p_run=run,
                       capacity_mib=cap >> 20, lanes=lanes, share=share, gather=gather)
            report["chunked"].append(row)
            parts = (f"{row['chunks']:.0f} chunks; medians per chunk: NIXL "
                     f"{row['nixl_ms']:.2f}, gather {row['gather_ms']:.2f}, next post "
                     f"{row.get('next_post_ms', 0):.2f}, making {row['make_ms']:.2f} ms"
                     if "chunks" in row else "one staged READ")
            print(f"    staging {cap >> 20:5d} MiB, {lanes} lanes, share 1/{share}, "
                  f"gather {gather}: "
                  f"{row['ms']:7.2f} ms ({size / row['ms'] / 1e6:6.1f} GB/s), "
                  f"{row['ms'] / base_ms:6.3f}x of per segment; {parts}")
            if "driver_us_per_chunk" in row:
                print("      the driver per chunk (us, calls): " + ", ".join(
                    f"{k} {v[0]:.0f} ({v[1]:g})"
                    for k, v in row["driver_us_per_chunk"].items()))
    logger.removeHandler(lines)
    real.deregister_memory(reg)
    conn.send("quit")
    conn.recv()
    proc.join(10)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def _first(agent, lh, rh, ids, poll_s, check) -> float:
    ms = _timed(agent, lh, rh, [ids], poll_s)[1]
    check()
    return ms


class _DriverClock:
    """Where the chunk driver's own time goes (lab only): each call it makes into NIXL and the
    staging buffer, and its ``_step``/``_post``/``_xfer``, timed on the instance for one READ.
    Why: a chunk's NIXL READ of ~32 MiB takes ~0.04 ms alone (the raw section), yet a chunk
    cycle ~0.5-1 ms; this says which of the driver's calls hold it."""

    WRAPPED = ("_step", "_post", "_xfer")

    def __init__(self, chunked: Any) -> None:
        self.total: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._chunked = chunked
        self._saved = (chunked._agent, chunked._staging)
        chunked._agent = _Timing(chunked._agent, self, "nixl.")
        chunked._staging = _Timing(chunked._staging, self, "buffer.")
        for name in self.WRAPPED:
            setattr(chunked, name, self.timed(name, getattr(chunked, name)))
        self._copier = chunked._staging._obj._copier
        self._index = self._copier.__dict__.get("_index")
        self._copier._index = self.timed("copier._index", self._copier._index)

    def timed(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] = self.total.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1
        return call

    def detach(self) -> None:
        self._chunked._agent, self._chunked._staging = self._saved
        for name in self.WRAPPED:
            delattr(self._chunked, name)
        if self._index is None:
            del self._copier._index
        else:
            self._copier._index = self._index

    def per_chunk(self, chunks: float) -> dict[str, list[float]]:
        """Per name: [us per chunk, calls per chunk]."""
        return {k: [round(v * 1e6 / chunks, 1), round(self.calls[k] / chunks, 2)]
                for k, v in sorted(self.total.items(), key=lambda kv: -kv[1])}


class _Timing:
    def __init__(self, obj: Any, clock: _DriverClock, prefix: str) -> None:
        self._obj, self._clock, self._prefix = obj, clock, prefix

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        return self._clock.timed(self._prefix + name, attr) if callable(attr) else attr


def _staged(real, pair, ids, mem, local_t, config, reps, poll_s, zero_check,
            lines: _Lines) -> dict:
    """One configuration (capacity, lanes, share, gather): best of ``reps`` READs
    through a fresh staging agent (the first checked), then one at DEBUG for the chunk
    driver's breakdown."""
    from pdpatch.kv.staging import StagingAgent
    from pdpatch.log import logger

    cap, lanes, share, gather = config
    lid, rid = ids
    zero, check = zero_check
    with _constants(lanes, share):
        staging = StagingAgent(real, mem_type=mem, capacity=cap, memory=lambda: [local_t],
                               gap=0, eager=True, buffer_at_start=True)
        lh = staging.prep_xfer_dlist("NIXL_INIT_AGENT", pair.local_table(), mem)
        rh = staging.prep_xfer_dlist(PEER, pair.remote_table(), mem)
        assert staging.mark_converted(rh, PEER)
        if gather == "per-chunk":       # the chunk driver's fallback, for every READ
            staging._staging.row_scatter = lambda *args: None
        try:
            zero()
            best = _first(staging, lh, rh, (lid, rid), poll_s, check)
            for _ in range(reps - 1):
                best = min(best, _timed(staging, lh, rh, [(lid, rid)], poll_s)[1])
            level = logger.level
            logger.setLevel(logging.DEBUG)
            lines.lines.clear()
            clock = _DriverClock(staging._chunked)
            try:
                _timed(staging, lh, rh, [(lid, rid)], poll_s)
            finally:
                logger.setLevel(level)
                clock.detach()
            row = {"ms": best, "not_staged": dict(staging.stats.not_staged)}
            if lines.lines:
                row.update(_breakdown(lines.lines[-1]))
                row["driver_us_per_chunk"] = clock.per_chunk(row["chunks"])
            return row
        finally:
            staging.release_dlist_handle(lh)
            staging.release_dlist_handle(rh)
            staging.close()


if __name__ == "__main__":
    sys.exit(main())
