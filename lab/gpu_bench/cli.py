"""The command line of ``scripts/gpu_kv_bench.py``: the options, the sections of a run (each
one's failure recorded, the rest still run), the JSON report, and the two diagnostics that rerun
the script in fresh processes (``--diag-ctx``, ``--env-compare``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from . import __doc__ as PACKAGE_DOC
from .cases import run_block_size
from .checks import detect, policy
from .initiator import Bench
from .report import environment, summary, summary_gap

#: The command that the diagnostics run again, in fresh processes (from the checkout root).
COMMAND = ("-m", "scripts.gpu_kv_bench")
REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=PACKAGE_DOC.splitlines()[0])
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
    if a.device == "cuda" and os.environ.get("PDLAB_BENCH_NO_IPC_DEFAULT") != "1":
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
        os.environ["PDLAB_BENCH_NO_CTX"] = "1"
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
                    lambda kib=kib, ops=ops: run_block_size(bench, pk, kib * 1024, cases,
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
                run_block_size(bench, "kvcached", kib * 1024,
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
            section("warmup", lambda: run_block_size(
                bench, pools[0], 64 * 1024, [("fused", "fused")], ["scattered"], ["READ"]))
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
            report["policy"] = [p for p in (section(f"policy {k}", lambda k=k: policy(bench, k))
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
        cmd = [sys.executable, *COMMAND, "--device", "cuda", "--pools", "cuda",
               "--block-kib", "64,64", "--patterns", "scattered", "--cases", "ff",
               "--write-kib", "0", "--gap-kib", "0", "--pool-mib", "64", "--reps", "2",
               "--no-policy", "--no-detect", "--no-warmup", "--json", path, *extra]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
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
            env["PDLAB_BENCH_NO_IPC_DEFAULT"] = "1"
        path = f"/tmp/pdpatch_envcmp_{os.getpid()}_{val}.json"
        cmd = [sys.executable, *COMMAND, "--device", "cuda", "--pools", "cuda",
               "--block-kib", "64", "--patterns", "scattered,runs16", "--cases", "ff",
               "--write-kib", "0", "--pool-mib", "256", "--reps", "3", "--no-policy",
               "--no-detect", "--json", path]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
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
