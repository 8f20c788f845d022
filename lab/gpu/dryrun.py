"""``python3 -m scripts.gpu_pd ... --dry-run``: what a device call would carry, start and send, in
order, with an estimate of its device time and memory, checked against the device's limits --
on a machine without a GPU, without the stage unpacked, before a call spends device time.

The limits (``/work/.library/device/README.md``): a command runs at most 10 minutes
(:data:`CALL_LIMIT_S`; the plan's commands stop themselves earlier with ``timeout -s TERM``,
which the run turns into writing what it has, :data:`STOP_AT_S`); a session has 30 minutes of
device time, machine starts and idle time included (:mod:`lab.gpu.plan` sums the calls); what
travels (the working tree and the carried stage) is at most 64 MiB; at most 8 files come back.
Also checked: each GPU's memory for the engines alive at once, and that no engine reuses a
freed KV block during samples that are meant to be on a fresh engine (vLLM's free-block queue
hands out never-used blocks first; once a side has asked for more tokens than its cache holds,
its next requests get blocks earlier requests freed, which lie apart: that is the aged D's
case, :mod:`lab.gpu.aged`, and must not happen unnoticed anywhere else).

The time and memory figures are estimates, each constant with where it comes from: engine
starts and request times of the recorded runs (``docs/gpu/*.json``, ``start_s`` and ``ms``),
the device notes, and for full-width models arithmetic (FLOPs over an assumed share of the
H200's measured 790 TFLOP/s; bytes over its 4.3 TB/s).  :data:`MARGIN` covers their error; a
call whose estimate times the margin passes :data:`STOP_AT_S` is refused.
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from lab.gpu import aged, stage, weights
from lab.gpu.engines import KVCACHED_ENV, MAX_TOKENS, Scenario, placement

CALL_LIMIT_S = 600
STOP_AT_S = 560
"""The plan's ``timeout -s TERM`` per command: the run then stops its engines, judges and writes
what it finished (``Stopped``) well inside the tool's 600 s."""
MARGIN = 1.25
TRAVEL_LIMIT = 64 << 20
FILES_BACK = 8
GPU_GIB = 139.0           # "about 139 GiB of GPU memory" (device notes), per H200
GPU_USABLE = 0.95

# --- times, seconds -------------------------------------------------------------------------
UNPACK_S = 25             # xz of a ~60 MiB stage into ~300 MB (not logged yet; conservative:
                          # 0.34.0's 130 MiB into 590 MB took 6.9 s on the CPU machine)
SETUP_S = 15              # torch import, the C block encoder, the tiny model's weights
KVCACHED_BUILD_S = 25     # "about 20 s there" (lab/gpu/stage.py)
PAIR_START_S = 65         # runs cz-dk, TP 1 -> 1: start_s 44-105, median ~60
TP2_PAIR_START_S = 115    # runs y, ax (a TP-2 side): start_s 100-124
KVCACHED_PAIR_START_S = 170   # run dj: 169 (D first, then P on the shared GPU)
TOGETHER_EXTRA_S = 15     # per further pair started at once (--together: starts overlap)
STOP_S = 3
LOAD_S = 60               # 96 long requests under load: runs o, bd 17-83 s
AGING_TOKENS_PER_S = 60_000   # a narrow model's local prefill+decode, 32 in flight (estimate)
TINY_REQUEST_S = 0.45     # a narrow model's P/D request, HTTP and scheduling (runs cz-dk: 0.3-0.9)
TINY_BASELINE_S = 0.3
TINY_READ_S_PER_TOKEN = 70e-6   # 0.25.1 stock's per-descriptor READ at 8B: ~1 s at 16k (run dk)
TINY_DECODE_STEP_S = 0.006
WEIGHTS_FIXED_S = 10      # full width: drawing on the GPU is milliseconds; then bf16 to host
WEIGHTS_WRITE_BPS = 1.0e9     # and safetensors to the device's disk (assumed 1 GB/s)
WEIGHTS_LOAD_BPS = 2.0e9      # an engine reading them back from the page cache (assumed)
# full width, H200: 790 TFLOP/s bf16 measured (device notes); eager mode reaches a share
PEAK_FLOPS = 790e12
LINEAR_EFF = 0.35
ATTENTION_EFF = 0.25
HBM_BPS = 4.3e12 * 0.6
EAGER_STEP_S_PER_LAYER = 150e-6

