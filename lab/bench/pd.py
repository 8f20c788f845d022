#!/usr/bin/env python
"""Benchmark: P/D TTFT and decode throughput with pdpatch on vs off, in one run.

pdpatch is per process, so "on vs off" is two P/D pairs of real vLLM engines (same model, same
flags, ENABLE_PDPATCH=true vs false) started together and fed the *same* prompts, interleaved
request by request with alternating order, so machine noise (this box is shared) hits both
sides alike.  Every repetition uses fresh random prompts: a repeated prompt would hit D's prefix
cache and skip the NIXL transfer being measured.

Per request: TTFT through the proxy (P prefill round trip + D's first streamed token), D's
decode throughput (tokens after the first / their streaming time), and D's NIXL transfer time
(``/metrics``).  Prints medians per side and the ratio on/off (TTFT, xfer time) and off/on
(throughput), so > 1.00 always means "pdpatch is slower".  Goal: <= 1.02.

Usage: ``.venv/bin/python -m scripts.bench_pd [--reps 8] [--max-tokens 48]``
(``--record`` / ``--json PATH``: every request's times into a raw record,
:mod:`lab.bench.record`)
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab.bench import record
from lab.paired import median_ci, verdict
from lab.rig import proxy
from lab.rig.engine_env import runtime_versions
from lab.rig.model import model_dir, tiny_config
from lab.rig.servers import Engine, EngineGroup, EngineSpec, sigterm_as_interrupt

GOAL = 1.02


def group_rss_gib(engine: Engine) -> float:
    """Resident memory of an engine's session (API server, engine core, worker)."""
    if engine.proc is None:
        return 0.0
    out = subprocess.run(
        ["ps", "-o", "rss=", "--sid", str(engine.proc.pid)], capture_output=True, text=True
    ).stdout
    return sum(int(x) for x in out.split()) / 2**20


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=8, help="measured repetitions per prompt size")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured repetitions first")
    ap.add_argument("--sizes", default="100,500,1000", help="prompt lengths (tokens)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--log-dir", type=Path)
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    rec = record.Recorder("pd", args, argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdpatch-bench-"))
    vocab = tiny_config()["vocab_size"]
    rng = random.Random(7)

    print(f"engines: {runtime_versions().describe()}; model {model_dir()}; logs {log_dir}")
    rec.data["engines"] = runtime_versions().describe()
    specs = [
        EngineSpec("P-off", "kv_producer", pdpatch=False),
        EngineSpec("D-off", "kv_consumer", pdpatch=False),
        EngineSpec("P-on", "kv_producer", pdpatch=True),
        EngineSpec("D-on", "kv_consumer", pdpatch=True),
    ]
    sides = ("off", "on")
    ttft: dict[str, list[float]] = {s: [] for s in sides}
    tput: dict[str, list[float]] = {s: [] for s in sides}
    xfer: dict[str, list[float]] = {s: [] for s in sides}
    per_size: dict[tuple[str, int], list[float]] = {}
    # Paired ratios (same prompt, back to back): robust to slow periods on a shared machine.
    pair_ttft: list[float] = []
    pair_tput: list[float] = []
    mismatches = compared = 0
    try:
        with sigterm_as_interrupt(), EngineGroup(specs, log_dir) as g:
            start_s = g.start()
            rss = {e.spec.name: group_rss_gib(e) for e in g}
            print(
                f"4 engines healthy after {start_s:.0f}s; RSS GiB: "
                + ", ".join(f"{k} {v:.1f}" for k, v in rss.items())
            )
            on_lines = g["D-on"].pdpatch_lines()
            off_lines = g["D-off"].pdpatch_lines()
            print(f"pdpatch summary lines: D-on {len(on_lines)}, D-off {len(off_lines)}")
            if not on_lines or off_lines:
                print("ERROR: pdpatch is not active exactly on the 'on' pair", file=sys.stderr)
                return 1
            for side in sides:
                notes: list[str] = []
                proxy.warm_up(g[f"P-{side}"], g[f"D-{side}"], log=notes)
                for n in notes:
                    print(f"  {side}: {n}")
            t_bench = time.monotonic()
            for rep in range(args.warmup + args.reps):
                measured = rep >= args.warmup
                for n in sizes:
                    prompt = [rng.randrange(3, vocab) for _ in range(n)]
                    order = sides if (rep + n) % 2 == 0 else sides[::-1]
                    outs = {}
                    for side in order:
                        p, d = g[f"P-{side}"], g[f"D-{side}"]
                        r = proxy.pd_request(p, d, prompt, args.max_tokens)
                        outs[side] = r
                        if not measured:
                            continue
                        ttft[side].append(r.ttft_s)
                        per_size.setdefault((side, n), []).append(r.ttft_s)
                        if r.decode.decode_tok_per_s:
                            tput[side].append(r.decode.decode_tok_per_s)
                        if r.transfer and r.transfer.transfers:
                            xfer[side].append(r.transfer.xfer_time_s)
                    if measured:
                        on, off = outs["on"], outs["off"]
                        pair_ttft.append(on.ttft_s / off.ttft_s)
                        on_tps, off_tps = on.decode.decode_tok_per_s, off.decode.decode_tok_per_s
                        if on_tps and off_tps:
                            pair_tput.append(off_tps / on_tps)
                        compared += 1
                        mismatches += on.decode.token_ids != off.decode.token_ids
            bench_s = time.monotonic() - t_bench
    except KeyboardInterrupt:
        print("\ninterrupted; all engine processes stopped", file=sys.stderr)
        return 130

    rec.samples.update({"TTFT s": ttft, "decode tok/s": tput, "NIXL xfer s": xfer,
                        "TTFT s per size": {f"{side} {n}": v for (side, n), v in
                                            per_size.items()},
                        "paired TTFT on/off": pair_ttft, "paired decode tok/s off/on": pair_tput,
                        "outputs compared": compared, "outputs differing": mismatches})
    n_req = len(ttft["on"])
    print(f"\n{n_req} measured P/D requests per side, {args.max_tokens} tokens each, "
          f"prompt sizes {sizes}; bench {bench_s:.0f}s\n")
    print(f"{'metric':<28}{'pdpatch off':>14}{'pdpatch on':>14}{'ratio':>9}")
    rows = [
        ("TTFT median (ms)", med(ttft["off"]) * 1e3, med(ttft["on"]) * 1e3, True),
        ("decode tok/s median", med(tput["off"]), med(tput["on"]), False),
        ("NIXL xfer time median (ms)", med(xfer["off"]) * 1e3, med(xfer["on"]) * 1e3, True),
    ]
    for n in sizes:
        rows.append((f"  TTFT @ {n} tok (ms)", med(per_size[("off", n)]) * 1e3,
                     med(per_size[("on", n)]) * 1e3, True))
    for name, off, on, lower_is_better in rows:
        ratio = on / off if lower_is_better else off / on
        print(f"{name:<28}{off:>14.2f}{on:>14.2f}{ratio:>8.3f}x")
        rec.derived[f"{name.strip()}: off"] = off
        rec.derived[f"{name.strip()}: on"] = on
        rec.derived[f"{name.strip()}: ratio"] = ratio
    print(f"\noutputs on vs off identical: {compared - mismatches}/{compared}")
    print("\npaired ratios (same prompt back to back): median, 95% bootstrap CI of the median")
    for name, xs in (("TTFT on/off", pair_ttft), ("decode tok/s off/on", pair_tput)):
        lo, hi = median_ci(xs)
        rec.derived.update({f"paired {name}": med(xs), f"paired {name}: CI low": lo,
                            f"paired {name}: CI high": hi})
        print(f"  {name:<22}{med(xs):7.3f}x  [{lo:.3f} .. {hi:.3f}]")
    worst_med, said = verdict({"ttft": pair_ttft, "tput": pair_tput}, GOAL)
    print(f"RATIO (pdpatch on vs off, worst of paired TTFT and decode throughput): "
          f"{worst_med:.3f}x -- {said}")
    rec.derived.update({"worst paired ratio": worst_med,
                        "outputs identical": compared - mismatches, "outputs compared": compared})
    rec.data["verdict"] = said
    rec.finish()
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
