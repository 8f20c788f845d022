"""The GPU P/D scripts' logic that CI can check without a GPU: the oracle that tells numeric drift
from corrupted KV (lab/gpu/oracle.py), the fat-binary pruning and the stage's size check
(lab/gpu/stage.py), the control's block rotation and the results table (lab/gpu/pd.py)."""

from __future__ import annotations

import json
import struct

import pytest

from lab.gpu import engines, fatbin_prune, oracle, stage
from lab.gpu import pd as gpu_pd

D = oracle.Decoded


def test_tolerance_is_the_reference_drift_scaled_and_clamped():
    ref = {"short": (D([5, 6], [-1.0001, -2.0]), D([5, 6], [-1.0, -2.0]), None),
           "long": (D([7], [-0.50]), D([7], [-0.51]), None),
           "near-p": (D([7], [-0.50]), D([7], [-0.51]), -0.502),
           "wild": (D([7], [-0.1]), D([7], [-0.9]), None)}
    tol = oracle.calibrate({k: [v] for k, v in ref.items()}, "FLASH_ATTN: ref").tol
    assert tol["short"] == oracle.FLOOR
    assert tol["long"] == pytest.approx(oracle.FACTOR * 0.01)
    assert tol["near-p"] == pytest.approx(oracle.FACTOR * 0.002)
    assert tol["wild"] == oracle.CAP


def test_a_near_tie_the_reference_flips_itself_is_accepted_within_its_drift():
    """Run s/t's hit-partial: the stock pair decodes 362 where D's own prefill gives 403, the
    two logprobs 0.034 apart; the old oracle refused such a reference (and, borrowing a
    tolerance, marked the same answer of stock and pdpatch alike as corrupted)."""
    cal = oracle.calibrate({"hit-partial": [(D([362], [-0.8751]), D([403], [-0.8408]), None)],
                            "gone": [(D([], []), D([5], [-1.0]), None)]}, "FLASH_ATTN: ref")
    assert cal.ties == {"hit-partial": [362]} and "gone" not in cal.tol
    assert cal.tol["hit-partial"] == pytest.approx(oracle.FACTOR * 0.0343)
    base = D([403], [-0.8408])
    v = oracle.judge(D([362], [-0.8751]), base, cal.tol["hit-partial"], None, [362])
    assert v.intact and "near-tie" in v.reason
    assert not oracle.judge(D([362], [-0.8751]), base, cal.tol["hit-partial"]).intact
    assert not oracle.judge(D([362], [-3.0]), base, cal.tol["hit-partial"], None, [362]).intact
    assert not oracle.judge(D([17], [-0.85]), base, cal.tol["hit-partial"], None, [362]).intact


def test_drift_within_tolerance_is_intact_even_when_a_later_token_flips():
    v = oracle.judge(D([3, 4, 9], [-0.2, -0.3, -0.4]), D([3, 4, 8], [-0.201, -0.3, -0.4]), 2e-3)
    assert v.intact and v.agree == 2


def test_the_nearer_reference_counts():
    """Mixed kernels: P/D sits near P's own first token, away from D's own prefill."""
    pd, base = D([3], [-0.20]), D([3], [-0.23])
    assert not oracle.judge(pd, base, 5e-3).intact
    v = oracle.judge(pd, base, 5e-3, p_own=-0.202)
    assert v.intact and v.dlp0 == pytest.approx(0.002)


@pytest.mark.parametrize(("pd", "why"), [
    (D([4, 4], [-0.2, -0.3]), "first token 4 != 3"),
    (D([3, 4], [-0.25, -0.3]), "first-token logprob off by 5.00e-02"),
    (D([], []), "no tokens decoded"),
])
def test_corruption_is_caught(pd, why):
    v = oracle.judge(pd, D([3, 4], [-0.2, -0.3]), 2e-3)
    assert not v.intact and why in v.reason


def test_the_oracle_is_proven_only_when_every_control_is_caught():
    caught = oracle.judge(D([4], [-1.0]), D([3], [-0.2]), 1e-2)
    missed = oracle.judge(D([3], [-0.2]), D([3], [-0.2]), 1e-2)
    assert oracle.judge_run({"a": caught}).oracle_proven
    run = oracle.judge_run({"a": caught, "b": missed})
    assert not run.oracle_proven and run.missed == ["b"] and run.caught == 1
    assert not oracle.judge_run({}).oracle_proven


