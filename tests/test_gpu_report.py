"""The report reads what the new GPU scenarios record (lab/report/repeated.py,
lab/report/full_width.py): the repeated samples per pair and prompt, the aged D, the start
orders, the full-width models, the TTFT rounds one by one.

Against the recorded runs (``docs/gpu/*.json``): where a run has no repeated samples, its first
pass is each pair's one sample, and the pooling per start is the transfer table's, cell for
cell.  The new fields are written by lab/gpu/pd.py's own code -- ``run_scenario`` with its
repeats and its aged D, ``judge``, ``speed`` -- driven here by engines that answer from a rule
instead of a GPU, then read back through the report's loader; no such record is kept."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from lab.gpu import pd as gpu_pd
from lab.gpu.engines import Paths
from lab.report import cells, records, repeated, tables
from lab.report.stats import Spread


@pytest.fixture(scope="module")
def data() -> tables.Data:
    """The recorded GPU runs and their cells (the CPU benches' records left out: another
    part of the report, not read here)."""
    recs = records.load()
    return tables.Data(recs, tuple(cells.pair_cells(recs)), tuple(cells.start_cells(recs)),
                       (), ())


def test_without_repeats_a_pairs_first_pass_is_its_sample_and_pools_as_the_transfer_table(
        data):
    """Every cell of the recorded runs without repeated samples: per prompt, the per-start
    ratios of the samples' medians are the transfer table's ratios (one request per pair: its
    own median)."""
    compared = 0
    for c in (c for c in data.pairs if not repeated.has_samples(c)):
        for prompt in c.prompts():
            mine = repeated.start_ratios(c, prompt)
            want = c.ratios(prompt)
            assert (Spread.of(mine) if mine else None) == want, (c.name, c.runs(), prompt)
            compared += bool(mine)
    assert compared > 200
    # the runs with repeated samples, each both start orders: the aged D on 0.26.0, vLLM
    # 0.34.0, full-width Llama-3-8B on 0.25.1
    assert sorted(c.runs() for c in data.pairs if repeated.has_samples(c)) == \
        [["dl", "dm"], ["do", "dp"], ["dq", "dr"]]


def test_full_width_models_are_named_as_such():
    assert tables.kv_of("llama3-8b-full") == "Llama-3-8B, full width"
    said = tables.model("llama3-8b-full")
    assert "full width" in said and "hidden 4,096" in said and "32 query / 8 KV heads" in said
    assert "128,256" in said
    assert "MLA latent" in tables.model("deepseek-v2-lite-full")
    assert tables.model("llama3-8b").startswith("a seeded model of hidden size 256")


# ------------------------------------------------------- records written by pd.py's own code

class RuleEngine:
    """An engine that answers by rule: greedy tokens from the prompt's digest (the same for
    every pair, so the answers are stock's), a read of ``ms_per_kt`` ms per thousand tokens
    with ``descriptors``; another prompt's or repeated blocks (the controls) give other tokens,
    and so does every pull under a salt that starts with ``corrupt``."""

    def __init__(self, name: str, log: Path, ms_per_kt: float, descriptors: int,
                 corrupt: str | None = None) -> None:
        self.name, self.backend, self.log = name, "FLASH_ATTN", log
        self.ms_per_kt, self.descriptors, self.corrupt = ms_per_kt, descriptors, corrupt
        self.kv_cache_bytes = 16 << 30
        self.sent: list[tuple] = []
        log.write_text("INFO GPU KV cache size: 4,096 tokens\n")

    def healthy(self) -> bool:
        return True

    def stop(self) -> None:
        pass

    @staticmethod
    def _tokens(prompt: list[int], salt: str) -> list[int]:
        h = hashlib.sha256(json.dumps([prompt, salt]).encode()).digest()
        return [3 + b % 500 for b in h[:gpu_pd.MAX_TOKENS]]

    def complete(self, prompt, n, kvp=None, salt=None, timeout_s=120.0) -> dict:
        self.sent.append((len(prompt), n, salt))
        wrong = kvp is not None and (kvp.get("wrong") or kvp.get("other"))
        ids = self._tokens(prompt, "wrong" if wrong else "")[:n]
        lp = [-1.0] * len(ids)
        return {"ids": ids, "lp": lp, "ms": 5.0,
                "kvp": {"remote_block_ids": list(range(len(prompt) // 16 + 1)),
                        "other": len(prompt) % 7 == 0 and salt == "control-other-prompt"}}

    def pulled(self, prompt, kvp, salt=None, timeout_s=120.0) -> dict:
        kvp = dict(kvp)
        ids = kvp.get("remote_block_ids") or []
        if len(ids) > 1 and len(set(ids)) == 1:
            kvp["wrong"] = True
        if salt == "control-other-prompt" or (self.corrupt and (salt or "").startswith(
                self.corrupt)):
            kvp["other"] = True
        out = self.complete(prompt, gpu_pd.MAX_TOKENS, kvp, salt)
        out.update(pulled=1, bytes=len(prompt) * 1024, descriptors=self.descriptors,
                   xfer_s=self.ms_per_kt * len(prompt) / 1e6)
        return out


def _record(tmp_path: Path, names: list[str], letter: str, scale: dict[str, float],
            corrupt: str | None = None) -> Path:
    """One run of ``names`` (pairs measured in that order) through run_scenario, judged and
    written as write_results writes it, under the report's file naming."""
    paths = Paths(tmp_path, tmp_path / "model", tmp_path)
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(
        {**gpu_pd.GEOMETRIES["llama3-8b"], "hidden_size": 256, "vocab_size": 512}))
    prompts = {"len1500": list(range(3, 1503)), "len4000": [7] * 4000}
    results = []
    for name in names:
        sc = gpu_pd.SCENARIOS[name]
        p = RuleEngine(f"{name}-P", tmp_path / f"{letter}-{name}-P.log", 1.0, 1)
        d = RuleEngine(f"{name}-D", tmp_path / f"{letter}-{name}-D.log",
                       scale[name], 32 if sc.pdpatch else 3000,
                       corrupt=corrupt if sc.pdpatch else None)
        results.append(gpu_pd.run_scenario(name, sc, prompts, paths, started=(p, d, 1.0),
                                           repeat=3))
    cals = gpu_pd.calibrations(results)
    gpu_pd.judge(results, cals)
    folder = tmp_path / "gpu"
    folder.mkdir(exist_ok=True)
    f = folder / f"2026-12-09-{letter}-test.json"
    f.write_text(json.dumps({"gpu": "1 x NVIDIA H200, torch 2.11.0+cu130, vLLM 0.26.0, "
                                    "model geometry llama3-8b, prefix caching on",
                             "tolerances": gpu_pd.tolerances_json(cals),
                             "order": names, "results": results}, default=str))
    return folder


