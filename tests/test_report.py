"""Every measured figure of the README and ``docs/`` (the GPU runs', and the CPU benches' of
``docs/proof.md``) is what ``python -m lab.report`` writes from the raw records, and the report
pools and states them as it says: every run of a configuration and code epoch, n with the
median and range, an interval only from three units; a bench's run of changed code starts a new
cell once reviewed, and is refused until then."""

from __future__ import annotations

import argparse
import datetime
import json
import re
from pathlib import Path

import pytest

from lab import generated
from lab.bench import record
from lab.report import bench, cli, epochs, records, tables
from lab.report.cells import PairCell, StartCell
from lab.report.stats import Interval, Spread, geo, spread
from lab.report.tables import Data

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data() -> Data:
    return Data.load()


def test_pages_hold_what_the_raw_records_say() -> None:
    assert cli.main(["--check"]) == 0        # it names the page and the command when not


@pytest.mark.parametrize("page, edit", [
    ("README.md", ("n=18)", "n=12)")),
    ("docs/patches.md", ("over 18 pair starts", "over 12 pair starts")),
    ("docs/gpu_results.md", ("| cz, db, dc, dd, de |", "| cz |")),
])
def test_an_edited_figure_is_caught_and_rewritten(data: Data, page: str,
                                                  edit: tuple[str, str]) -> None:
    text = (ROOT / page).read_text()
    edited = text.replace(*edit, 1)
    assert edited != text
    assert cli.render(edited, data, page) == text


def test_every_block_is_on_a_page_and_no_archive_is_linked() -> None:
    pages = {p: p.read_text() for p in cli.pages()}
    found = {n for text in pages.values() for n in generated.names(text, cli.COMMAND)}
    assert found == set(cli.BLOCKS)
    assert [p.name for p, text in pages.items() if "archive/" in text] == []


def test_readme_is_an_operators_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    commit = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
    run = re.compile(r"\bruns? [a-z]{1,2}(?:'s|,| and | in |\)|-[a-z]{1,2}\b)")
    assert commit.findall(text) == [] and run.findall(text) == []
    assert run.findall("GPU runs z and aa; run w's answers") == ["runs z and ", "run w's"]
    assert commit.findall("at `62f271c` (1048576 KiB)") == ["62f271c"]


def test_a_figure_states_n_median_and_range_and_an_interval_only_from_three() -> None:
    assert spread(Spread.of([2.0, 1.0, 4.0])) == "2 (1\N{EN DASH}4, n=3)"
    assert spread(Spread.of([0.0449])) == "0.0449 (n=1)"
    assert Interval.of([0.64, 0.68]) is None
    assert geo(Interval.of([0.64, 0.68])) == "no interval (< 3 units)"
    assert geo(Interval.of([1.0, 1.02, 1.04])).endswith(", df 2")


def test_a_change_on_a_path_starts_a_new_cell() -> None:
    staged = epochs.paths_of("coalesce", "0.25.1")
    assert epochs.epoch("de", staged, "0.25.1")[0].commit == "d5cda29"
    assert epochs.epoch("at", staged, "0.25.1")[0].commit == "2603947"
    assert epochs.superseded(epochs.epoch("at", staged, "0.25.1"), staged, "0.25.1")
    assert not epochs.superseded(epochs.epoch("de", staged, "0.25.1"), staged, "0.25.1")
    # lease_guard changed every READ of 0.26-0.33 after their last runs, none of 0.25
    assert epochs.superseded(epochs.epoch("bw", frozenset({epochs.REQUEST}), "0.33.0"),
                             frozenset({epochs.REQUEST}), "0.33.0")
    assert epochs.paths_of("ref", "0.25.1") == frozenset()
    assert epochs.STAGED in epochs.paths_of("kvc", "0.25.1")
    assert epochs.STAGED not in epochs.paths_of("kvc", "0.30.0")


def _pair(data: Data, release: str, geometry: str, name: str, first_run: str) -> PairCell:
    return next(c for c in data.pairs
                if (c.release, c.geometry, c.name) == (release, geometry, name)
                and c.epoch and c.epoch[0].first_run == first_run)