# --- memory, GiB per GPU --------------------------------------------------------------------
OVERHEAD_GIB = {"narrow": 1.5, "full": 5.0}     # CUDA context, activations, NIXL buffers
KVCACHED_POOL_GIB = float(KVCACHED_ENV["KVCACHED_GPU_UTILIZATION"]) * GPU_GIB
STAGING_GIB = 1.0        # PDPATCH_KV_STAGING_MIB at most 1 GiB in the scenarios

RECORDED_STAGE = {
    "0.25.1": {"fa3.so.xz": 7994348, "site.tar.xz": 23312048, "vllm_C.so.xz": 18851040},
    "0.26.0": {"fa3.so.xz": 7992540, "site.tar.xz": 23706564, "vllm_C.so.xz": 19524008,
               "kvcached/": 397219},
    "0.33.0": {"fa3.so.xz": 8192280, "site.tar.xz": 27280128, "vllm_C.so.xz": 21240972},
    "0.34.0": {"fa3.so.xz": 19615552, "site.tar.xz": 28252316, "vllm_C.so.xz": 19105264,
               "cutlass.tar.xz": 21552756, "cutlass_ir.so.xz": 50188984},
}
"""Each stage's files as ``scripts/gpu_stage.sh`` built them here (2026-12-05), bytes: what the
dry run counts where ``.gpu_stage/vllm-X`` is not built on the machine it runs on (a fresh
checkout); the files' own sizes whenever it is."""


@dataclass
class Step:
    what: str
    seconds: float


@dataclass
class CallPlan:
    """One ``scripts/gpu_pd.py`` invocation as the dry run sees it."""

    release: str
    steps: list[Step] = field(default_factory=list)
    carried: dict[str, int] = field(default_factory=dict)
    carried_note: str = ""
    files: list[str] = field(default_factory=list)
    memory: list[tuple[str, float]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def ok(self) -> bool:
        return not self.errors

    def text(self) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in self.carried.items())
        lines = [f"dry run, vLLM {self.release}: nothing is started",
                 f"carried: {sum(self.carried.values()) / 2**20:.1f} MiB of "
                 f"{TRAVEL_LIMIT >> 20} ({parts})"
                 + (f"; {self.carried_note}" if self.carried_note else ""),
                 "in order:"]
        t = 0.0
        for s in self.steps:
            t += s.seconds
            lines.append(f"  {t:7.0f} s  (+{s.seconds:5.0f})  {s.what}")
        lines.append(f"estimate {self.seconds:.0f} s; x{MARGIN} = {self.seconds * MARGIN:.0f} s "
                     f"against the command's {STOP_AT_S} s stop (the tool's limit "
                     f"{CALL_LIMIT_S} s)")
        lines += [f"memory, peak per GPU: {what}: {gib:.1f} GiB of {GPU_GIB:.0f}"
                  for what, gib in self.memory]
        lines.append(f"files back: {len(self.files)} of {FILES_BACK}: {', '.join(self.files)}")
        lines += [f"warning: {w}" for w in self.warnings]
        lines += [f"REFUSED: {e}" for e in self.errors]
        lines.append("ok" if self.ok else "not ok")
        return "\n".join(lines)


def release_of(stage_dir: Path) -> str:
    """The vLLM release a stage folder holds, from its name (``.gpu_stage/vllm-0.25.1``)."""
    name = stage_dir.name
    return name.removeprefix("vllm-") if name.startswith("vllm-") else "?"


