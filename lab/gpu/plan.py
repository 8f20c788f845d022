"""The GPU runs still owed, as device calls in order: what each sends, what it answers, what to
do when it fails -- checked by the dry run (:mod:`lab.gpu.dryrun`) against the device's limits
before any device time is spent.

    python3 -m scripts.gpu_plan              # every call's dry run, per session, with totals
    python3 -m scripts.gpu_plan --call A1    # one call's arguments for the device's run tool
    python3 -m scripts.gpu_plan --write      # the table in docs/gpu_plan.md (--check: compare)

A *session* is what one lease can hold: one kind of machine, started once (:data:`START_S`),
its calls back to back (each sends the working tree and the stage: :data:`CALL_OVERHEAD_S`),
at most 30 minutes of device time together (:data:`SESSION_LIMIT_S`, with the margin the
dry run's estimates carry).  The calls of one session use one stage, so a warm machine keeps
the unpacked site and the drawn weights between them (``/tmp`` survives the 30 s between
calls; the dry run still counts the unpacking and the drawing in every call, in case the
machine went back in between).
"""

from __future__ import annotations

import argparse
import json
import shlex
import string
from dataclasses import dataclass
from pathlib import Path

from lab import generated
from lab.gpu import dryrun, stage

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "gpu_plan.md"
COMMAND = "python3 -m scripts.gpu_plan --write"
START_S = 120          # a fresh machine: "a minute or more" (device README), counted once
CALL_OVERHEAD_S = 45   # sending <= 64 MiB and fetching the files back, and the next call's
                       # wait inside the 30 s a machine stays warm
SESSION_LIMIT_S = 1800
SESSION_USABLE = 0.95
HEADROOM = 3 << 19
"""What a call that carries part of a split stage leaves free of the 64 MiB (1.5 MiB): the
working tree grows with every commit, and such a call is sized to the file."""


@dataclass(frozen=True)
class Call:
    """One device call: its session, the machine kind, the stage it carries, the ``gpu_pd``
    invocations it runs (arguments after ``--stage``/``--out``), what it answers, and what to
    do if it fails."""

    id: str
    kind: str
    release: str
    invocations: tuple[tuple[str, ...], ...]
    answers: str
    if_fails: str
    kvcached: bool = False
    carry: tuple[str, ...] = ()
    """The stage's files this call carries, where not the whole folder: a stage over 64 MiB
    with the working tree travels in several calls back to back, those before the measuring
    call carrying files and running nothing, the measuring call finding their files where
    they left them (ignored outputs stay on a warm machine)."""

    @property
    def session(self) -> str:
        return self.id.rstrip(string.digits + string.ascii_lowercase)

    @property
    def stage(self) -> str:
        return f".gpu_stage/vllm-{self.release}"

    @property
    def carried(self) -> list[str]:
        return [f"{self.stage}/{f}" for f in self.carry] or [self.stage]


L8 = ("--geometry", "llama3-8b-full", "--prompt-lengths", "1500,4000,16000", "--repeat", "5",
      "--kv-cache-gib", "24")
L8_SPEED = ("--geometry", "llama3-8b-full", "--speed", "5", "--speed-warmup", "2",
            "--speed-lengths", "1500,4000,16000", "--kv-cache-gib", "10")
MLA = ("--geometry", "deepseek-v2-lite-full", "--prompt-lengths", "1500,4000,16000",
       "--repeat", "5")
MLA_SPEED = ("--geometry", "deepseek-v2-lite-full", "--speed", "5", "--speed-warmup", "2",
             "--speed-lengths", "1500,4000,16000", "--kv-cache-gib", "10")
KVC = ("--geometry", "llama3-8b", "--prompt-lengths", "1500,4000,16000", "--repeat", "5",
       "--kv-cache-gib", "24", "--no-load")
TP12 = ("--two-gpus", "--together", "--geometry", "llama3-70b", "--prompt-lengths",
        "1500,8000", "--repeat", "5", "--p-kv-cache-gib", "20", "--kv-cache-gib", "12")
TP21 = ("--two-gpus", "--together", "--geometry", "llama3-70b", "--prompt-lengths",
        "1500,8000", "--repeat", "5", "--p-kv-cache-gib", "10", "--kv-cache-gib", "24")
