"""What a run prints and records beside the rows: the environment, each row as it is measured,
and the READ summaries (against the fused path, and with the calibrated gap budget)."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any

from .pools import lazy_torch


def environment(device: str) -> dict:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                            "device": device}
    torch = lazy_torch()
    info["torch"] = torch.__version__
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl")
    except Exception:
        info["nixl"] = "?"
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:
            info["driver"] = "?"
        try:
            from importlib.metadata import version

            info["kvcached"] = version("kvcached")
        except Exception:
            info["kvcached"] = None
    info["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    return info


def print_row(r: dict) -> None:
    """One measurement, printed as it is made."""
    ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "  - "
    flag = "ok" if r["ok"] else f"FAIL {r['error']}"
    print(f"   {r['pattern']:9s} {r['op']:5s} {r['case']:13s} {r['mode']:17s} "
          f"descs {r['descs']:6d} -> NIXL {r['nixl_descs']:6d} "
          f"(exp {r['expected_nixl_descs']:6d})"
          f" {r['gbs']:8.2f} GB/s  x{ratio} of fused  copy {r['copy_ms']:6.2f} ms"
          f"  plan {r['plan_us']:7.0f} us  {flag}"
          + (f"  [plan/post/gather-plan/wire/gather ms {r['phases_ms']}]"
             if r.get("phases_ms") else ""), flush=True)


def summary(results: list[dict]) -> None:
    print("\n== summary: READ GB/s (ratio to the fused path: fused<-fused whole-blocks) "
          "[NIXL descs]")
    rows = [r for r in results if r.get("op") == "READ"]
    keys = sorted({(r["pool"], r["block_kib"], r["pattern"]) for r in rows},
                  key=lambda k: (k[0].split()[0], k[1], k[2]))
    for key in keys:
        sel = [r for r in rows if (r["pool"], r["block_kib"], r["pattern"]) == key]
        parts = []
        for r in sel:
            if r["case"] == "fused<-fused" and r["mode"] != "whole-blocks":
                continue
            ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else "-"
            label = "fused" if r["case"] == "fused<-fused" else f"{r['case']} {r['mode']}"
            mark = "" if r["ok"] else " FAIL"
            parts.append(f"{label}: {r['gbs']:.1f} ({ratio}) [{r['nixl_descs']}]{mark}")
        print(f"   {key[0]:>14s} {key[2]:9s} | " + " | ".join(parts))


def summary_gap(results: list[dict]) -> None:
    """The calibrated gap policy: every path may read gaps, the fused one too, so the fair
    baseline is the fused path with the same policy; bytes read are shown beside it."""
    rows = [r for r in results if r.get("op") == "READ" and "+gap" in r["mode"]
            and "pipe" not in r["mode"]]
    if not rows:
        return
    print("\n== summary: READ with the calibrated gap budget: GB/s, ratio to the fused path "
          "(whole-blocks) / to the fused path with the same gap policy, bytes read per byte "
          "requested")
    base = {(r["pool"], r["pattern"]): r for r in results
            if r.get("op") == "READ" and r["mode"] == "whole-blocks"}
    fgap = {(r["pool"], r["pattern"]): r for r in rows if r["case"] == "fused<-fused"}
    for r in sorted(rows, key=lambda r: (r["pool"].split()[0], r["block_kib"], r["pattern"],
                                         r["case"])):
        b, f = base.get((r["pool"], r["pattern"])), fgap.get((r["pool"], r["pattern"]))
        if b is None:
            continue
        vs_gap = f"{r['gbs'] / f['gbs']:.2f}" if f else "-"
        print(f"   {r['pool']:>14s} {r['pattern']:9s} {r['case']:13s} {r['gbs']:8.1f} GB/s  "
              f"x{r['gbs'] / b['gbs']:.2f} of fused  x{vs_gap} of fused+gap  "
              f"read x{r['wire_bytes'] / r['bytes']:.1f}  gap {r['max_gap'] >> 10} KiB"
              f"{'' if r['ok'] else '  FAIL'}")