def test_wrong_blocks_control_reads_the_first_block_everywhere():
    assert oracle.repeated_block([10, 11, 12]) == [10, 10, 10]
    assert gpu_pd.repeat_first_block({"remote_block_ids": [[1, 2], [3, 4]], "x": 1}) == \
        {"remote_block_ids": [[1, 1], [3, 3]], "x": 1}
    with pytest.raises(ValueError, match="at least two blocks"):
        oracle.repeated_block([10])


def test_judge_counts_errored_controls_as_no_evidence():
    res = {"scenario": "ref", "controls": {
        "wrong-blocks": {"prompt": "p", "ids": [9], "lp": [-3.0]},
        "other-prompt": {"prompt": "p", "error": "HTTP 500"}},
        "requests": {"p": {"pd": {"ids": [1], "lp": [-0.1]}, "base": {"ids": [1], "lp": [-0.1]}}},
        "P": "FLASH_ATTN", "D": "FLASH_ATTN"}
    gpu_pd.judge([res], {"FLASH_ATTN": {"sequential": oracle.Calibration("x", {"p": 1e-2})}})
    assert res["oracle"] == {"oracle_proven": True, "caught": 1, "controls": 1, "missed": []}
    assert res["controls"]["other-prompt"]["caught"] is None
    assert res["requests"]["p"]["intact"]
    assert "| ref |" in gpu_pd.markdown([{**res, "pdpatch": False, "hashseed": "0",
                                          "start_s": 1.0}], "GPU")


def test_load_answers_are_judged_against_d_own_prefill_and_errors_kept():
    requests = {"p": {"base": {"ids": [1, 2], "lp": [-0.1, -0.2]}},
                "q": {"base": {"ids": [4], "lp": [-0.5]}}}
    load = {"seconds": 1.0, "kvcached_used": gpu_pd.churn([0, 8, 8, 4, 0]), "answers": [
        ("p", {"ids": [1, 2], "lp": [-0.1, -0.2], "pulled": 1}),
        ("q", {"ids": [9], "lp": [-4.0], "pulled": 1}),
        ("p", {"error": "HTTP 500: engine dead"})]}
    gpu_pd.judge_load(load, requests, oracle.Calibration("x", {"p": 1e-2, "q": 1e-2}))
    assert (load["requests"], load["intact"]) == (3, 1)
    assert load["errors"] == ["HTTP 500: engine dead"]
    assert [v["prompt"] for v in load["not_intact"]] == ["q"]
    assert load["kvcached_used"] == {"samples": 5, "grew": 1, "shrank": 2, "min": 0, "max": 8}
    row = {"scenario": "kvc", "pdpatch": True, "P": "A", "D": "A", "hashseed": "0",
           "start_s": 1.0, "requests": {}, "controls": {}, "load": load}
    said = f"3 at once ({gpu_pd.LOAD_IN_FLIGHT} in flight): 1 intact"
    assert said in gpu_pd.markdown([row], "GPU")


def test_kvcached_mapped_memory_is_read_from_its_shared_record(tmp_path):
    assert engines.kvcached_used("eng", tmp_path) is None
    (tmp_path / "eng").write_bytes(struct.pack("<qqq", 1 << 30, 6 << 20, 2 << 20))
    assert engines.kvcached_used("eng", tmp_path) == 6 << 20


def test_paired_verdict_says_within_above_or_inconclusive():
    from lab.paired import verdict

    assert verdict({"a": [1.0, 1.001, 0.999] * 10}, 1.02)[1].startswith("within")
    assert verdict({"a": [1.2, 1.21, 1.19] * 10}, 1.02)[1].startswith("ABOVE")
    assert verdict({"a": [0.9, 1.1, 1.0, 0.95, 1.08]}, 1.02)[1].startswith("INCONCLUSIVE")