NEWEST = ("--geometry", "llama3-8b", "--prompt-lengths", "1500,4000,16000", "--repeat", "5",
          "--kv-cache-gib", "24")
COALESCE_ON = ("--speed-on-env", "PDPATCH_KV_COALESCE=1")

AGED_ONE = ("--geometry", "llama3-8b", "--prompt-lengths", "1500,4000,16000", "--repeat", "5",
            "--together")

CALLS: tuple[Call, ...] = (
    # --- A: Llama-3-8B at full width on 0.25.1 (where coalescing pays): the oracle at real
    # compute first, then TTFT with pdpatch's defaults, both start orders ---
    Call("A1", "nvidia-h200", "0.25.1", ((*L8, "ref", "coalesce"),),
         "full-width Llama-3-8B: the oracle's two controls caught and the answers intact at "
         "real compute; D's KV transfer time, stock vs PDPATCH_KV_COALESCE=1, 5 samples per "
         "pair and prompt (the stock pair started first)",
         "an engine that does not start: its log in logs.tar.xz; a control not caught voids "
         "the run's verdicts: stop the session and look at the recipe (lab/gpu/weights.py) "
         "before any TTFT call"),
    Call("A2", "nvidia-h200", "0.25.1", ((*L8_SPEED,),),
         "TTFT pdpatch on vs off (defaults) at full width, 5 paired rounds per length, the "
         "pdpatch pair started second",
         "a stopped start keeps the rounds it finished (gpu_speed.json 'stopped'); make it "
         "again only if fewer than 5 rounds per length came back"),
    Call("A3", "nvidia-h200", "0.25.1", ((*L8_SPEED, "--speed-on-first"),),
         "the same with the pdpatch pair started first (A2 + A3: crossed starts)", "as A2"),
    # --- B: the coalesced READ at full width: TTFT both orders, the transfer cell's second ---
    Call("B1", "nvidia-h200", "0.25.1", ((*L8_SPEED, *COALESCE_ON),),
         "TTFT coalesced vs stock at full width (PDPATCH_KV_COALESCE=1 on the pdpatch pair), "
         "the coalescing pair started second; each round's D NIXL time on vs off too",
         "as A2"),
    Call("B2", "nvidia-h200", "0.25.1", ((*L8_SPEED, *COALESCE_ON, "--speed-on-first"),),
         "the same with the coalescing pair started first (B1 + B2: crossed starts)", "as A2"),
    Call("B3", "nvidia-h200", "0.25.1", ((*L8, "coalesce", "ref"),),
         "A1 with the coalescing pair started first (A1 + B3: the transfer cell's crossed "
         "starts)", "as A1; A1's record stands alone (one order) until B3 is made"),
    # --- C: vLLM 0.26.0's aged D, both orders; vLLM 0.34.0, the newest release ---
    Call("C1", "nvidia-h200", "0.26.0", ((*AGED_ONE, "ref-aged", "coalesce-aged"),),
         "an aged D on 0.26.0: the first pass on a fresh D, then D aged by 1.5x its cache of "
         "local requests of mixed lengths finished in mixed order, then 5 samples per prompt: "
         "stock's and PDPATCH_KV_COALESCE=1's descriptors per READ and transfer time, answers "
         "judged, controls caught (the stock pair measured first)",
         "if stock's descriptors per READ after aging equal the first pass's, aging did not "
         "scatter D's blocks: that is the finding, do not retry; aging errors are in each "
         "scenario's 'aging'", kvcached=True),
    Call("C2", "nvidia-h200", "0.26.0", ((*AGED_ONE, "coalesce-aged", "ref-aged"),),
         "the same with the coalescing pair measured first (C1 + C2: crossed starts)",
         "as C1", kvcached=True),
    Call("C3a", "nvidia-h200", "0.34.0", (),
         "nothing measured: carries 0.34.0's FlashAttention 3 (18.7 MiB: its fat binary comes "
         "compressed, xz gains nothing) and the CUTLASS DSL but its MLIR library (20.6 MiB: "
         "cuda-bindings, quack, the DSL's CUDA 13 runtime), which do not fit beside the rest of "
         "the stage and the working tree; C3c and C3b must follow, each within the 30 s the "
         "machine stays warm", "make C3a, C3c and C3b again",
         carry=("fa3.so.xz", "cutlass.tar.xz")),
    Call("C3c", "nvidia-h200", "0.34.0", (),
         "nothing measured: carries the CUTLASS DSL's MLIR library (47.9 MiB in xz, 193 MB "
         "unpacked), which 0.34.0's engines import at their kernel warmup whatever the model "
         "(run dn: without it they did not start); C3b must follow within the 30 s",
         "make C3a, C3c and C3b again", carry=("cutlass_ir.so.xz",)),
    Call("C3b", "nvidia-h200", "0.34.0", ((*NEWEST, "ref", "coalesce"),),
         "vLLM 0.34.0 on the device's torch 2.11 (its kernels import no torch symbol that "
         "0.33.0's do not) with the CUTLASS DSL its kernel warmup imports: engines serve, "
         "answers intact, controls caught, stock vs coalesced, 5 samples per pair and prompt",
         "exit 3: the machine went back after C3a or C3c, make all three again; an import "
         "error names a missing package: carry its wheel (stage.WHEEL_PINS['0.34.0'], the "
         "DSL's in stage.CUTLASS_DSL['0.34.0']), rebuild the stage, dry-run, and make C3a, "
         "C3c and C3b again; an error inside cutlass or cuda.bindings (the driver, a version): "
         "the engine's log in logs.tar.xz, and the DSL's pins in stage.CUTLASS_DSL",
         carry=("site.tar.xz", "vllm_C.so.xz")),
    Call("C4", "nvidia-h200", "0.34.0", ((*NEWEST, "coalesce", "ref"),),
         "the same with the coalescing pair started first (C3b + C4: crossed starts)",
         "exit 3: the machine went back, make C3a and C3c again first; otherwise as C3b",
         carry=("site.tar.xz", "vllm_C.so.xz")),
    # --- D: a kvcached D on 0.26.0, both orders; full-width MLA's transfer cell ---
    Call("D1", "nvidia-h200", "0.26.0", ((*KVC, "ref", "kvc"),),
         "a kvcached D on 0.26.0 on the GPU: answers judged, controls caught, D's transfer "
         "time against the stock pair's, 5 samples per pair and prompt (stock first)",
         "a kvcached D that does not start: its log (KVCACHED_* settings, "
         "lab/gpu/engines.py); the stock pair's record stands", kvcached=True),
    Call("D2", "nvidia-h200", "0.26.0", ((*KVC, "kvc", "ref"),),
         "the same with the kvcached pair started first (D1 + D2: crossed starts)", "as D1",
         kvcached=True),
    Call("D3", "nvidia-h200", "0.26.0", ((*MLA, "ref", "coalesce"),),
         "full-width DeepSeek-V2-Lite (MLA, FLASH_ATTN_MLA): controls caught and answers "
         "intact at real compute; transfer stock vs coalesced, 5 samples per pair and prompt",
         "as A1", kvcached=True),
    # --- E: TP 1 <-> 2 on two GPUs after the prepared-once gather: run y's cells again ---
    Call("E1", "nvidia-h200-x2", "0.25.1", ((*TP12, "ref-tp12", "tp12", "coalesce-tp12"),),
         "P TP 1 -> D TP 2 (70B's KV): pdpatch's defaults and coalesced READs against stock, 5 "
         "samples per pair and prompt, answers judged, controls caught (stock first)",
         "a TP-2 engine that does not start (NCCL): its log; NVLink multicast stays off "
         "(lab/gpu/engines.py sets it)"),
    Call("E2", "nvidia-h200-x2", "0.25.1", ((*TP12, "coalesce-tp12", "tp12", "ref-tp12"),),
         "the same in the reverse order (E1 + E2: crossed starts)", "as E1"),
    Call("E3", "nvidia-h200-x2", "0.25.1", ((*TP21, "ref-tp21", "tp21", "coalesce-tp21"),),
         "P TP 2 -> D TP 1: the same cells", "as E1"),
    Call("E4", "nvidia-h200-x2", "0.25.1", ((*TP21, "coalesce-tp21", "tp21", "ref-tp21"),),
         "the same in the reverse order (E3 + E4: crossed starts)", "as E1"),
    # --- F: full-width MLA: the transfer cell's second order, TTFT both orders ---
    Call("F1", "nvidia-h200", "0.26.0", ((*MLA, "coalesce", "ref"),),
         "D3 with the coalescing pair first (D3 + F1: crossed starts)", "as A1",
         kvcached=True),
    Call("F2", "nvidia-h200", "0.26.0", ((*MLA_SPEED,),),
         "TTFT pdpatch on vs off at full-width MLA, the pdpatch pair second", "as A2",
         kvcached=True),
    Call("F3", "nvidia-h200", "0.26.0", ((*MLA_SPEED, "--speed-on-first"),),
         "the same with the pdpatch pair first (F2 + F3: crossed starts)", "as A2",
         kvcached=True),
    # --- G (beyond the 0.26.0): the aged D on 0.33.0, the newest release that has
    # served on the device ---
    Call("G1a", "nvidia-h200", "0.33.0", (),
         "nothing measured: carries 0.33.0's FlashAttention 3 (7.8 MiB); 0.33.0's whole stage "
         "and the working tree come to 64.0 MiB, too close to the limit for one call; G1b "
         "must follow within the 30 s the machine stays warm", "make G1a and G1b again",
         carry=("fa3.so.xz",)),
    Call("G1b", "nvidia-h200", "0.33.0", ((*AGED_ONE, "ref-aged", "coalesce-aged"),),
         "an aged D on 0.33.0 (strided READs on a fresh D): stock vs coalesced (the stock pair "
         "measured first)", "exit 3: the machine went back after G1a, make both again; "
         "otherwise as C1", carry=("site.tar.xz", "vllm_C.so.xz")),
    Call("G2", "nvidia-h200", "0.33.0", ((*AGED_ONE, "coalesce-aged", "ref-aged"),),
         "the same with the coalescing pair measured first (G1b + G2: crossed starts)",
         "exit 3: the machine went back, make G1a again first; otherwise as C1",
         carry=("site.tar.xz", "vllm_C.so.xz")),
)