def _starts(data: Data, geometry: str, env: tuple, control: bool) -> list[StartCell]:
    return [c for c in data.starts if (c.release, c.geometry, c.on_env, c.control)
            == ("0.25.1", geometry, env, control)]


def test_a_cell_pools_every_run_of_its_epoch(data: Data) -> None:
    coalesce = _pair(data, "0.25.1", "llama3-8b", "coalesce", "cz")
    assert coalesce.runs() == ["cz", "db", "dc", "dd", "de"]
    assert coalesce.ratios("len1500").n == 5
    assert [f for _, f in coalesce.first_requests()] == [False, False, True, True, False]
    ttft = [c for c in _starts(data, "llama3-8b", (), False) if c.epoch]
    assert [c.runs() for c in ttft] == [["bg", "bh", "bj", "bk", "bl", "bm", "bn", "bo", "bp",
                                         "br"]]
    assert len(ttft[0].starts) == 18 and ttft[0].interval().df == 17


def test_a_run_without_a_stock_pair_is_judged_against_the_named_run(data: Data) -> None:
    kvc = _pair(data, "0.25.1", "llama3-8b", "kvc", "cz")
    (pair,) = kvc.pairs
    assert (pair.scenario.run.letter, pair.stock.run.letter) == ("dj", "dk")
    assert all(r.intact is None for r in pair.scenario.requests.values())  # its own run: none
    j = pair.judged
    assert (j.intact, j.judged, j.caught, j.controls_judged) == (5, 6, 2, 2)


def test_a_pair_whose_engines_never_served_is_listed_not_pooled(data: Data) -> None:
    """Run dn: vLLM 0.34.0's engines failed to start on the device (no CUTLASS DSL)."""
    broken = [s for s in data.records.scenarios if s.run.letter == "dn"]
    assert broken and all(s.error.startswith("engines not healthy") for s in broken)
    assert not any("dn" in c.runs() for c in data.pairs)
    assert "engines not healthy after 51s" in tables.answers(data)
    # 0.34.0's row comes from the runs that served (do, dp), never from dn
    (row,) = [ln for ln in tables.coalescing(data).splitlines() if ln.startswith("| 0.34.0 ")]
    assert _pair(data, "0.34.0", "llama3-8b", "coalesce", "cz").runs() == ["do", "dp"]
    assert "| 2 |" in row, row


def test_records_read_every_run_of_the_engines() -> None:
    r = records.load()
    letters = {s.run.letter for s in (*r.scenarios, *r.starts)}
    files = {p.name for p in records.GPU_DIR.glob("*.json")
             if records.FILE_NAME.fullmatch(p.name) and "import-sweep" not in p.name}
    assert {f for rs in r.runs().values() for f in rs} == files
    assert {"a", "n", "cz", "dk"} <= letters
    assert {s.run.geometry for s in r.scenarios if s.run.letter in "nopq"} == {"llama3-8b"}


@pytest.mark.parametrize("rows, error", [
    ([{"first_run": "b", "commit": "x", "paths": ["staged"], "why": ""},
      {"first_run": "a", "commit": "y", "paths": ["staged"], "why": ""}], "run order"),
    ([{"first_run": "a", "commit": "x", "paths": ["stagd"], "why": ""}], "unknown paths"),
])
def test_the_epoch_table_is_checked_as_it_is_read(tmp_path: Path, monkeypatch, rows: list,
                                                  error: str) -> None:
    table = tmp_path / "epochs.json"
    table.write_text(json.dumps({"change": rows}))
    monkeypatch.setattr(epochs, "TABLE", table)
    with pytest.raises(ValueError, match=error):
        epochs._changes("change")


# ------------------------------------------------------------------ the CPU benches' records

def _record(folder: Path, name: str, code: str, figure: float, *, bench_: str = "activation",
            load: float = 0.5, args: dict | None = None) -> None:
    """A raw record as lab.bench.record writes it, with one figure."""
    (folder / f"{name}.json").write_text(json.dumps({
        "format": 1, "bench": bench_, "command": f"python -m scripts.bench_{bench_} --record",
        "args": {"runs": 10, "record": True, "json": None, "note": "", **(args or {})},
        "vllm": "0.34.0", "python": "3.11.7", "env": {},
        "machine": {"cores": 2, "cpu": "Some CPU"},
        "code": {"commit": f"{code}000000", "sha256": code, "dirty": []},
        "load": {"before": [load, 0, 0], "during": [], "after": [load, 0, 0]},
        "samples": {}, "derived": {"enabled pdpatch adds ms": figure}}))


