"""Issue 25 case 2 and vllm-project/vllm#50558: a ``remote_block_ids`` list that does not match
what the decode engine allocated (its prefix-cache hits plus the blocks it reads into).  Stock
vLLM pairs its blocks with the *last* listed ids and reads the wrong blocks without an error
(HTTP 200, wrong tokens); with ``block_ids_bound`` the request fails alone, no READ is posted,
and correct lists are read exactly as stock reads them.

Real code everywhere: D's scheduler half builds the metadata (``update_state_after_alloc``,
``build_connector_meta``), D's worker reads (handshake, ``start_load_kv``, result reporting),
with a recording NIXL agent (``tests/robust_worker.py::scenario_block_ids``).  0.33 in process;
0.19-0.32 from their source trees (``tests/robust_matrix.py``)."""

from __future__ import annotations

import logging

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import vllm_sites

WRONG = ("more", "more_hit", "appended_hit")
RIGHT = ("exact", "exact_hit")


def prompt_blocks(case: str) -> list[int]:
    """P's blocks that hold the tokens of D's blocks to read into (position by position)."""
    hits, reads, remote = rw.BLOCK_ID_CASES[case]
    return remote[len(hits):len(hits) + len(reads)]


def assert_right_lists_read(obs: dict) -> None:
    for case in RIGHT:
        _, reads, _ = rw.BLOCK_ID_CASES[case]
        assert obs["paired"][case] == [{"local": reads, "remote": prompt_blocks(case)}], obs
        assert case in obs["results"]["done_recving"], obs["results"]
        assert case not in obs["results"]["failed_recving"], obs["results"]
    assert not set(obs["results"]["invalid_blocks"]) & {
        b for case in RIGHT for b in rw.BLOCK_ID_CASES[case][1]}, obs["results"]


def assert_stock_reads_wrong_blocks(obs: dict) -> None:
    assert obs["crash"] is None, obs
    for case in WRONG:
        _, reads, remote = rw.BLOCK_ID_CASES[case]
        # The end trim: D's blocks get P's last ids, not the blocks of their positions.
        assert obs["paired"][case] == [{"local": reads, "remote": remote[-len(reads):]}], obs
        assert remote[-len(reads):] != prompt_blocks(case)
        # ... and the load is reported complete: the request decodes from those blocks.
        assert case in obs["results"]["done_recving"], obs["results"]
        assert case not in obs["results"]["failed_recving"], obs["results"]
        assert not set(reads) & set(obs["results"]["invalid_blocks"]), obs["results"]
    assert_right_lists_read(obs)


def assert_failed_alone(obs: dict, case: str, reads: list[int], version: Version) -> None:
    res = obs["results"]
    style = vllm_sites.recv_failure_style(version)
    assert obs["failure_style"] == style
    assert case not in obs["paired"], obs["paired"]              # no READ posted
    if style == "deferred":
        assert case in res["failed_recving"], res
    else:
        # <=0.29: a finished recv whose blocks are all invalid is how these releases fail a
        # load (their own transfer failures do the same).
        assert case in res["done_recving"], res
        assert set(reads) <= set(res["invalid_blocks"]), res


def assert_refused(obs: dict, version: Version) -> None:
    assert obs["crash"] is None, obs
    for case in WRONG:
        assert_failed_alone(obs, case, rw.BLOCK_ID_CASES[case][1], version)
    assert_right_lists_read(obs)
    assert obs["paired"]["after"] and obs["after"]["done_recving"] == ["after"], obs
    assert not obs["after"]["failed_recving"] and not obs["after"]["invalid_blocks"], obs


def assert_same_reads_as_stock(stock: dict, patched: dict) -> None:
    for case in (*RIGHT, "warmup", "after"):
        assert patched["descriptors"][case] == stock["descriptors"][case], case