SESSIONS = {
    "A": "Llama-3-8B at full width on 0.25.1: the oracle's controls at real compute, stock vs "
         "coalesced transfer (stock first), TTFT pdpatch on vs off at 1.5k / 4k / 16k, both "
         "start orders",
    "B": "the same model: TTFT coalesced vs stock, both orders; the transfer cell's second "
         "order",
    "C": "an aged D on 0.26.0, stock vs coalesced, both orders; vLLM 0.34.0 on the device, "
         "both orders",
    "D": "a kvcached D on 0.26.0, both orders; DeepSeek-V2-Lite (MLA) at full width: controls, "
         "transfer",
    "E": "TP 1 -> 2 and 2 -> 1 (70B's KV) after the prepared-once gather: defaults and "
         "coalesced vs stock, both orders",
    "F": "MLA at full width: the transfer cell's second order, TTFT on vs off both orders",
    "G": "an aged D on 0.33.0 (beyond the issue's 0.26.0: the newest release that has served "
         "on the device)",
}
"""What each session answers, in the order they should be made."""


def carry_groups(release: str, calls: tuple[Call, ...] = CALLS) -> list[tuple[str, ...]]:
    """The parts a split stage of ``release`` travels in, in the plan's order (each once)."""
    out: list[tuple[str, ...]] = []
    for c in calls:
        if c.release == release and c.carry and c.carry not in out:
            out.append(c.carry)
    return out