def stage_sizes(stage_dir: Path, kvcached: bool) -> tuple[dict[str, int], str]:
    """The stage's files (their sizes where built here, else the recorded size) and a note."""
    built = sorted(stage_dir.glob("*.xz"))
    if built:
        sizes = {f.name: f.stat().st_size for f in built}
        kvc = sorted((stage_dir / "kvcached").glob("*"))
        if kvc:                 # carried with the folder whether a scenario uses it or not
            sizes["kvcached/"] = sum(f.stat().st_size for f in kvc)
        elif kvcached:
            return sizes, f"{stage_dir} has no kvcached/: build it with --kvcached"
        return sizes, ""
    recorded = RECORDED_STAGE.get(release_of(stage_dir))
    if recorded is None:
        return {}, f"{stage_dir}: not built here and no recorded size"
    if kvcached and "kvcached/" not in recorded:
        return dict(recorded), f"{stage_dir}: recorded without kvcached/: build it with --kvcached"
    return dict(recorded), (f"{stage_dir} not built here: the sizes it had when built "
                            "(scripts/gpu_stage.sh builds it)")


def travelling_tree_bytes(repo: Path = stage.REPO) -> int:
    """What a call sends besides the carried paths: the tracked files as they are in the
    working tree now and the untracked files git does not ignore (device README)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], capture_output=True, check=True).stdout
    total = 0
    for f in {x for x in out.split(b"\0") if x}:
        p = repo / f.decode()
        if p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def split_stage(plan: CallPlan, stage_dir: Path, sizes: dict[str, int], tree: int) -> None:
    """A stage too large for one call, as the owed calls carry it (:mod:`lab.gpu.plan`): the
    measuring call carries its part, the calls before it the rest, each part checked with the
    working tree against the limit less the plan's headroom.  Nothing where the plan does not
    split ``stage_dir``'s release into exactly its files."""
    from lab.gpu import plan as owed

    groups = owed.carry_groups(plan.release)
    if not groups or {f for g in groups for f in g} != set(sizes):
        return
    calls = [c for c in owed.CALLS if c.release == plan.release]
    here = next(c.carry for c in calls if c.invocations and c.carry)
    before = [c.id for c in calls if not c.invocations]
    plan.carried = {**{f: sizes[f] for f in here}, "working tree": tree}
    plan.carried_note = "; ".join(filter(None, [
        plan.carried_note, f"the rest of {stage_dir} travels first, in {', '.join(before)}, "
        "back to back (lab/gpu/plan.py)"]))
    for g in groups:
        total = sum(sizes[f] for f in g) + tree
        if total > TRAVEL_LIMIT - owed.HEADROOM:
            plan.errors.append(f"the part of {stage_dir} with {', '.join(g)} and the working "
                               f"tree come to {total / 2**20:.1f} MiB, over {TRAVEL_LIMIT >> 20}"
                               f" MiB less {owed.HEADROOM / 2**20:g} of headroom: split the "
                               "stage once more (lab/gpu/plan.py)")


def model_cfg(geometry: str, max_len: int) -> dict:
    from lab.gpu import pd
    from lab.rig.model import tiny_config

    cfg = dict(pd.GEOMETRIES[geometry]) if geometry in weights.FULL else \
        {**tiny_config(), **pd.GEOMETRIES[geometry]}
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
    return cfg


def weight_gib(cfg: dict, full: bool) -> float:
    if full:
        return weights.checkpoint_bytes(cfg) / 2**30
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    return (2 * v * h + layers * 12 * h * h) * 2 / 2**30 + 0.05