def test_speed_pairs_each_request_with_its_twin_and_keeps_the_ratios(monkeypatch):
    """``gpu_pd.speed`` without engines: the "on" pair answers 1.1x slower with twice D's
    transfer time; a request that pulled nothing gives no transfer ratio; --speed-control runs
    both pairs stock; --speed-on-first starts the pdpatch pair first and still divides on by
    off."""
    from lab.rig.proxy import Completion, PDResult, TransferStats

    started = {}

    class Eng:
        def __init__(self, on: bool) -> None:
            self.on = on

        def stop(self) -> None:
            pass

    def start_pair(name, sc, paths):
        started[name] = sc.pdpatch
        return Eng(name == "speed-on"), Eng(name == "speed-on"), 1.0

    def pd_request(p, d, prompt, max_tokens, timeout_s):
        slower = 1.1 if p.on else 1.0
        moved = None if len(prompt) == 100 else TransferStats(
            1, 0.002 * (2 if p.on else 1), 1e6, 32, 0, len(prompt), 0, 0)
        dec = Completion([1, 2, 3], [0.0] * 3, 0.1, token_times=[0.0, 0.01, 0.02])
        return PDResult(Completion([1], [0.0], 0.01), dec, 0.04 * len(prompt) / 100 * slower,
                        moved)

    monkeypatch.setattr(gpu_pd, "start_pair", start_pair)
    monkeypatch.setattr(gpu_pd, "streamed_pd_request", pd_request)
    got = gpu_pd.speed(None, reps=4, warmup=1)
    assert started == {"speed-off": False, "speed-on": True}
    assert got["rounds"] == 4 * len(gpu_pd.SPEED_LENGTHS)
    assert got["ratio_ttft_on_off"][0] == pytest.approx(1.1)
    assert got["paired"]["xfer_on_off"] == pytest.approx([2.0] * 8)  # not the 100-token ones
    assert got["ttft_s_by_length"]["off"][1500] == pytest.approx(0.6)
    assert got["ttft_s"]["off"] == pytest.approx(0.24)          # median over every length
    assert got["outputs_identical"] == "12/12"
    assert list(started) == ["speed-off", "speed-on"] and got["started_first"] == "off"
    started.clear()
    gpu_pd.speed(None, reps=1, warmup=0, control=True)
    assert started == {"speed-off": False, "speed-on": False}
    started.clear()
    crossed = gpu_pd.speed(None, reps=4, warmup=1, on_first=True)
    assert list(started) == ["speed-on", "speed-off"] and crossed["started_first"] == "on"
    assert crossed["ratio_ttft_on_off"][0] == pytest.approx(1.1)