def test_block_ids_bound_0_33(fresh_pdpatch, caplog):
    stock = rw.scenario_block_ids()
    assert_stock_reads_wrong_blocks(stock)
    states = fresh_pdpatch.install()
    assert states["block_ids_bound"].status == "active"
    lg = logging.getLogger("pdpatch")            # pdpatch's logger does not propagate
    lg.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.ERROR, logger="pdpatch"):
            patched = rw.scenario_block_ids()
    finally:
        lg.removeHandler(caplog.handler)
    assert_refused(patched, Version("0.33.0"))
    assert_same_reads_as_stock(stock, patched)
    # (the installer's summary line, which names the patch too, is logged at INFO)
    lines = [r.getMessage() for r in caplog.records
             if r.levelno >= logging.ERROR and "[block_ids_bound" in r.getMessage()]
    assert len(lines) == len(WRONG), lines
    # Both counts are named: P's list and D's allocation (hits + blocks read).
    assert "request more refused: it lists 22 remote blocks" in lines[0], lines
    assert "holds 0 of the prompt's blocks from its prefix cache and reads 2" in lines[0]
    assert "lists exactly 2" in lines[0]
    assert "request appended_hit refused: it lists 3 remote blocks" in lines[2], lines
    assert "lists exactly 4" in lines[2]


def test_block_ids_bound_toggled_off_per_deployment(fresh_pdpatch, monkeypatch):
    monkeypatch.setenv("PDPATCH_BLOCK_IDS_BOUND", "0")
    states = fresh_pdpatch.install()
    assert states["block_ids_bound"].status == "skipped"
    assert_stock_reads_wrong_blocks(rw.scenario_block_ids())


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_block_ids_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "block_ids", "block_ids_bound")
    assert_stock_reads_wrong_blocks(stock)
    assert_refused(patched, Version(ver))
    assert_same_reads_as_stock(stock, patched)


RATIO_RIGHT = ("ratio_full", "ratio_partial", "ratio_hit")


def assert_ratio(stock: dict, patched: dict, version: Version) -> None:
    """P's blocks half D's size: D's blocks are read as sub-blocks, paired with P's list from
    its end.  A list longer than D's blocks can hold is read from its last ids by stock vLLM
    and refused with pdpatch; lists that fit are read exactly as stock reads them."""
    assert stock["crash"] is None and patched["crash"] is None, (stock, patched)
    _, reads, remote = rw.RATIO_CASES["ratio_more"]
    (pair,) = stock["paired"]["ratio_more"]
    assert pair["remote"] == remote[-2 * len(reads):], pair
    assert "ratio_more" in stock["results"]["done_recving"], stock["results"]
    assert "ratio_more" not in stock["results"]["failed_recving"], stock["results"]
    assert_failed_alone(patched, "ratio_more", reads, version)
    for case in RATIO_RIGHT:
        hits, _, remote = rw.RATIO_CASES[case]
        (pair,) = stock["paired"][case]
        assert pair["remote"] == remote[2 * len(hits):], (case, pair)     # by position
        assert case in patched["results"]["done_recving"], patched["results"]
        assert case not in patched["results"]["failed_recving"], patched["results"]
    for case in (*RATIO_RIGHT, "warmup", "after"):
        assert patched["descriptors"][case] == stock["descriptors"][case], case


def test_block_ids_bound_0_33_block_size_ratio(fresh_pdpatch):
    stock = rw.scenario_block_ids_ratio()
    fresh_pdpatch.install()
    assert_ratio(stock, rw.scenario_block_ids_ratio(), Version("0.33.0"))


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_block_ids_block_size_ratio_on_old_release(ver):
    if ver != "<none>" and ver in robust_matrix.BLOCK_RATIO_RIG_UNSUPPORTED:
        pytest.skip(f"vLLM {ver}'s own kv_postprocess_blksize fails on the rig's blocks-first "
                    "cache (stock and patched alike); see robust_matrix")
    stock, patched = robust_matrix.stock_and_patched(ver, "block_ids_ratio", "block_ids_bound")
    assert_ratio(stock, patched, Version(ver))
