"""The GPU run plan and its dry run, on the CPU (lab/gpu/plan.py, lab/gpu/dryrun.py,
lab/gpu/aged.py, the new options of lab/gpu/pd.py): every owed call fits the device's limits
(10 minutes a command, 30 minutes a session, 64 MiB carried, 8 files back, each GPU's memory)
and is checked before it spends device time; every cell gets five samples per pair and both
start orders; the aged D's driver does what it says; docs/gpu_plan.md lists the plan's calls.
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from pathlib import Path

import pytest

from lab.gpu import aged, dryrun, plan
from lab.gpu import pd as gpu_pd
from lab.rig.model import tiny_config

REPO = Path(__file__).resolve().parents[1]


def committed_tree_bytes() -> int:
    """The committed tree's size: what a call sends when nobody has large uncommitted files."""
    out = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "-l", "HEAD"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[3]) for line in out.splitlines() if line.split()[3] != "-")


@pytest.fixture
def committed_tree(monkeypatch):
    """The dry run sizes the working tree as it is; the tests size the committed one, so that
    a colleague's large uncommitted file does not fail them (the dry run itself refuses it)."""
    size = committed_tree_bytes()
    monkeypatch.setattr(dryrun, "travelling_tree_bytes", lambda repo=REPO: size)
    return size


def _args_for(release: str, *argv: str):
    ap = gpu_pd.parser()
    args = ap.parse_args(["--stage", f".gpu_stage/vllm-{release}", "--out", "/tmp/x", *argv])
    gpu_pd.check_args(ap, args)
    return args


def _args(*argv: str):
    return _args_for("0.25.1", *argv)


def test_every_owed_call_and_session_fits_the_devices_limits(committed_tree):
    sessions, problems = plan.check()
    assert problems == []
    for checked in sessions.values():
        assert len({ch.call.kind for ch in checked}) == 1
        assert plan.session_seconds(checked) <= plan.SESSION_LIMIT_S * plan.SESSION_USABLE
        for ch in checked:
            assert ch.seconds <= dryrun.STOP_AT_S
            assert len(ch.command) <= 2000
            assert all(sum(p.carried.values()) <= dryrun.TRAVEL_LIMIT for p in ch.plans)


def _cells(call: plan.Call) -> list[tuple]:
    """A call's measured cells, each with whether its pdpatch pair was measured before its
    stock pair (a transfer cell: the pdpatch scenario against the stock one of the same TP
    sizes in the same run; a TTFT cell: the pdpatch pair started first)."""
    out = []
    for inv in call.invocations:
        args = _args(*inv)
        key = (call.release, call.kind, args.geometry)
        for order in gpu_pd.scenario_orders(args.scenarios, args.cross):
            for name in order:
                sc = gpu_pd.SCENARIOS[name]
                if not sc.pdpatch:
                    continue
                (stock,) = [n for n in order if not gpu_pd.SCENARIOS[n].pdpatch
                            and (gpu_pd.SCENARIOS[n].p_tp, gpu_pd.SCENARIOS[n].d_tp)
                            == (sc.p_tp, sc.d_tp)]
                out.append(("transfer", *key, name, order.index(name) < order.index(stock)))
        if args.speed:
            for first in gpu_pd.speed_orders(args.speed_on_first, args.speed_starts):
                out.append(("ttft", *key, tuple(args.speed_on_env), first))
    return out


def test_every_cell_is_measured_in_both_start_orders_with_five_samples_per_pair():
    """The issue's repeated samples: each transfer cell and each TTFT cell at least 5 requests
    per pair and prompt, its pdpatch pair measured once before and once after its stock pair
    (another call, or --cross)."""
    seen: dict[tuple, set] = {}
    for call in plan.CALLS:
        for inv in call.invocations:
            args = _args(*inv)
            assert args.repeat >= 5 or not args.scenarios, call.id
            assert args.speed >= 5 or not args.speed, call.id
        for *key, first in _cells(call):
            seen.setdefault(tuple(key), set()).add(first)
    assert len(seen) >= 12
    for key, firsts in seen.items():
        assert firsts == {True, False}, key