def prefill_s(cfg: dict, n: int) -> float:
    """A full-width model's prefill of ``n`` tokens: its matmuls and its causal attention."""
    params = weights.parameters(cfg) - 2 * cfg["vocab_size"] * cfg["hidden_size"]
    linear = 2 * params * n / (PEAK_FLOPS * LINEAR_EFF)
    width = cfg["num_attention_heads"] * (
        (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]) / 2
        if "kv_lora_rank" in cfg else cfg.get("head_dim") or
        cfg["hidden_size"] // cfg["num_attention_heads"])
    attention = 2 * n * n * cfg["num_hidden_layers"] * width / (PEAK_FLOPS * ATTENTION_EFF)
    return linear + attention


def decode_step_s(cfg: dict, full: bool) -> float:
    if not full:
        return TINY_DECODE_STEP_S
    return weights.checkpoint_bytes(cfg) / HBM_BPS + \
        EAGER_STEP_S_PER_LAYER * cfg["num_hidden_layers"]


def request_s(cfg: dict, full: bool, n: int, out_tokens: int, *, pd: bool) -> float:
    """One request: a P/D request (P's prefill, D's READ, D's decode) or D's own (baseline)."""
    t = (TINY_REQUEST_S + TINY_READ_S_PER_TOKEN * n) if pd else TINY_BASELINE_S
    if full:
        t += prefill_s(cfg, n)
    return t + out_tokens * decode_step_s(cfg, full)


def pair_start_s(sc: Scenario, full_gib: float) -> float:
    base = KVCACHED_PAIR_START_S if sc.d_kvcached else \
        TP2_PAIR_START_S if max(sc.p_tp, sc.d_tp) > 1 else PAIR_START_S
    return base + full_gib * 2**30 / WEIGHTS_LOAD_BPS


def side_kv_gib(sc: Scenario, producer: bool, kv_gib: tuple[float, float]) -> float:
    """One side's KV cache, GiB per GPU, as :func:`lab.gpu.engines.kv_bytes` sizes it
    (``kv_gib``: the run's P and D sizes)."""
    own = sc.p_kv_gib if producer else sc.d_kv_gib
    return own if own is not None else kv_gib[0 if producer else 1]


def engine_gib(sc: Scenario, producer: bool, kv_gib: tuple[float, float], wgib: float,
               full: bool) -> float:
    tp = sc.p_tp if producer else sc.d_tp
    kv = KVCACHED_POOL_GIB if (not producer and sc.d_kvcached) else \
        side_kv_gib(sc, producer, kv_gib)
    staged = STAGING_GIB if not producer and sc.pdpatch else 0.0
    return wgib / tp + kv + OVERHEAD_GIB["full" if full else "narrow"] + staged


def pair_memory(scenarios: list[Scenario], two_gpus: bool, kv_gib: tuple[float, float],
                wgib: float, full: bool) -> list[float]:
    """GiB on each GPU with ``scenarios``' pairs alive at once."""
    gpus = [0.0, 0.0] if two_gpus else [0.0]
    for sc in scenarios:
        for producer, where in zip((True, False), placement(sc, two_gpus), strict=True):
            on = [0] if where is None else [int(g) for g in where.split(",")]
            for g in on:
                gpus[g] += engine_gib(sc, producer, kv_gib, wgib, full)
    return gpus


def prompt_traffic(lengths: tuple[int, ...], sc: Scenario, repeat: int) -> dict:
    """Tokens each side asks its KV cache for, by phase, as :func:`lab.gpu.pd.run_scenario`
    sends them (the first pass with its prefix-cache requests, the controls, the samples)."""
    longest, long_a = lengths[-1], lengths[-2]
    half = longest // 2 // 16 * 16
    out = MAX_TOKENS
    # P: each prompt, and hit-partial's new half (its first half and hit-full are cached)
    first_p = sum(lengths) + (longest - half)
    # D: each pull and D's own prefill of it (another salt: its own blocks), and for both
    # prefix-cache requests the new half and one block, pulled and prefilled
    first_d = 2 * sum(n + out for n in lengths) + 2 * (longest - half + out) + 2 * out
    ctl_p = 2 * long_a if sc.controls else 0
    ctl_d = 2 * (long_a + out) if sc.controls else 0
    samples_p = repeat * sum(lengths)
    samples_d = repeat * sum(n + out for n in lengths)
    return {"P": {"fresh": first_p + ctl_p, "samples": samples_p},
            "D": {"fresh": first_d + ctl_d, "samples": samples_d}}