def test_repeated_samples_of_an_aged_d_are_pooled_per_start(tmp_path):
    """Two runs, the stock pair first in one and second in the other, each pair 3 samples per
    prompt after aging D; the coalescing pair reads in a tenth of stock's time: each start's
    ratio is 0.1, the cell pools 2 starts, crossed."""
    _record(tmp_path, ["ref-aged", "coalesce-aged"], "zy", {"ref-aged": 10.0,
                                                             "coalesce-aged": 1.0})
    folder = _record(tmp_path, ["coalesce-aged", "ref-aged"], "zz",
                     {"ref-aged": 10.0, "coalesce-aged": 1.0})
    recs = records.load(folder)
    raw = recs.scenarios[0].raw
    assert raw["aging"]["requests"] > 0 and raw["aging"]["cycles"] >= 1.5
    assert raw["aging"]["cache_tokens"] == 4096 and raw["aging"]["cache_tokens_from"] == "D's log"
    got = [x for x in raw["samples"]]
    assert [(x["phase"], x["round"]) for x in got][:2] == [("aged", 0), ("aged", 0)]
    assert all(x["intact"] and x["same_as_stock"] for x in got)
    pairs = cells.pair_cells(recs)
    (cell,) = [c for c in pairs if c.name == "coalesce-aged"]
    assert repeated.phases(cell) == ["aged"]
    assert repeated.start_ratios(cell, "len4000", "aged") == pytest.approx([0.1, 0.1])
    assert repeated.orders(cell) == "1 / 1"
    data = tables.Data(recs, tuple(pairs), tuple(cells.start_cells(recs)), (), ())
    block = repeated.transfer_samples(data)
    row = next(r for r in block.splitlines() if "| 4,000 |" in r)
    assert "| aged |" in row and "| 32 / 3,000 |" in row and "n=6" in row
    assert "0.1 (0.1\N{EN DASH}0.1, n=2)" in row
    assert "intact 6/6, identical to stock's 6/6; intact 6/6" in row
    assert "zy:coalesce-aged" in row and "inversions" in row