def test_the_plan_covers_the_issues_runs():
    """Full-width Llama-3-8B and an MLA model (TTFT on vs off and coalesced vs stock at
    1.5k/4k/16k), an aged D on 0.26.0, TP 1 -> 2 and 2 -> 1 on two GPUs, a kvcached D on
    0.26.0, and the newest release staged (0.34.0)."""
    got = [(c, _args(*inv)) for c in plan.CALLS for inv in c.invocations]
    full = {a.geometry for _, a in got if gpu_pd.is_full_width(a.geometry)}
    assert {"llama3-8b-full", "deepseek-v2-lite-full"} <= full
    speed = [(a.geometry, tuple(a.speed_on_env)) for _, a in got if a.speed]
    assert ("llama3-8b-full", ()) in speed
    assert ("llama3-8b-full", ("PDPATCH_KV_COALESCE=1",)) in speed
    assert all(tuple(a.speed_lengths) == (1500, 4000, 16000) for _, a in got if a.speed)
    assert any(c.release == "0.26.0" and "coalesce-aged" in a.scenarios for c, a in got)
    assert any(c.release == "0.26.0" and "kvc" in a.scenarios for c, a in got)
    tp = {n for c, a in got if c.kind == "nvidia-h200-x2" for n in a.scenarios}
    assert {"tp12", "tp21", "coalesce-tp12", "coalesce-tp21"} <= tp
    assert max(c.release for c in plan.CALLS) == "0.34.0"


def test_the_run_tool_arguments_of_a_call(committed_tree):
    got = plan.tool_arguments(plan.CALLS[0])
    assert got["kind"] == "nvidia-h200" and got["carry"] == [".gpu_stage/vllm-0.25.1"]
    assert got["timeout_s"] == 600 and len(got["command"]) <= 2000
    assert got["command"].startswith("export PYTHONUNBUFFERED=1; timeout -s TERM ")
    assert "--out $OUT " in got["command"] and "python3 -m scripts.gpu_pd" in got["command"]


def test_every_calls_command_is_valid_shell(committed_tree):
    """A command the device's shell cannot parse costs a machine start and its device time."""
    for call in plan.CALLS:
        got = subprocess.run(["bash", "-n", "-c", plan.command(call)], capture_output=True,
                             text=True)
        assert got.returncode == 0, (call.id, got.stderr)


def test_docs_gpu_plan_lists_the_plans_calls(committed_tree):
    assert plan.main(["--check"]) == 0


def test_dry_run_refuses_what_breaks_a_limit(committed_tree):
    ok = dryrun.plan_call(_args("--geometry", "llama3-8b", "--prompt-lengths", "1500,4000",
                                "--repeat", "5", "ref", "coalesce"))
    assert ok.ok, ok.errors
    assert [s.what for s in ok.steps][:2] == ["unpack the stage (0.25.1)",
                                              "torch, the block encoder"]
    long = dryrun.plan_call(_args("--geometry", "llama3-8b-full", "--prompt-lengths",
                                  "1500,4000,16000", "--repeat", "5", "--kv-cache-gib", "24",
                                  "--cross", "ref", "coalesce"))
    assert any("split the call" in e for e in long.errors)
    reuse = dryrun.plan_call(_args("--geometry", "llama3-8b", "--prompt-lengths",
                                   "1500,16000", "--repeat", "20", "ref"))
    assert any("D asks for" in e and "reuse" not in e for e in reuse.errors)
    big = dryrun.plan_call(_args("--geometry", "llama3-8b-full", "--together",
                                 "--kv-cache-gib", "40", "--prompt-lengths", "100,200", "ref",
                                 "coalesce"))
    assert any("GiB on one GPU" in e for e in big.errors)
    files = dryrun.plan_call(_args("--speed", "1", "--speed-starts", "8", "--cross", "ref"))
    assert any("files back" in e for e in files.errors)