def session_of(calls: tuple[Call, ...] = CALLS) -> dict[str, list[Call]]:
    out: dict[str, list[Call]] = {}
    for c in calls:
        out.setdefault(c.session, []).append(c)
    return out


def invocation_args(call: Call, i: int) -> list[str]:
    out = "$OUT" if len(call.invocations) == 1 else f"$OUT/{i + 1}"
    return ["--stage", call.stage, "--out", out, *call.invocations[i]]


def dry_runs(call: Call) -> list[dryrun.CallPlan]:
    from lab.gpu import pd

    plans = []
    for i in range(len(call.invocations)):
        ap = pd.parser()
        args = ap.parse_args(invocation_args(call, i))
        pd.check_args(ap, args)
        plans.append(split_carry(call, dryrun.plan_call(args)))
    if not call.invocations:      # a call that only carries part of a stage
        plans.append(split_carry(call, dryrun.CallPlan(call.release)))
    return plans


def split_carry(call: Call, got: dryrun.CallPlan) -> dryrun.CallPlan:
    """A call carrying some of its stage's files: what travels is those files and the working
    tree (the dry run counted the whole folder)."""
    if not call.carry:
        return got
    built, _ = dryrun.stage_sizes(REPO / call.stage, False)
    sizes = {f: built.get(f, 0) for f in call.carry}
    got.errors += [f"{call.stage}/{f}: no size, built or recorded" for f in call.carry
                   if f not in built]
    got.carried = {**sizes, "working tree": dryrun.travelling_tree_bytes()}
    got.carried_note = (f"the rest of {call.stage} travels in the calls next to this one"
                        if not call.invocations else
                        f"the rest of {call.stage} was carried by the calls before")
    got.errors = [e for e in got.errors if "would carry" not in e]
    if sum(got.carried.values()) > dryrun.TRAVEL_LIMIT - HEADROOM:
        got.errors.append(f"the call would carry {sum(got.carried.values()) / 2**20:.1f} MiB, "
                          f"over {dryrun.TRAVEL_LIMIT >> 20} MiB less {HEADROOM / 2**20:g} "
                          "of headroom for the working tree: split the stage once more")
    if not got.steps:
        got.steps.append(dryrun.Step("nothing but the transfer (ls)", 2))
        got.files = []
    return got