def reuse_check(name: str, sc: Scenario, cfg: dict, lengths: tuple[int, ...], repeat: int,
                kv_gib: tuple[float, float]) -> list[str]:
    """Where a side would hand out freed blocks to a request meant for a fresh engine."""
    out = []
    traffic = prompt_traffic(lengths, sc, repeat)
    for side, producer in (("P", True), ("D", False)):
        if not producer and sc.d_kvcached:
            continue     # kvcached maps pages for each request: no free-block queue to age
        tp = sc.p_tp if producer else sc.d_tp
        gib = side_kv_gib(sc, producer, kv_gib)
        cap = aged.cache_tokens(int(gib * 2**30), cfg, tp)
        t = traffic[side]
        fresh = t["fresh"] + (0 if (sc.aged and not producer) else t["samples"])
        if fresh > cap:
            out.append(f"{name}: {side} asks for {fresh:,} tokens of a {cap:,}-token cache "
                       f"({gib:g} GiB) before its last {'sample' if repeat else 'request'}: "
                       "its later requests get blocks earlier ones freed (an aged engine); "
                       "give that side more cache (--kv-cache-gib, or the scenario's "
                       "p_kv_gib / d_kv_gib) or fewer --repeat rounds")
    return out


def kv_sides(args: argparse.Namespace) -> tuple[float, float]:
    """The run's P and D KV cache sizes, GiB per GPU."""
    p = args.p_kv_cache_gib if args.p_kv_cache_gib is not None else args.kv_cache_gib
    return p, args.kv_cache_gib