def _fatbin(entries: list[tuple[int, int, bytes]]) -> bytes:
    """One fat binary: (kind, arch, payload) entries, each with a 64-byte entry header."""
    body = b""
    for kind, arch, payload in entries:
        hdr = bytearray(64)
        struct.pack_into("<HHIQ", hdr, 0, kind, 0, 64, len(payload))
        struct.pack_into("<I", hdr, 28, arch)
        body += bytes(hdr) + payload
    return struct.pack("<IHHQ", fatbin_prune.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf_with(section: bytes) -> bytes:
    """A minimal ELF64 image: header, the section's bytes, a name table, two section headers."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    sec_off = 64
    names_off = sec_off + len(section)
    sh_off = names_off + len(names)
    head = bytearray(64)
    head[:4] = b"\x7fELF"
    struct.pack_into("<Q", head, 0x28, sh_off)
    struct.pack_into("<HHH", head, 0x3A, 64, 2, 1)

    def shdr(name: int, off: int, size: int) -> bytes:
        h = bytearray(64)
        struct.pack_into("<I", h, 0, name)
        struct.pack_into("<QQ", h, 0x18, off, size)
        return bytes(h)

    return bytes(head) + section + names + shdr(1, sec_off, len(section)) + \
        shdr(12, names_off, len(names))


def test_fatbin_prune_keeps_the_arch_and_every_offset():
    sass90, sass80, ptx80 = b"S90" * 10, b"S80" * 40, b"P80" * 20
    one = _fatbin([(fatbin_prune.KIND_SASS, 80, sass80), (fatbin_prune.KIND_SASS, 90, sass90)])
    two = _fatbin([(fatbin_prune.KIND_SASS, 80, sass80), (fatbin_prune.KIND_PTX, 80, ptx80)])
    image = _elf_with(one + two)
    out, stats = fatbin_prune.prune(image, arch=90)
    assert len(out) == len(image) and stats == {"sass": 1, "ptx": 1, "placeholder": 0}
    assert sass90 in out and ptx80 in out and sass80 not in out


def test_stage_size_check_names_every_part_and_refuses_too_much():
    line = stage.check_size({"site.tar.xz": 30 << 20, "fa3.so.xz": 8 << 20}, 4 << 20)
    assert line.startswith("a device run carries 42.0 MiB of 64") and "fa3.so.xz 8.0" in line
    with pytest.raises(ValueError, match="over the limit"):
        stage.check_size({"site.tar.xz": 61 << 20}, 4 << 20)


def test_stage_takes_only_the_kernels_the_engines_load():
    assert stage.wanted_vllm_member("vllm/_C_stable_libtorch.abi3.so")
    assert stage.wanted_vllm_member("vllm/v1/engine/core.py")
    assert stage.wanted_vllm_member(f"vllm-{stage.VLLM}.dist-info/METADATA")
    assert not stage.wanted_vllm_member("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so")
    assert not stage.wanted_vllm_member("vllm/third_party/deep_gemm/include/x.cuh")
    assert not stage.wanted_vllm_member("vllm/vllm-rs")


def test_stage_wheels_per_release_replace_or_add_but_never_duplicate_a_module():
    """0.33 takes oss-harmony instead of openai-harmony (both install ``openai_harmony``) and
    adds orjson, compressed-tensors and loguru; 0.25.1 takes the list as it is."""
    assert stage.wheels_for("0.25.1") == stage.WHEELS
    for release in stage.RELEASES:
        names = [w.split("==")[0] for w in stage.wheels_for(release)]
        assert len(names) == len(set(names)), release
    wheels = stage.wheels_for("0.33.0")
    assert "openai-harmony" not in [w.split("==")[0] for w in wheels]
    assert {"oss-harmony==0.0.11", "orjson==3.13.0", "xgrammar==0.2.8",
            "compressed-tensors==0.17.0", "loguru==0.7.3"} <= set(wheels)


def test_abi_check_counts_only_torch_symbols_torch_lacks():
    from lab.gpu import abi_check

    imports = {"aoti_torch_get_numel", "aoti_torch_new_thing", "_ZN3c1010ValueErrorC1Ev",
               "_ZNSo5flushEv", "cudaMalloc", "memcpy"}
    exports = {"aoti_torch_get_numel", "_ZN2at5emptyEv"}
    assert abi_check.missing(imports, exports) == ["_ZN3c1010ValueErrorC1Ev",
                                                   "aoti_torch_new_thing"]


def test_results_table_says_how_d_fared_when_p_was_killed():
    row = {"scenario": "kill-p", "pdpatch": True, "P": "A", "D": "A", "hashseed": "0",
           "start_s": 1.0, "requests": {}, "controls": {},
           "kill_p": {"len600": {"error": "HTTP 500", "seconds": 5.2, "decoded": 0},
                      "after": {"local_ok": True, "healthy": True, "alive": True}}}
    line = gpu_pd.markdown([row], "GPU").splitlines()[-1]
    assert "P killed: 5.2s error; after: {'local_ok': True" in line


def test_d_transfer_counters_are_summed_over_labels_and_missing_ones_count_zero():
    from lab.rig.proxy import TransferStats
    from lab.rig.servers import prometheus_counters

    page = ("# HELP vllm:nixl_xfer_time_seconds x\n"
            'vllm:nixl_xfer_time_seconds_count{engine="0"} 2.0\n'
            'vllm:nixl_xfer_time_seconds_count{engine="1"} 1.0\n'
            "vllm:nixl_bytes_transferred_sum 4096.0\n"
            'vllm:nixl_num_descriptors_sum{engine="0"} 64.0\n')
    after = prometheus_counters(page)
    assert after["vllm:nixl_xfer_time_seconds_count"] == 3.0
    moved = TransferStats.delta({}, after)     # an unreachable /metrics reads as {}
    assert (moved.transfers, moved.bytes, moved.descriptors, moved.failed) == (3, 4096.0, 64, 0)


def test_geometry_and_prompt_lengths_options():
    """``--geometry llama3-8b --prompt-lengths 600,1500,4000,8000``: the tiny Llama with
    Llama-3-8B's KV (128 KiB per token in bf16, what an 8B model's READ moves), engines and
    positions long enough for the longest prompt and its decode; the defaults leave the rig's
    model and its 2048-token limit unchanged."""
    import argparse

    from lab.rig.model import tiny_config

    lengths = gpu_pd.prompt_lengths("600, 1500,4000,8000")
    assert lengths == (600, 1500, 4000, 8000) == gpu_pd.prompt_lengths("4000,600,8000,1500,600")
    overrides, max_len = gpu_pd.model_config("llama3-8b", lengths)
    cfg = {**tiny_config(), **overrides}
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert kv_per_token == 128 << 10
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert max_len == cfg["max_position_embeddings"] >= 8000 + gpu_pd.MAX_TOKENS
    assert max_len >= max(gpu_pd.SPEED_LENGTHS) + gpu_pd.SPEED_TOKENS
    assert gpu_pd.model_config("tiny", gpu_pd.PROMPT_LENGTHS) == ({}, gpu_pd.MAX_MODEL_LEN)
    for bad in ("600", "600,x", "0,600", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_pd.prompt_lengths(bad)


def test_results_table_shows_each_prompts_nixl_time():
    res = {"scenario": "kvc", "pdpatch": True, "P": "A", "D": "B", "hashseed": "0",
           "start_s": 1.0, "controls": {},
           "requests": {"len600": {"xfer_s": 0.0052}, "len1500": {"error": "HTTP 500"}}}
    assert "| 600: 5.20 |" in gpu_pd.markdown([res], "GPU")


def _answer(lp0: float, first: int = 7) -> dict:
    return {"ids": [first, 8], "lp": [lp0, -0.5]}


def _result(scenario: str, p: str, d: str, drifts: dict[str, float], pdpatch: bool = False,
            load: list[tuple[str, float]] | None = None, controls: dict | None = None) -> dict:
    """A scenario's record as run_scenario leaves it: per prompt a P/D answer whose first-token
    logprob is ``drift`` off D's baseline (-1.0); ``load``: (prompt, drift) answers."""
    res = {"scenario": scenario, "pdpatch": pdpatch, "P": p, "D": d, "hashseed": "0",
           "start_s": 1.0, "controls": controls or {},
           "requests": {n: {"pd": _answer(-1.0 + x), "base": _answer(-1.0), "p_lp0": None}
                        for n, x in drifts.items()}}
    if load is not None:
        res["load"] = {"seconds": 1.0, "kvcached_used": None,
                       "answers": [(n, _answer(-1.0 + x)) for n, x in load]}
    return res