def stop_after(plans: list[dryrun.CallPlan]) -> list[int]:
    """Each invocation's ``timeout -s TERM`` seconds: its share of :data:`dryrun.STOP_AT_S`."""
    total = sum(p.seconds for p in plans) or 1.0
    return [int(dryrun.STOP_AT_S * p.seconds / total) for p in plans]


def command(call: Call, plans: list[dryrun.CallPlan] | None = None) -> str:
    """The shell command of ``call`` for the run tool (run from the repository root)."""
    plans = plans or dry_runs(call)
    if not call.invocations:
        return f"ls -l {call.stage}"
    parts = ["export PYTHONUNBUFFERED=1"]
    if call.carry:      # the rest of the stage came with the calls before, on this machine
        files = " -a ".join(f"-f {call.stage}/{f}" for f in stage.archives(call.release))
        parts.append(f"test {files} || {{ echo 'the machine went back between the calls that "
                     "carry the stage: make them again'; exit 3; }")
    for i, stop in enumerate(stop_after(plans)):
        argv = invocation_args(call, i)
        if len(call.invocations) > 1:
            parts.append(f"mkdir -p {argv[3]}")
        parts.append(f"timeout -s TERM {stop} python3 -m scripts.gpu_pd "
                     + " ".join(a if a.startswith("$OUT") else shlex.quote(a) for a in argv))
    return "; ".join(parts)


def tool_arguments(call: Call) -> dict:
    """What to hand the device's ``run`` tool for ``call``."""
    return {"kind": call.kind, "command": command(call), "carry": call.carried,
            "timeout_s": dryrun.CALL_LIMIT_S}


@dataclass
class Checked:
    call: Call
    plans: list[dryrun.CallPlan]
    command: str

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.plans) * dryrun.MARGIN

    @property
    def errors(self) -> list[str]:
        out = [e for p in self.plans for e in p.errors]
        if len(self.command) > 2000:
            out.append(f"the command is {len(self.command)} characters, over 2,000")
        files = sum(len(p.files) for p in self.plans)
        if files > dryrun.FILES_BACK:
            out.append(f"{files} files back, over {dryrun.FILES_BACK}")
        return out


def check(calls: tuple[Call, ...] = CALLS) -> tuple[dict[str, list[Checked]], list[str]]:
    """Every call's dry runs, per session, and what breaks a session's limits."""
    sessions: dict[str, list[Checked]] = {}
    problems: list[str] = []
    for name, group in session_of(calls).items():
        kinds = {c.kind for c in group}
        if len(kinds) > 1:
            problems.append(f"session {name}: one machine kind per session, not {kinds}")
        checked = []
        for c in group:
            plans = dry_runs(c)
            checked.append(Checked(c, plans, command(c, plans)))
        sessions[name] = checked
        problems += [f"{ch.call.id}: {e}" for ch in checked for e in ch.errors]
        total = session_seconds(checked)
        if total > SESSION_LIMIT_S * SESSION_USABLE:
            problems.append(f"session {name}: {total / 60:.1f} device minutes, over "
                            f"{SESSION_USABLE:.0%} of {SESSION_LIMIT_S // 60}")
    return sessions, problems