def plan_call(args: argparse.Namespace) -> CallPlan:
    """The dry run of one parsed ``gpu_pd`` command line."""
    from lab.gpu import pd

    release = release_of(args.stage)
    plan = CallPlan(release)
    scs = {n: pd.SCENARIOS[n] for n in args.scenarios}
    kvcached = any(sc.d_kvcached for sc in scs.values())
    sizes, note = stage_sizes(args.stage, kvcached)
    tree = travelling_tree_bytes()
    plan.carried = {**sizes, "working tree": tree}
    plan.carried_note = note
    if not sizes or note.endswith("--kvcached"):
        plan.errors.append(note)
    if sum(plan.carried.values()) > TRAVEL_LIMIT:
        split_stage(plan, args.stage, sizes, tree)
    if sum(plan.carried.values()) > TRAVEL_LIMIT:
        plan.errors.append(f"the call would carry {sum(plan.carried.values()) / 2**20:.1f} "
                           f"MiB, over {TRAVEL_LIMIT >> 20} MiB (the working tree alone "
                           f"{tree / 2**20:.1f} MiB: a large untracked or modified file?)")
    full = pd.is_full_width(args.geometry)
    _, max_len = pd.model_config(args.geometry, args.prompt_lengths,
                                 args.speed_lengths if args.speed else ())
    cfg = model_cfg(args.geometry, max_len)
    wgib = weight_gib(cfg, full)
    lengths = tuple(args.prompt_lengths)
    plan.steps += [Step(f"unpack the stage ({release})", UNPACK_S),
                   Step("torch, the block encoder", SETUP_S)]
    if full:
        plan.steps.append(Step(f"draw {args.geometry}'s weights on the GPU and write them "
                               f"({wgib:.1f} GiB)", WEIGHTS_FIXED_S + wgib * 2**30
                               / WEIGHTS_WRITE_BPS))
    if kvcached:
        plan.steps.append(Step("build kvcached against the device's torch", KVCACHED_BUILD_S))
    full_gib = wgib if full else 0.0
    orders = pd.scenario_orders(args.scenarios, args.cross) if args.scenarios else []
    for i, order in enumerate(orders):
        tag = " (crossed order)" if i else ""
        if args.together:
            together = [n for n in order if not scs[n].d_kvcached]
            if together:
                starts = [pair_start_s(scs[n], full_gib) for n in together]
                plan.steps.append(Step(f"start {len(together)} pairs together{tag}: "
                                       f"{', '.join(together)}",
                                       max(starts) + TOGETHER_EXTRA_S * (len(together) - 1)))
                plan.memory.append((f"pairs together{tag}",
                                    max(pair_memory([scs[n] for n in together], args.two_gpus,
                                                    kv_sides(args), wgib, full))))
        for name in order:
            sc = scs[name]
            if not (args.together and not sc.d_kvcached):
                plan.steps.append(Step(f"start pair {name}{tag}", pair_start_s(sc, full_gib)))
                plan.memory.append((f"pair {name}", max(pair_memory(
                    [sc], args.two_gpus, kv_sides(args), wgib, full))))
            plan.steps += scenario_steps(name, sc, cfg, full, lengths, args, tag)
            if i == 0:
                plan.errors += reuse_check(name, sc, cfg, lengths, args.repeat,
                                           kv_sides(args))
    if args.speed:
        plan.steps += speed_steps(args, cfg, full, full_gib)
        off_on = [pd.Scenario(False, "FLASH_ATTN", "FLASH_ATTN"),
                  pd.Scenario(True, "FLASH_ATTN", "FLASH_ATTN")]
        plan.memory.append(("speed: two pairs", max(pair_memory(
            off_on, False, kv_sides(args), wgib, full))))
    plan.steps.append(Step("stop, judge, write, compress the logs", 10))
    plan.files = files_back(args)
    if len(plan.files) > FILES_BACK:
        plan.errors.append(f"{len(plan.files)} files back, over {FILES_BACK}")
    for what, gib in plan.memory:
        if gib > GPU_GIB * GPU_USABLE:
            plan.errors.append(f"{what}: {gib:.0f} GiB on one GPU, over "
                               f"{GPU_USABLE:.0%} of {GPU_GIB:.0f} GiB")
    if plan.seconds * MARGIN > STOP_AT_S:
        plan.errors.append(f"estimated {plan.seconds:.0f} s (x{MARGIN}: "
                           f"{plan.seconds * MARGIN:.0f} s) passes the command's {STOP_AT_S} s "
                           "stop: split the call")
    if args.speed:
        plan.warnings += speed_reuse(args, cfg)
    if args.speed and args.speed_starts > 1 and args.speed_starts % 2:
        plan.warnings.append("an odd --speed-starts leaves the start orders uncrossed")
    return plan


def scenario_steps(name: str, sc: Scenario, cfg: dict, full: bool, lengths: tuple[int, ...],
                   args: argparse.Namespace, tag: str) -> list[Step]:
    longest, long_a = lengths[-1], lengths[-2]
    half = longest // 2 // 16 * 16
    first = [request_s(cfg, full, n, MAX_TOKENS, pd=True)
             + request_s(cfg, full, n, MAX_TOKENS, pd=False) for n in lengths]
    hits = request_s(cfg, full, longest - half, MAX_TOKENS, pd=True) \
        + request_s(cfg, full, longest, MAX_TOKENS, pd=False) + \
        2 * request_s(cfg, full, 16, MAX_TOKENS, pd=True)
    steps = [Step(f"{name}{tag}: D's local warm-up, {len(lengths)} prompts + 2 prefix-cache "
                  "requests, each with D's own prefill", 1 + sum(first) + hits)]
    if sc.controls:
        steps.append(Step(f"{name}{tag}: 2 controls (wrong blocks, another prompt's KV)",
                          2 * request_s(cfg, full, long_a, MAX_TOKENS, pd=True)))
    if args.repeat:
        if sc.aged:
            mlen = max(lengths) + MAX_TOKENS
            cache = aged.cache_tokens(int(side_kv_gib(sc, False, kv_sides(args)) * 2**30), cfg)
            tokens = aged.CYCLES * cache
            steps.append(Step(f"{name}{tag}: age D ({tokens:,.0f} tokens of local requests, "
                              f"{aged.IN_FLIGHT} in flight, max {mlen})",
                              30 + tokens / AGING_TOKENS_PER_S))
        per_round = sum(request_s(cfg, full, n, MAX_TOKENS, pd=True) for n in lengths)
        steps.append(Step(f"{name}{tag}: {args.repeat} rounds x {len(lengths)} prompts, "
                          f"{'aged' if sc.aged else 'fresh'} D", args.repeat * per_round))
    if sc.load and not args.no_load:
        steps.append(Step(f"{name}{tag}: {sc.load} requests under load", LOAD_S))
    if sc.kill_p:
        steps.append(Step(f"{name}{tag}: P killed, D fails its requests", 60))
    steps.append(Step(f"{name}{tag}: stop the pair", STOP_S))
    return steps