def test_each_stock_same_backend_reference_calibrates_its_own_backend_hits_included():
    fa = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4, "hit-partial": 0.01})
    tr = _result("ref-triton", "TRITON_ATTN", "TRITON_ATTN", {"long": 0.02, "hit-partial": 0.03})
    stock_mixed = _result("stock-fa-triton", "FLASH_ATTN", "TRITON_ATTN", {"long": 0.5})
    cals = gpu_pd.calibrations([fa, tr, stock_mixed])
    assert set(cals) == {"FLASH_ATTN", "TRITON_ATTN"}
    assert cals["FLASH_ATTN"]["sequential"].tol == {"long": oracle.FLOOR,
                                                    "hit-partial": pytest.approx(0.04)}
    assert cals["TRITON_ATTN"]["sequential"].tol["long"] == pytest.approx(0.08)
    assert cals["TRITON_ATTN"]["sequential"].source == "TRITON_ATTN: ref-triton"
    assert cals["FLASH_ATTN"]["load"] is None


def test_a_mixed_pair_is_judged_with_the_wider_of_its_backends_tolerances():
    """Issue 24 item 6 (a): stock TRITON_ATTN pairs drift more than FLASH_ATTN ones; the old
    oracle judged every pair by ``ref``'s FLASH_ATTN tolerance and marked such drift wrong."""
    fa = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4})
    tr = _result("ref-triton", "TRITON_ATTN", "TRITON_ATTN", {"long": 0.02})
    mixed = _result("fa-triton", "FLASH_ATTN", "TRITON_ATTN", {"long": 0.05}, pdpatch=True)
    fa_fa = _result("fa-fa", "FLASH_ATTN", "FLASH_ATTN", {"long": 0.05}, pdpatch=True)
    results = [fa, tr, mixed, fa_fa]
    gpu_pd.judge(results, gpu_pd.calibrations(results))
    got = mixed["requests"]["long"]
    assert got["intact"] and got["tol"] == pytest.approx(0.08)
    assert mixed["calibration"] == {"sequential": "FLASH_ATTN: ref + TRITON_ATTN: ref-triton"}
    assert not fa_fa["requests"]["long"]["intact"]      # FLASH_ATTN alone drifts 1e-4
    assert fa_fa["requests"]["long"]["tol"] == oracle.FLOOR