def test_dry_run_refuses_a_working_tree_too_large_to_travel(monkeypatch):
    monkeypatch.setattr(dryrun, "travelling_tree_bytes", lambda repo=REPO: 40 << 20)
    got = dryrun.plan_call(_args("--geometry", "llama3-8b", "ref"))
    assert any("over 64 MiB" in e for e in got.errors)


def test_dry_run_needs_no_gpu_and_exits_by_its_verdict(committed_tree, capsys):
    assert gpu_pd.main(["--stage", ".gpu_stage/vllm-0.25.1", "--out", "/tmp/x", "--dry-run",
                        "--geometry", "llama3-8b", "--prompt-lengths", "1500,4000",
                        "ref"]) == 0
    assert "nothing is started" in capsys.readouterr().out
    assert gpu_pd.main(["--stage", ".gpu_stage/vllm-0.25.1", "--out", "/tmp/x", "--dry-run",
                        "--geometry", "llama3-8b", "--prompt-lengths", "1500,16000",
                        "--repeat", "20", "ref"]) == 1


def test_an_aged_scenario_needs_repeated_samples(capsys):
    with pytest.raises(SystemExit):
        _args("ref-aged")
    assert "give --repeat" in capsys.readouterr().err
    assert gpu_pd.SCENARIOS["ref-aged"].aged and "ref-aged" in gpu_pd.REFERENCES
    assert gpu_pd.SCENARIOS["coalesce-aged"].d_env == {"PDPATCH_KV_COALESCE": "1"}


def test_orders_are_crossed():
    assert gpu_pd.scenario_orders(["ref", "coalesce"], True) == [["ref", "coalesce"],
                                                                 ["coalesce", "ref"]]
    assert gpu_pd.scenario_orders(["ref", "coalesce"], False) == [["ref", "coalesce"]]
    assert gpu_pd.speed_orders(False, 3) == [False, True, False]
    assert gpu_pd.speed_orders(True, 1) == [True]


def test_one_side_may_have_its_own_kv_cache(tmp_path):
    from lab.gpu.engines import Paths, Scenario, kv_bytes

    paths = Paths(tmp_path, tmp_path, tmp_path, kv_cache_bytes=12 << 30,
                  p_kv_cache_bytes=20 << 30)
    sc = Scenario(False, "FLASH_ATTN", "FLASH_ATTN")
    assert (kv_bytes(sc, paths, True), kv_bytes(sc, paths, False)) == (20 << 30, 12 << 30)
    aged_sc = gpu_pd.SCENARIOS["ref-aged"]
    assert kv_bytes(aged_sc, paths, True) == 32 << 30


# ------------------------------------------------------------------------------ the aged D

def test_a_cache_holds_what_its_bytes_and_the_models_kv_say():
    cfg = {**tiny_config(), **gpu_pd.GEOMETRIES["llama3-8b"]}
    assert aged.kv_bytes_per_token(cfg) == 128 << 10
    assert aged.cache_tokens(16 << 30, cfg) == 131_072
    assert aged.kv_bytes_per_token(cfg, tp=2) == 64 << 10
    mla = {**tiny_config(), **gpu_pd.GEOMETRIES["deepseek-v2-lite"]}
    assert aged.kv_bytes_per_token(mla) == 27 * 576 * 2
    assert aged.logged_cache_tokens("INFO ... GPU KV cache size: 131,072 tokens\n") == 131072
    assert aged.logged_cache_tokens("nothing") is None


def test_aging_asks_for_its_cycles_of_the_cache_in_mixed_lengths():
    plan_ = aged.plan_aging(100_000, random.Random(1), max_model_len=17408)
    total = sum(n + m for n, m in plan_)
    assert 1.5 * 100_000 <= total < 1.5 * 100_000 + 4100
    assert all(aged.PROMPT_RANGE[0] <= n <= aged.PROMPT_RANGE[1] for n, _ in plan_)
    assert len({n for n, _ in plan_}) > len(plan_) // 2 and len({m for _, m in plan_}) > 10
    assert plan_ == aged.plan_aging(100_000, random.Random(1), max_model_len=17408)
    short = aged.plan_aging(10_000, random.Random(1), max_model_len=1024)
    assert max(n + m for n, m in short) < 1024