def speed_steps(args: argparse.Namespace, cfg: dict, full: bool, full_gib: float
                ) -> list[Step]:
    from lab.gpu import pd

    lengths = tuple(args.speed_lengths)
    rounds = args.speed_warmup + args.speed      # unmeasured rounds, then the measured ones
    per_round = 2 * sum(request_s(cfg, full, n, pd.SPEED_TOKENS, pd=True) for n in lengths)
    start = 2 * pair_start_s(pd.Scenario(False, "FLASH_ATTN", "FLASH_ATTN"), full_gib)
    steps = []
    for k, on_first in enumerate(pd.speed_orders(args.speed_on_first, args.speed_starts)):
        what = f"speed start {k + 1} (pdpatch pair {'first' if on_first else 'second'})"
        steps += [Step(f"{what}: start two pairs", start),
                  Step(f"{what}: {rounds} paired rounds x {len(lengths)} lengths "
                       f"({args.speed} measured)", rounds * per_round + 2 * STOP_S)]
    return steps


def speed_reuse(args: argparse.Namespace, cfg: dict) -> list[str]:
    """Where a speed pair's side would reuse freed blocks before its last round (fresh prompts
    every round): its later rounds are on an aged engine -- on 0.19-0.25 stock's READ is one
    descriptor per block either way, but a coalesced READ then merges fewer of P's blocks."""
    from lab.gpu import pd

    rounds = args.speed_warmup + args.speed
    cap = aged.cache_tokens(int(args.kv_cache_gib * 2**30), cfg)
    p = rounds * sum(args.speed_lengths)
    d = rounds * sum(n + pd.SPEED_TOKENS for n in args.speed_lengths)
    return [f"speed: {side} asks for {t:,} tokens of a {cap:,}-token cache over its "
            f"{rounds} rounds: rounds after about {cap * rounds // t} reuse freed blocks"
            for side, t in (("P", p), ("D", d)) if t > cap]


def files_back(args: argparse.Namespace) -> list[str]:
    files = ["logs.tar.xz"]
    if args.scenarios:
        files += ["gpu_pd.json", "gpu_pd.md"]
        if args.cross:
            files += ["gpu_pd-crossed.json", "gpu_pd-crossed.md"]
    if args.speed:
        files += ["gpu_speed.json"] if args.speed_starts == 1 else \
            [f"gpu_speed-{k + 1}.json" for k in range(args.speed_starts)]
    return files


def summary(plan: CallPlan) -> dict:
    """The plan as :mod:`lab.gpu.plan` sums it."""
    return {"release": plan.release, "seconds": round(plan.seconds),
            "carried_mib": round(sum(plan.carried.values()) / 2**20, 1),
            "files": plan.files, "errors": plan.errors, "warnings": plan.warnings,
            "memory_gib": {w: round(g, 1) for w, g in plan.memory}}