def test_the_wider_tolerance_still_catches_the_corrupted_controls():
    controls = {"wrong-blocks": {"prompt": "long", **_answer(-1.0, first=99)},
                "other-prompt": {"prompt": "long", **_answer(-2.0)}}
    fa = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4})
    tr = _result("ref-triton", "TRITON_ATTN", "TRITON_ATTN", {"long": 0.02})
    mixed = _result("fa-triton", "FLASH_ATTN", "TRITON_ATTN", {"long": 0.05}, pdpatch=True,
                    controls=controls)
    gpu_pd.judge([fa, tr, mixed], gpu_pd.calibrations([fa, tr]))
    assert mixed["oracle"] == {"oracle_proven": True, "caught": 2, "controls": 2, "missed": []}
    assert mixed["controls"]["wrong-blocks"]["reason"] == "first token 99 != 7"


def test_a_missing_backend_reference_is_reported_not_borrowed():
    fa = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"long": 0.01})
    mixed = _result("fa-triton", "FLASH_ATTN", "TRITON_ATTN", {"long": 0.001}, pdpatch=True,
                    controls={"wrong-blocks": {"prompt": "long", **_answer(-1.0, first=99)}})
    gpu_pd.judge([fa, mixed], gpu_pd.calibrations([fa]))
    got = mixed["requests"]["long"]
    assert got["intact"] is None and got["tol"] is None
    assert got["reason"] == "not judged: no sequential reference for TRITON_ATTN"
    assert mixed["controls"]["wrong-blocks"]["caught"] is None
    assert not mixed["oracle"]["oracle_proven"]
    line = gpu_pd.markdown([mixed], "GPU").splitlines()[-1]
    assert "| 0/1 (1 not judged) |" in line
    assert "sequential NOT JUDGED: no sequential reference for TRITON_ATTN" in line


def test_tp_pairs_are_judged_by_the_reference_of_their_own_tp_sizes():
    """A TP-2 engine's all-reduce sums in another order: ``ref-tp12``'s drift judges the
    1 -> 2 pairs and never widens (or stands in for) the TP-1 calibration."""
    def tp(res: dict, sizes: list[int], backends: list[str]) -> dict:
        return {**res, "tp": sizes, "backends": backends}

    fa = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4})
    ref12 = tp(_result("ref-tp12", "FLASH_ATTN", "FLASH_ATTN TP2", {"long": 0.01}), [1, 2],
               ["FLASH_ATTN", "FLASH_ATTN"])
    tp12 = tp(_result("tp12", "FLASH_ATTN", "FLASH_ATTN TP2", {"long": 0.03}, pdpatch=True),
              [1, 2], ["FLASH_ATTN", "FLASH_ATTN"])
    mixed12 = tp(_result("fa-triton-tp12", "FLASH_ATTN", "TRITON_ATTN TP2", {"long": 0.03},
                         pdpatch=True), [1, 2], ["FLASH_ATTN", "TRITON_ATTN"])
    results = [fa, ref12, tp12, mixed12]
    cals = gpu_pd.calibrations(results)
    assert cals["FLASH_ATTN"]["sequential"].tol["long"] == oracle.FLOOR
    assert cals["FLASH_ATTN TP1->2"]["sequential"].tol["long"] == pytest.approx(0.04)
    gpu_pd.judge(results, cals)
    assert tp12["requests"]["long"]["intact"]
    assert tp12["calibration"] == {"sequential": "FLASH_ATTN TP1->2: ref-tp12"}
    assert mixed12["requests"]["long"]["reason"] == \
        "not judged: no sequential reference for TRITON_ATTN TP1->2"


