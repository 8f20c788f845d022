"""Issue 25 case 2 and vllm-project/vllm#50558: a ``remote_block_ids`` list that does not match
what the decode engine allocated (its prefix-cache hits plus the blocks it reads into).  Stock
vLLM pairs its blocks with the *last* listed ids and reads the wrong blocks without an error
(HTTP 200, wrong tokens); with ``block_ids_bound`` the request fails alone, no READ is posted,
and correct lists are read exactly as stock reads them.

Real code everywhere: D's scheduler half builds the metadata (``update_state_after_alloc``,
``build_connector_meta``), D's worker reads (handshake, ``start_load_kv``, result reporting),
with a recording NIXL agent (``tests/robust_worker.py::scenario_block_ids``).  The installed
release in process; older ones from their source trees (``tests/robust_matrix.py``).

With P's blocks smaller than D's, 0.19-0.33 pair D's sub-blocks with P's list by position and
0.34 from P's last token (``remote_num_tokens``): a proxy that appends P's first token to a
prompt ending on D's block boundary (vllm#50558) is read right by 0.33 and wrongly by 0.34,
reported done; with ``block_ids_bound`` 0.34 fails it alone (:func:`assert_ratio`)."""

from __future__ import annotations

import logging

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import metrics, vllm_sites

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


def refusal_lines(caplog, scenario) -> tuple[dict, list[str]]:
    """``scenario``'s observations, and the error lines ``block_ids_bound`` logged meanwhile
    (the installer's summary line, which names the patch too, is logged at INFO)."""
    lg = logging.getLogger("pdpatch")            # pdpatch's logger does not propagate
    lg.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.ERROR, logger="pdpatch"):
            obs = scenario()
    finally:
        lg.removeHandler(caplog.handler)
    return obs, [r.getMessage() for r in caplog.records
                 if r.levelno >= logging.ERROR and "[block_ids_bound" in r.getMessage()]


def test_block_ids_bound_installed(fresh_pdpatch, caplog):
    stock = rw.scenario_block_ids()
    assert_stock_reads_wrong_blocks(stock)
    states = fresh_pdpatch.install()
    assert states["block_ids_bound"].status == "active"
    patched, lines = refusal_lines(caplog, rw.scenario_block_ids)
    assert_refused(patched, robust_matrix.INSTALLED)
    assert_same_reads_as_stock(stock, patched)
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
RATIO = 2                                   # the rig's D block holds two of P's


def right_pairs(case: str) -> list[list[int]]:
    """(D's sub-block, P's block) for each token range both hold: D's allocation position p
    (its hits, then the blocks it reads into) covers P's positions p * RATIO ... (RATIO - 1)
    more, as far as P's list goes."""
    hits, reads, remote = rw.RATIO_CASES[case]
    return [[block * RATIO + j, remote[(len(hits) + i) * RATIO + j]]
            for i, block in enumerate(reads) for j in range(RATIO)
            if (len(hits) + i) * RATIO + j < len(remote)]


def assert_done(obs: dict, case: str) -> None:
    assert case in obs["results"]["done_recving"], obs["results"]
    assert case not in obs["results"]["failed_recving"], obs["results"]
    assert not set(rw.RATIO_CASES[case][1]) & set(obs["results"]["invalid_blocks"]), obs