def test_each_sample_is_judged_on_its_own(tmp_path):
    """A pdpatch D whose first pass is right but whose repeated pulls decode other KV: its
    samples are judged not intact (and not stock's answer) by the run's own calibration, while
    its first pass and the stock pair's samples stay intact -- a sample's verdict is its own,
    not its prompt's."""
    folder = _record(tmp_path, ["ref", "coalesce"], "zx", {"ref": 10.0, "coalesce": 1.0},
                     corrupt="fresh-")
    recs = records.load(folder)
    ref, coalesce = recs.scenarios
    assert all(r.intact for r in coalesce.requests.values())
    samples = repeated.recorded_samples(coalesce)
    assert len(samples) == 6 and {x.phase for x in samples} == {"fresh"}
    assert [x.intact for x in samples] == [False] * 6
    assert [x.same_as_stock for x in samples] == [False] * 6
    assert all(x.intact for x in repeated.recorded_samples(ref))
    assert coalesce.raw["oracle"]["caught"] == 2 == coalesce.raw["oracle"]["controls"]
    pairs = cells.pair_cells(recs)
    data = tables.Data(recs, tuple(pairs), (), (), ())
    row = next(r for r in repeated.transfer_samples(data).splitlines() if "| 1,500 |" in r)
    assert "intact 0/3, identical to stock's 0/3; intact 3/3" in row


def test_ttft_rounds_are_read_one_by_one(tmp_path, monkeypatch):
    """``speed`` keeps every paired round (its length, which pair was sent first, each pair's
    TTFT and NIXL time); the report's rounds block gives per length n rounds, their median
    and range, and the starts' medians."""
    from lab.rig.proxy import Completion, PDResult, TransferStats

    class Eng:
        def __init__(self, on: bool) -> None:
            self.on = on

        def stop(self) -> None:
            pass

    monkeypatch.setattr(gpu_pd, "start_pair",
                        lambda name, sc, paths: (Eng(name == "speed-on"),) * 2 + (1.0,))

    def pd_request(p, d, prompt, max_tokens, timeout_s):
        moved = TransferStats(1, 0.002 * (0.5 if p.on else 1), 1e6, 32, 0, 0, 0, 0)
        dec = Completion([1, 2], [0.0, 0.0], 0.1, token_times=[0.0, 0.01])
        return PDResult(Completion([1], [0.0], 0.01), dec,
                        0.001 * len(prompt) * (0.9 if p.on else 1.0), moved)

    monkeypatch.setattr(gpu_pd, "streamed_pd_request", pd_request)
    folder = tmp_path / "gpu"
    folder.mkdir()
    for i, first in enumerate(gpu_pd.speed_orders(False, 2)):
        got = gpu_pd.speed(None, 5, warmup=1, on_first=first, lengths=(1500, 4000))
        assert len(got["rounds_detail"]) == 10 and got["warmup"] == 1
        d = got["rounds_detail"][0]
        assert d["ttft_s"]["on"] == pytest.approx(1.35) and d["identical"]
        (folder / f"2026-12-09-zw-speed-{i + 1}.json").write_text(json.dumps(
            {"gpu": "1 x NVIDIA H200, torch 2.11.0+cu130, vLLM 0.25.1, model geometry "
                    "llama3-8b-full, prefix caching on", **got}))
    recs = records.load(folder)
    data = tables.Data(recs, (), tuple(cells.start_cells(recs)), (), ())
    block = repeated.ttft_rounds(data, folder)
    row = next(r for r in block.splitlines() if "| 4,000 |" in r)
    assert "Llama-3-8B, full width" in row and "| 1 / 1 |" in row
    dash = "\N{EN DASH}"
    assert f"0.900 (0.900{dash}0.900, n=10)" in row and f"0.900 (0.900{dash}0.900, n=2)" in row
    assert f"1 (1{dash}1, n=10)" in row and f"2 (2{dash}2, n=10)" in row and "| 10/10 |" in row