def test_answers_of_a_pair_with_stocks_kernels_are_compared_with_stocks_exactly():
    """Same backends and TP as a stock reference: every answer must equal the reference's, to
    the last logprob (a drift the tolerance would pass is still recorded as a difference)."""
    ref = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"a": 0.1, "b": 0.2})
    same = _result("coalesce", "FLASH_ATTN", "FLASH_ATTN", {"a": 0.1, "b": 0.2 + 1e-6},
                   pdpatch=True)
    mixed = _result("fa-triton", "FLASH_ATTN", "TRITON_ATTN", {"a": 0.1}, pdpatch=True)
    gpu_pd.judge([ref, same, mixed], gpu_pd.calibrations([ref]))
    assert same["requests"]["a"]["same_as_stock"] is True
    assert same["requests"]["b"]["same_as_stock"] is False
    assert same["requests"]["b"]["intact"]                 # within the tolerance all the same
    assert same["identical_to_stock"] == "1/2 (ref)"
    assert "identical_to_stock" not in ref and "identical_to_stock" not in mixed
    assert "answers identical to stock's: 1/2 (ref)" in gpu_pd.markdown([same], "GPU")


def test_load_is_judged_against_the_stock_pairs_drift_under_the_same_load():
    """Issue 24 item 6 (b): under load the stock pair's 16k answers drift 8e-3..1.2e-1 from D's
    sequential prefill, where the sequential tolerance was 7.1e-3."""
    ref_load = _result("ref-load", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4, "short": 1e-4},
                       load=[("long", 0.03), ("short", 1e-4), ("long", 1e-4)])
    kvc = _result("kvc", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4, "short": 1e-4}, pdpatch=True,
                  load=[("long", 0.1), ("long", 0.5), ("short", 0.1)])
    cals = gpu_pd.calibrations([ref_load])
    assert cals["FLASH_ATTN"]["load"].tol == {"long": pytest.approx(0.12),
                                              "short": oracle.FLOOR}
    gpu_pd.judge([ref_load, kvc], cals)
    ld = kvc["load"]
    assert (ld["requests"], ld["intact"], ld["unjudged"]) == (3, 1, 0)
    assert [(v["prompt"], v["dlp0"]) for v in ld["not_intact"]] == \
        [("long", pytest.approx(0.5)), ("short", pytest.approx(0.1))]
    assert kvc["calibration"]["load"] == "FLASH_ATTN: ref-load, under load"
    assert kvc["requests"]["long"]["tol"] == oracle.FLOOR      # sequential: no load drift
    assert ref_load["load"]["intact"] == 3
    assert [d[0] for d in ld["drift"]] == ["long", "long", "short"]


def test_without_a_load_reference_load_drift_is_not_judged_as_corruption():
    ref = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4})
    kvc = _result("kvc", "FLASH_ATTN", "FLASH_ATTN", {"long": 1e-4}, pdpatch=True,
                  load=[("long", 0.1), ("long", 0.0)])
    gpu_pd.judge([ref, kvc], gpu_pd.calibrations([ref]))
    ld = kvc["load"]
    assert (ld["intact"], ld["unjudged"], ld["not_intact"]) == (0, 2, [])
    assert ld["unjudged_why"] == ["not judged: no load reference for FLASH_ATTN"]
    assert "2 at once" in gpu_pd.markdown([kvc], "GPU")
    assert "0 intact in 1.0s, 2 not judged" in gpu_pd.markdown([kvc], "GPU")