def assert_ratio(stock: dict, patched: dict, version: Version) -> None:
    """P's blocks half D's size: D's blocks are read as sub-blocks.  A list longer than D's
    blocks can hold is read from its last ids by stock vLLM and refused with pdpatch; the
    correct lists are read right, by stock and pdpatch alike.  vllm#50558 (D's prompt one
    token longer than P's, which ends on D's block boundary): 0.34 pairs from P's last token
    and reads D's blocks one block late, reported done -- pdpatch fails it alone there; 0.19-0.33
    pair by position and read it right, without a local hit (stock and pdpatch alike).  With
    a local hit every release reads it wrongly, and pdpatch fails it alone on every release
    (0.34: exactly, from ``remote_num_tokens``; before: the positional pairing is right only
    where the ids before the paired ones are those D's prefix cache holds)."""
    assert stock["crash"] is None and patched["crash"] is None, (stock, patched)
    for obs in (stock, patched):
        assert obs["pairs"]["warmup"] == [[0, 0]] and obs["pairs"]["after"] == [[22, 24]], obs
        for case in RATIO_RIGHT:
            assert obs["pairs"][case] == right_pairs(case), (case, obs["pairs"])
            assert_done(obs, case)
    for case in (*RATIO_RIGHT, "warmup", "after"):
        assert patched["descriptors"][case] == stock["descriptors"][case], case

    _, reads, remote = rw.RATIO_CASES["ratio_more"]
    assert stock["pairs"]["ratio_more"] == [
        [b * RATIO + j, r] for (b, j), r in zip([(b, j) for b in reads for j in range(RATIO)],
                                                remote[-RATIO * len(reads):], strict=True)]
    assert_done(stock, "ratio_more")
    assert_failed_alone(patched, "ratio_more", reads, version)

    by_last_token = version >= vllm_sites.PAIRS_BY_LAST_TOKEN_FROM
    appended = right_pairs("ratio_appended")
    if by_last_token:
        late = [[lo + RATIO, p] for lo, p in appended]       # one of D's blocks late
        assert stock["pairs"]["ratio_appended"] == late != appended, stock["pairs"]
        assert_done(stock, "ratio_appended")
        assert_failed_alone(patched, "ratio_appended", rw.RATIO_CASES["ratio_appended"][1],
                            version)
    else:
        for obs in (stock, patched):
            assert obs["pairs"]["ratio_appended"] == appended, obs["pairs"]
            assert_done(obs, "ratio_appended")
        assert patched["descriptors"]["ratio_appended"] == \
            stock["descriptors"]["ratio_appended"]

    _, reads, remote = rw.RATIO_CASES["ratio_appended_hit"]
    wrong = [[b * RATIO + j, remote[i * RATIO + j]] for i, b in enumerate(reads)
             for j in range(RATIO)]                           # P's first blocks, not its last
    assert stock["pairs"]["ratio_appended_hit"] == wrong != right_pairs("ratio_appended_hit")
    assert_done(stock, "ratio_appended_hit")
    assert_failed_alone(patched, "ratio_appended_hit", reads, version)

    # A correct list with a local hit whose last P block ends inside D's last block: 0.34 reads
    # it right (pdpatch alike); 0.19-0.33 map D's sub-blocks from the start and end-trim P's
    # list, one P block early, reported done with the wrong KV -- pdpatch fails it alone there.
    right = right_pairs("ratio_hit_partial")
    if by_last_token:
        for obs in (stock, patched):
            assert_done(obs, "ratio_hit_partial")
            assert obs["pairs"]["ratio_hit_partial"] == right, obs["pairs"]
        assert patched["descriptors"]["ratio_hit_partial"] == \
            stock["descriptors"]["ratio_hit_partial"]
    else:
        assert stock["pairs"]["ratio_hit_partial"] == [[28, 34], [29, 35]] != right
        assert_done(stock, "ratio_hit_partial")
        assert_failed_alone(patched, "ratio_hit_partial", rw.RATIO_CASES["ratio_hit_partial"][1],
                            version)


def test_block_ids_bound_installed_block_size_ratio(fresh_pdpatch, caplog):
    stock = rw.scenario_block_ids_ratio()
    fresh_pdpatch.install()
    patched, lines = refusal_lines(caplog, rw.scenario_block_ids_ratio)
    assert_ratio(stock, patched, robust_matrix.INSTALLED)
    if robust_matrix.INSTALLED >= vllm_sites.PAIRS_BY_LAST_TOKEN_FROM:
        assert [line.split(" refused")[0] for line in lines] == [
            f"pdpatch: KV load of request {case}"
            for case in ("ratio_more", "ratio_appended", "ratio_appended_hit")], lines
        # P's token count, both lists' lengths and what they should be are named
        assert ("request ratio_appended refused: it says P computed 32 tokens "
                "(remote_num_tokens): 4 blocks of 8 tokens on P and 2 of 16 here; it lists 4 "
                "remote blocks, and this decode engine holds 0 of the prompt's blocks from its "
                "prefix cache and reads 3") in lines[1], lines


def test_block_size_ratio_without_remote_num_tokens_is_the_releases_own(fresh_pdpatch):
    """0.34 declines a read between different block sizes without P's token count itself
    (``remote_num_tokens``); pdpatch leaves that to it (the same outcome, no refusal counted)."""
    if robust_matrix.INSTALLED < vllm_sites.PAIRS_BY_LAST_TOKEN_FROM:
        pytest.skip("the installed release pairs by position and needs no token count")
    cases = {"ratio_appended": rw.RATIO_CASES["ratio_appended"]}
    stock = rw._block_id_run(cases, rw.BLOCK_SIZE // 2)
    fresh_pdpatch.install()
    patched = rw._block_id_run(cases, rw.BLOCK_SIZE // 2)
    for obs in (stock, patched):
        assert "ratio_appended" not in obs["pairs"], obs["pairs"]          # no READ posted
        assert "ratio_appended" in obs["results"]["failed_recving"], obs["results"]
    assert metrics.total(metrics.REFUSALS, "block_ids_bound") == 0


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_block_ids_block_size_ratio_on_old_release(ver):
    if ver != "<none>" and ver in robust_matrix.BLOCK_RATIO_RIG_UNSUPPORTED:
        pytest.skip(f"vLLM {ver}'s own kv_postprocess_blksize fails on the rig's blocks-first "
                    "cache (stock and patched alike); see robust_matrix")
    stock, patched = robust_matrix.stock_and_patched(ver, "block_ids_ratio", "block_ids_bound")
    assert_ratio(stock, patched, Version(ver))