def test_inversions_measure_how_unlike_the_sending_order_requests_finished():
    assert aged.inversions(list(range(10))) == 0.0
    assert aged.inversions(list(range(10))[::-1]) == 1.0
    shuffled = list(range(200))
    random.Random(2).shuffle(shuffled)
    assert 0.4 < aged.inversions(shuffled) < 0.6


def test_the_driver_keeps_requests_in_flight_and_records_their_finishing_order():
    """Requests whose times have nothing to do with their order finish out of it; each goes
    under its own salt, no more than ``in_flight`` at once."""
    lock, state = threading.Lock(), {"now": 0, "most": 0, "salts": set()}

    def complete(prompt, n, salt):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            state["salts"].add(salt)
        time.sleep(random.Random(len(prompt) * 31 + n).random() * 0.01)
        with lock:
            state["now"] -= 1
        return {"ids": [1] * n} if len(prompt) % 97 else {"error": "HTTP 500"}

    got = aged.age(complete, 20_000, 4096, in_flight=8)
    assert got["requests"] == len(state["salts"]) > 8
    assert state["most"] <= 8
    assert got["prompt_tokens"] + got["output_tokens"] >= 30_000
    assert got["inversions"] > 0.2
    assert got["failed"] == len(got["errors"]) or len(got["errors"]) == 10


def test_the_stage_leaves_out_blackwell_only_kernels_and_stages_0_34():
    """0.33+'s SM100 FMHA and FlashAttention 4 sources are left out (only models the engines
    never serve import them; with them 0.33.0's stage and the working tree passed 64 MiB);
    what the engines import from vllm/third_party stays.  0.34.0 is staged with 0.33.0's
    wheels."""
    from lab.gpu import stage

    assert not stage.wanted_vllm_member("vllm/third_party/fmha_sm100/decode_q8kv4/jit.py")
    assert not stage.wanted_vllm_member("vllm/third_party/tml_fa4/flash_fwd.py")
    assert stage.wanted_vllm_member("vllm/third_party/pynvml.py")
    assert stage.wanted_vllm_member("vllm/third_party/triton_kernels/__init__.py")
    assert "0.34.0" in stage.RELEASES
    assert stage.wheels_for("0.34.0") == stage.wheels_for("0.33.0")


def test_a_stage_too_large_for_one_call_travels_in_calls_back_to_back(committed_tree):
    """0.34.0's stage with the CUTLASS DSL and the working tree is about twice 64 MiB: the calls
    before the measuring one carry only files and run nothing, each of the stage's archives
    travels once, every call leaves headroom for the working tree, and the measuring calls
    check that every archive is still there before they start anything (exit 3)."""
    from lab.gpu import stage

    calls = [c for c in plan.CALLS if c.release == "0.34.0"]
    assert [c.id for c in calls] == ["C3a", "C3c", "C3b", "C4"]
    ids = [c.id for c in plan.CALLS]
    assert ids[ids.index("C3a"):ids.index("C4") + 1] == ["C3a", "C3c", "C3b", "C4"]
    assert len({c.session for c in calls}) == 1 and calls[0].session == "C"
    assert [c.invocations == () for c in calls] == [True, True, False, False]
    assert calls[3].carry == calls[2].carry
    assert plan.carry_groups("0.34.0") == [("fa3.so.xz", "cutlass.tar.xz"),
                                           ("cutlass_ir.so.xz",),
                                           ("site.tar.xz", "vllm_C.so.xz")]
    assert plan.tool_arguments(calls[2])["carry"] == [f"{calls[2].stage}/site.tar.xz",
                                                     f"{calls[2].stage}/vllm_C.so.xz"]
    for release in ("0.33.0", "0.34.0"):
        split = [c for c in plan.CALLS if c.release == release]
        carried = [f for g in plan.carry_groups(release) for f in g]
        assert sorted(carried) == sorted(stage.archives(release))
        assert len(carried) == len(set(carried))
        for c in split:
            cmd = plan.command(c)
            if not c.invocations:
                assert cmd == f"ls -l {c.stage}"
                continue
            check = cmd[:cmd.index("scripts.gpu_pd")]
            assert "exit 3" in check, c.id
            assert all(f"-f {c.stage}/{f}" in check for f in stage.archives(release)), c.id
        for c in split:
            for p in plan.dry_runs(c):
                assert sum(p.carried.values()) <= dryrun.TRAVEL_LIMIT - plan.HEADROOM, c.id
                assert set(p.carried) == {*c.carry, "working tree"}