def session_seconds(checked: list[Checked]) -> float:
    return START_S + sum(CALL_OVERHEAD_S + ch.seconds for ch in checked)


def table(sessions: dict[str, list[Checked]]) -> str:
    """The calls as docs/gpu_plan.md lists them."""
    rows = ["| call | machine | vLLM | device minutes (estimate x margin) | command "
            "(run from the repository root; carry the stage) | answers | if it fails |",
            "|---|---|---|---|---|---|---|"]
    for name, checked in sessions.items():
        for ch in checked:
            c = ch.call
            carry = ", ".join(f"`{x}`" for x in c.carried)
            rows.append(f"| {c.id} | `{c.kind}` | {c.release} | {ch.seconds / 60:.1f} | "
                        f"`{ch.command}` (carry {carry}) | {c.answers} | {c.if_fails} |")
        rows.append(f"| **{name}** | one session | | **{session_seconds(checked) / 60:.1f}** "
                    f"(with the machine's start and {CALL_OVERHEAD_S} s per call) | | | |")
    return "\n".join(rows)


def summary(sessions: dict[str, list[Checked]]) -> str:
    """The sessions in one table, with the totals."""
    total = sum(session_seconds(c) for c in sessions.values())
    calls = sum(len(c) for c in sessions.values())
    rows = [f"{calls} calls in {len(sessions)} sessions, about {total / 60:.0f} device minutes "
            "with the machines' starts: no one session's 30 minutes holds them, so the sessions "
            "go in the order of what the issue needs first.", "",
            "| session | machine | what it answers | calls | device minutes |",
            "|---|---|---|---|---|"]
    for name, checked in sessions.items():
        rows.append(f"| {name} | `{checked[0].call.kind}` | {SESSIONS[name]} | "
                    f"{', '.join(ch.call.id for ch in checked)} | "
                    f"{session_seconds(checked) / 60:.1f} |")
    return "\n".join(rows)


def text(sessions: dict[str, list[Checked]], problems: list[str]) -> str:
    lines = []
    for name, checked in sessions.items():
        lines.append(f"== session {name} ({checked[0].call.kind}): "
                     f"{session_seconds(checked) / 60:.1f} device minutes")
        for ch in checked:
            lines.append(f"-- {ch.call.id} ({ch.call.release}): {ch.seconds / 60:.1f} min "
                         f"(x{dryrun.MARGIN})")
            lines.append(f"   {ch.command}")
            for p in ch.plans:
                lines += ["   " + ln for ln in p.text().splitlines()]
    lines += [f"PROBLEM: {p}" for p in problems] or ["every call and session within limits"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--call", help="print one call's arguments for the device's run tool")
    mode.add_argument("--write", action="store_true", help="rewrite docs/gpu_plan.md's table")
    mode.add_argument("--check", action="store_true", help="exit 1 where docs/gpu_plan.md's "
                      "table differs from the plan")
    ap.add_argument("--dry-run", action="store_true", help="(the default: nothing is run)")
    args = ap.parse_args(argv)
    if args.call:
        call = next((c for c in CALLS if c.id == args.call), None)
        if call is None:
            ap.error(f"no call {args.call}; calls: {', '.join(c.id for c in CALLS)}")
        print(json.dumps(tool_arguments(call), indent=1))
        return 0
    sessions, problems = check()
    if args.write or args.check:
        page = DOC.read_text()
        new = generated.fill(page, COMMAND, {"calls": lambda: table(sessions),
                                             "sessions": lambda: summary(sessions)}, DOC.name)
        if args.check:
            if new != page:
                print(f"{DOC.name}: the calls differ from lab/gpu/plan.py: run {COMMAND}")
                return 1
            return 0
        DOC.write_text(new)
        return 0
    print(text(sessions, problems))
    return 1 if problems else 0