def _rows(path: Path, change: list, kept: list = ()) -> Path:
    path.write_text(json.dumps({"change": [
        {"bench": "activation", "first_run": r, "commit": c, "why": "w"} for r, c in change],
        "kept": [{"bench": "activation", "first_run": r, "commit": c, "why": "w"}
                 for r, c in kept]}))
    return path


def test_a_changed_code_path_starts_a_new_cell_once_reviewed(tmp_path: Path) -> None:
    """Runs 1-2 measured code A, runs 3-4 code B (say, start-up restructured): until a row of
    the epochs table reviews run 3 the report refuses; a change row starts a new cell there and
    the cell before it is no longer the current code; a kept row pools all four."""
    for i, (code, x) in enumerate([("a", 18.0), ("a", 19.0), ("b", 9.0), ("b", 10.0)], 1):
        _record(tmp_path, f"activation-2026-12-05-{i}", code, x)
    runs = bench.load(tmp_path)
    assert [r.short for r in runs] == [f"2026-12-05-{i}" for i in range(1, 5)]
    with pytest.raises(bench.Unreviewed, match="first run of activation"):
        bench.cells(runs, *bench.changes(_rows(tmp_path / "t.json", [])))
    one = _rows(tmp_path / "t.json", [("activation-2026-12-05-1", "a")])
    with pytest.raises(bench.Unreviewed, match=r"activation-2026-12-05-3\.json measured other "
                                               r"code than activation-2026-12-05-2"):
        bench.cells(runs, *bench.changes(one))
    two = bench.cells(runs, *bench.changes(_rows(
        tmp_path / "t.json", [("activation-2026-12-05-1", "a"), ("activation-2026-12-05-3", "b")])))
    assert [[r.n for r in c.runs] for c in two] == [[1, 2], [3, 4]]
    assert [c.current() for c in two] == [False, True]
    assert two[1].spread("enabled pdpatch adds ms") == Spread(2, 9.5, 9.0, 10.0)
    kept = bench.cells(runs, *bench.changes(_rows(
        tmp_path / "t.json", [("activation-2026-12-05-1", "a")],
        [("activation-2026-12-05-3", "b")])))
    assert [[r.n for r in c.runs] for c in kept] == [[1, 2, 3, 4]]
    # a change reviewed but not yet measured: the bench's cell is no longer the current code
    pending = bench.cells(runs[:2], *bench.changes(_rows(
        tmp_path / "t.json", [("activation-2026-12-05-1", "a"), (None, "b")])))
    assert [c.current() for c in pending] == [False]
    assert tables._bench_current(pending[0].superseded) == "no: `b` (not yet measured)"
    with pytest.raises(bench.RecordError, match="did not change"):
        bench.cells(runs, *bench.changes(_rows(
            tmp_path / "t.json", [("activation-2026-12-05-1", "a")],
            [("activation-2026-12-05-2", "a")])))


def test_a_cell_pools_one_command_and_states_an_interval_only_from_three(tmp_path: Path
                                                                         ) -> None:
    for i, x in enumerate([18.0, 19.0, 20.0], 1):
        _record(tmp_path, f"activation-2026-12-05-{i}", "a", x)
    _record(tmp_path, "activation-2026-12-05-4", "a", 30.0, args={"runs": 3})
    runs = bench.load(tmp_path)
    got = bench.cells(runs, *bench.changes(_rows(tmp_path / "t.json",
                                                 [("activation-2026-12-05-1", "a")])))
    assert [[r.n for r in c.runs] for c in got] == [[1, 2, 3], [4]]
    assert got[0].interval("enabled pdpatch adds ms").df == 2
    assert got[1].interval("enabled pdpatch adds ms") is None