def test_tolerance_files_old_flat_and_per_backend_both_read():
    flat = gpu_pd.parse_tolerances({"len600": 0.25, "len16000": 0.007}, "q.json")
    assert flat["FLASH_ATTN"]["load"] is None
    assert flat["FLASH_ATTN"]["sequential"].tol == {"len600": 0.25, "len16000": 0.007}
    assert flat["FLASH_ATTN"]["sequential"].source == "FLASH_ATTN: q.json (flat, sequential)"
    ref = _result("ref-triton", "TRITON_ATTN", "TRITON_ATTN", {"long": 0.02, "hit-partial": 0.0})
    ref["requests"]["hit-partial"]["pd"] = _answer(-1.01, first=9)
    cals = gpu_pd.calibrations([ref], earlier=flat)
    again = gpu_pd.parse_tolerances(gpu_pd.tolerances_json(cals), "u.json")
    assert again["FLASH_ATTN"]["sequential"].tol == flat["FLASH_ATTN"]["sequential"].tol
    tr = again["TRITON_ATTN"]["sequential"]
    assert tr.tol == cals["TRITON_ATTN"]["sequential"].tol and tr.ties == {"hit-partial": [9]}
    assert tr.source == "TRITON_ATTN: ref-triton (from u.json)"
    assert again["TRITON_ATTN"]["load"] is None


def test_earlier_tolerances_skip_prompts_whose_name_now_holds_other_tokens(tmp_path, capsys):
    """``--tolerances``: a prompt of the same name but other token ids (another set of lengths
    draws other prompts) is not judged by the earlier run's tolerance; the others are, and a
    file from before the digests were recorded is taken whole."""
    ref = _result("ref", "FLASH_ATTN", "FLASH_ATTN", {"len100": 0.02, "len1500": 0.03})
    ref["requests"]["len1500"]["pd"] = _answer(-1.01, first=9)
    tol = gpu_pd.tolerances_json(gpu_pd.calibrations([ref]))
    then = {"len100": [5] * 100, "len1500": [6] * 1500}
    now = {"len100": [5] * 100, "len1500": [7] * 1500}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"tolerances": tol, "prompts": gpu_pd.prompt_digests(then)}))
    cal = gpu_pd.earlier_tolerances(path, gpu_pd.prompt_digests(now))["FLASH_ATTN"]["sequential"]
    assert set(cal.tol) == {"len100"} and cal.ties == {}
    assert "not used for hit-full, hit-partial, len1500 (" in capsys.readouterr().out
    same = gpu_pd.earlier_tolerances(path, gpu_pd.prompt_digests(then))
    assert set(same["FLASH_ATTN"]["sequential"].tol) == {"len100", "len1500"}
    path.write_text(json.dumps({"tolerances": tol}))
    old = gpu_pd.earlier_tolerances(path, gpu_pd.prompt_digests(now))
    assert set(old["FLASH_ATTN"]["sequential"].tol) == {"len100", "len1500"}


def test_recorded_run_s_rejudged_with_run_t_as_its_stock_reference():
    """Runs s (pdpatch, kvcached D) and t (the stock pair, ref-load) of 2026-11-28: judged by
    flat FLASH_ATTN tolerances, both marked hit-partial's near-tie and 48 of 96 load answers at
    16k tokens; by t's own drift (sequential, its hit requests, under load) s is intact, its
    controls still caught, and the records suffice for a faithful load re-judge."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs" / "gpu"
    s = json.loads((docs / "2026-11-28-s-8b-16k-kvc-prefix.json").read_text())
    t = json.loads((docs / "2026-11-28-t-8b-16k-ref-load-prefix.json").read_text())
    got = gpu_pd.rejudge_recorded(s, t)
    assert got["reference"] == "ref-load" and got["sequential_ties"] == {"hit-partial": [362]}
    assert got["sequential_tol"]["hit-partial"] == pytest.approx(4 * 0.0343, abs=1e-4)
    assert got["load_tol"] == {"len8000": [oracle.CAP] * 2, "len16000": [oracle.CAP] * 2}
    (kvc,) = got["scenarios"]
    assert kvc["sequential"]["hit-partial"]["was"] is False
    assert all(v["now"] for v in kvc["sequential"].values())
    assert kvc["controls_caught"] == {"wrong-blocks": True, "other-prompt": True}
    assert kvc["load"] == {"requests": 96, "was_intact": 48, "intact": [96, 96],
                           "faithful": True, "narrowed": []}
