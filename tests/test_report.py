"""Every measured GPU figure of the README and ``docs/`` is what ``python -m lab.report`` writes
from the raw records, and the report pools and states them as it says: every run of a
configuration and code epoch, n with the median and range, an interval only from three units."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lab import generated
from lab.report import cli, epochs, records
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