def test_the_cpu_table_holds_every_record_in_one_cell(data: Data) -> None:
    files = sorted(p.stem for p in bench.BENCH_DIR.glob("*.json"))
    pooled = sorted(r.name for c in data.bench_cells for r in c.runs)
    assert pooled == files and files
    text = tables.cpu_benchmarks(data)
    for c in data.bench_cells:
        assert ", ".join(r.short for r in c.runs) in text
        assert bench.figures(c), c.bench           # every cell states figures


def test_every_cpu_bench_run_here_has_a_cell_of_three_runs(data: Data) -> None:
    most: dict[str, int] = {}
    for c in data.bench_cells:
        most[c.bench] = max(most.get(c.bench, 0), len(c.runs))
    for b in ("activation", "block_keys", "descriptors", "chunked", "first_contact"):
        assert most.get(b, 0) >= 3, b


def test_every_figure_the_table_names_is_in_the_records(data: Data) -> None:
    """A bench that renames a figure in its records must not drop it from the table silently."""
    for c in data.bench_cells:
        for pattern, _ in bench.FIGURES[c.bench]:
            assert any(re.fullmatch(pattern, k) for k in c.names()), (c.bench, pattern)


def test_an_edited_cpu_figure_is_caught_and_rewritten(data: Data) -> None:
    page = ROOT / "docs" / "proof.md"
    text = page.read_text()
    block = text[text.index("<!-- BEGIN generated: cpu-benchmarks"):
                 text.index("<!-- END generated: cpu-benchmarks -->")]
    median = re.search(r"\| (\d+(?:\.\d+)?) \((?:[\d.,]+\N{EN DASH}[\d.,]+, )?n=\d+\) \|",
                       block)
    assert median, "no figure in the CPU table"
    cell = median[0]
    edited = text.replace(cell, cell.replace(median[1], median[1] + "1", 1), 1)
    assert edited != text
    assert cli.render(edited, data, "proof.md") == text
    edited_n = text.replace(cell, re.sub(r"n=(\d+)\)", lambda m: f"n={int(m[1]) + 1})", cell), 1)
    assert edited_n != text and cli.render(edited_n, data, "proof.md") == text


def test_a_record_holds_what_ran_the_machine_its_load_and_every_sample(tmp_path: Path) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    record.add_arguments(ap)
    out = tmp_path / "r.json"
    args = ap.parse_args(["--runs", "3", "--json", str(out)])
    rec = record.Recorder("activation", args, ["--runs", "3", "--json", str(out)])
    rec.samples["hook on vllm (s)"] = [0.01, 0.012]
    rec.derived["hook ms"] = 11.0
    assert rec.finish() == out
    d = json.loads(out.read_text())
    assert d["command"] == f"python -m scripts.bench_activation --runs 3 --json {out}"
    assert d["args"]["runs"] == 3 and d["machine"]["cores"] >= 1 and d["machine"]["cpu"]
    assert len(d["load"]["before"]) == len(d["load"]["after"]) == 3
    assert d["code"]["paths"] == list(record.CODE["activation"]) and len(d["code"]["sha256"]) == 64
    assert d["samples"] == {"hook on vllm (s)": [0.01, 0.012]} and d["derived"]["hook ms"] == 11
    assert d["vllm"] and d["python"]
    assert bench._options(d["command"]) == "python -m scripts.bench_activation --runs 3"


def test_record_names_and_the_code_digest(tmp_path: Path) -> None:
    day = datetime.date(2026, 12, 5)
    assert record.next_path("chunked", tmp_path, day).name == "chunked-2026-12-05-1.json"
    for n in (1, 2, 7):
        (tmp_path / f"chunked-2026-12-05-{n}.json").write_text("{}")
    (tmp_path / "first_contact-2026-12-05-9.json").write_text("{}")
    assert record.next_path("chunked", tmp_path, day).name == "chunked-2026-12-05-8.json"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "a.so").write_text("built")
    before = record.code_digest(["pkg"], tmp_path)
    (tmp_path / "pkg" / "a.so").write_text("rebuilt")          # a build output: not code
    assert record.code_digest(["pkg"], tmp_path) == before
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert record.code_digest(["pkg"], tmp_path)[0] != before[0]