def test_a_commands_own_dry_run_counts_what_its_call_carries_of_a_split_stage(committed_tree):
    """``gpu_pd --dry-run`` on 0.34.0's stage, which no one call carries: what C3b carries, the
    rest named as travelling first, every part within the limit less the headroom."""
    got = dryrun.plan_call(_args_for("0.34.0", *plan.NEWEST, "ref", "coalesce"))
    assert got.ok, got.errors
    c3b = next(c for c in plan.CALLS if c.id == "C3b")
    assert set(got.carried) == {*c3b.carry, "working tree"}
    assert "travels first, in C3a, C3c" in got.carried_note
    whole = dryrun.plan_call(_args_for("0.25.1", *plan.NEWEST, "ref"))
    assert set(whole.carried) == {"site.tar.xz", "vllm_C.so.xz", "fa3.so.xz", "working tree"}


def test_a_split_call_over_the_limit_less_headroom_is_refused(committed_tree, monkeypatch):
    """A call of a split stage is sized to the file: once the working tree has grown into the
    last 1.5 MiB, the dry run asks for one more split rather than risk the call."""
    c3c = next(c for c in plan.CALLS if c.id == "C3c")
    (carried,) = plan.dry_runs(c3c)
    room = dryrun.TRAVEL_LIMIT - sum(carried.carried.values())
    assert room >= plan.HEADROOM
    grown = committed_tree + room - plan.HEADROOM // 2
    monkeypatch.setattr(dryrun, "travelling_tree_bytes", lambda repo=REPO: grown)
    (over,) = plan.dry_runs(c3c)
    assert sum(over.carried.values()) <= dryrun.TRAVEL_LIMIT
    assert any("split the stage once more" in e for e in over.errors)


def test_0_34_stages_the_cutlass_dsl_its_kernel_warmup_imports():
    """Run dn: 0.34.0's kernel warmup imports MiniMax-M3's CuTe DSL kernels on every CUDA
    platform, so its stage carries vLLM's pins of the DSL (cu13 flavor) and quack, and
    cuda-bindings; earlier releases' stages are as they were."""
    from lab.gpu import stage, unpack

    pins = dict(w.split("==") for w in stage.CUTLASS_DSL["0.34.0"])
    assert pins["nvidia-cutlass-dsl"] == pins["nvidia-cutlass-dsl-libs-cu13"] == "4.8.0"
    assert pins["quack-kernels"] == "0.6.5" and "cuda-bindings" in pins
    assert "nvidia-cutlass-dsl-libs-cu12" not in pins
    assert stage.archives("0.34.0") == ["site.tar.xz", "vllm_C.so.xz", "fa3.so.xz",
                                        "cutlass.tar.xz", "cutlass_ir.so.xz"]
    assert stage.archives("0.33.0") == ["site.tar.xz", "vllm_C.so.xz", "fa3.so.xz"]
    assert unpack.OPTIONAL["cutlass_ir.so.xz"] == stage.CUTLASS_IR
    assert stage.CUTLASS_IR.startswith(unpack.CUTLASS_DSL + "/cutlass/")
    assert set(dryrun.RECORDED_STAGE["0.34.0"]) == set(stage.archives("0.34.0"))
