"""``kv_segments`` on real vLLM NIXL workers: the installed release (0.34) in process, older
releases from their source trees (``versions_harness``).

A FlashAttention prefill and a decode with FlashInfer's layout (Triton: blocks-first
``(N, 2, bs, H, D)`` up to 0.25, like FlashInfer; FlashInfer itself needs its CUDA package)
complete vLLM's real handshake (the release's ZMQ listener, hash check, msgspec decode,
``add_remote_agent``) and D's ``start_load_kv`` READs land P's K and V bytes in D's blocks
(``CopyingNixlWrapper`` performs each READ with ``memmove`` after checking both descriptors lie
in registered memory).  Without pdpatch the same pair is rejected.  Every release runs all its
scenarios once (stock first, then with pdpatch installed); the tests below read the report.

What each release family shows (see ``test_kv_segments_harness`` for the scenarios):

* 0.19-0.22: FlashAttention registers K and V as separate regions, Triton fused blocks: a real
  split <-> fused conversion, both directions, with TP 1->2, TP 2->1 and (into a split decode)
  block-size ratio 2; on 0.19/0.20 through the ``add_remote_agent`` closure, from 0.21 through
  ``_build_fa_remote``;
* 0.23-0.25: both blocks-first, only the backend name differs (mixed names accepted after the
  geometry check);
* 0.26+ (0.28, 0.33, 0.34): packed K|V for every backend, mixed names accepted when the packed
  geometry of the layers the release pairs -- by position up to 0.33 (in layer-name order from
  0.30), by layer name from 0.34 -- pairs exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
from packaging.version import Version
from versions_harness import INSTALLED, releases_in, run_in_release

from pdpatch import installer, vllm_sites
from pdpatch.patches import kv_segments

SPLIT_ERA = Version("0.23")      # FlashAttention blocks-first from 0.23
PACKED_ERA = Version("0.26")
# Layers of different sizes register from 0.29 (0.26-0.28 assert "All non-MLA kv cache tensors
# must have the same size", 0.26.0 base_worker.py L1169)
UNEVEN_LAYERS = Version("0.29")
TRITON_HND = Version("0.20")     # 0.19's Triton ignores the HND layout NIXL asks for

STOCK = ["pair", "pair_no_enforce"]
# A head-major P and a token-major D (kvcached's layout) with vLLM's receive-side reorder:
# releases whose reorder is right, 0.26-0.28 through the layout patch
# (`vllm_sites.RECEIVE_PERMUTE_SOUND`).
REORDER = ["pair_reorder", "pair_reorder_off", "pair_reorder_same", "pair_reorder_ratio",
           "pair_reorder_ratio_same", "pair_reorder_ratio_fused"]
REORDER_TP = ["tp_up_reorder", "tp_down_reorder"]     # from 0.20: 0.19 runs token-major only


def stock_scenarios(version: Version) -> list[str]:
    reorder = version in vllm_sites.RECEIVE_PERMUTE_SOUND
    names = [*STOCK, "pair_reorder_same", "pair_reorder_ratio_same"] if reorder else STOCK
    if version >= UNEVEN_LAYERS:
        names = [*names, "layer_order_no_enforce"]
    return names


# Same-layout peers with PDPATCH_KV_COALESCE (opt-in), FlashAttention on both sides.  Coalescing
# reads vLLM's own descriptor lists, whose form changed by era; it runs on the last release of
# each -- 0.19 (single-file connector), 0.22 (split K/V regions), 0.25 (blocks-first), 0.32
# (packed K|V, lists of tuples) -- and on 0.33 and 0.34 (strided Nx5 rows; 0.34 routes them
# through its region pairs): the releases between build their lists as these do, so running it
# there would test the same fact again.
COALESCED = ["pair_coalesced", "pair_coalesced_chunked", "tp_up_coalesced", "tp_down_coalesced",
             "tp_up_coalesced_chunked", "readd_known_rank_coalesced"]
COALESCE_ERAS = ("0.19", "0.22", "0.25", "0.32", "0.33", "0.34")


def coalesce_era(version: Version) -> bool:
    return f"{version.major}.{version.minor}" in COALESCE_ERAS


def patched_scenarios(version: Version) -> list[str]:
    if version < TRITON_HND:
        # Run token-major (NHD), the order 0.19's Triton really uses; head splits (TP) and the
        # block-size receive post-processing need HND there, so those run from 0.20.
        names = ["pair", "pair_reverse", "pair_same", "pair_unstaged", "pair_gap",
                 "pair_chunked", "span_advertised",
                 "span_stock_fields", "advert_ignored",
                 *(n for n in REORDER if n != "pair_reorder_ratio_fused")]
        if coalesce_era(version):
            names += [*COALESCED[:2], "readd_known_rank_coalesced"]
        return [*names, "readd_known_rank", "globals"]
    names = ["pair", "pair_reverse", "pair_same", "tp_up", "tp_down", "span_advertised",
             "span_stock_fields", "advert_ignored", "readd_known_rank"]
    if version >= UNEVEN_LAYERS:
        names += ["layer_order"]
    if coalesce_era(version):
        names += COALESCED
    if not PACKED_ERA <= version < Version("0.33"):
        # 0.28: the stock same-backend pair with 16- vs 32-token blocks already does not
        # reproduce P's tokens after vLLM's receive post-processing on CPU; nothing to compare.
        names += ["block_ratio"]
    if version < SPLIT_ERA:
        names += ["block_ratio_reverse", "pair_cpu", "pair_unstaged", "pair_gap",
                  "pair_chunked"]
    if version >= PACKED_ERA:
        names += ["pair_cpu"]
    if version >= Version("0.33"):
        names += ["restore"]
    if version in vllm_sites.RECEIVE_PERMUTE_SOUND:
        names += [*REORDER, *REORDER_TP]
    return [*names, "globals"]           # last: it uninstalls pdpatch


# Every fetched release in the patch's range: 0.19 (single-file connector) and 0.20 (package)
# the closure builder; 0.21-0.22 _build_fa_remote with split FlashAttention; 0.23-0.25
# blocks-first FlashAttention; 0.26+ packed K|V (the installed 0.34, in process: the planner,
# Nx5 strided descriptors, regions paired by layer name).
OLD = [ver for ver in releases_in(kv_segments.PATCH.versions) if ver != "<none>"]
_reports: dict[str, dict[str, Any]] = {}


def report(key: str) -> dict[str, Any]:
    """One subprocess per release (in process for the installed one), cached.  ``X+hnd`` is
    release X under the layout NIXL asks for when X otherwise runs token-major."""
    if key not in _reports:
        ver, _, variant = key.partition("+")
        if ver == INSTALLED:
            import test_kv_segments_harness as h

            installer.uninstall()
            try:
                _reports[key] = h.release_report([*stock_scenarios(Version(ver)), "pair_cpu"],
                                                 patched_scenarios(Version(ver)))
            finally:
                installer.uninstall()
        else:
            stock, patched = stock_scenarios(Version(ver)), patched_scenarios(Version(ver))
            env = None
            if Version(ver) < TRITON_HND:
                env = {"VLLM_KV_CACHE_LAYOUT": "NHD"}
            if variant == "hnd":
                stock, patched, env = [], ["pair", "pair_reverse"], None
            run = run_in_release(ver, f"""
                import test_kv_segments_harness as h
                emit(h.release_report({stock!r}, {patched!r}))
            """, env=env, timeout=1500)
            _reports[key] = run.check()
    return _reports[key]


VERSIONS = [INSTALLED, *OLD]
COALESCE_VERSIONS = [x for x in VERSIONS if coalesce_era(Version(x))]


def scenario(ver: str, phase: str, name: str) -> dict[str, Any]:
    out = report(ver)[phase].get(name)
    if out is None:
        pytest.skip(f"{name} is not run on vLLM {ver}")
    assert "error" not in out, out["error"]
    return out


def ok_pull(out: dict[str, Any], blocks: list[int]) -> None:
    assert out["crash"] is None
    assert out["handshake_errors"] == []
    assert out["nixl_errors"] == []
    assert out["results"]["failed_recving"] == [] and out["results"]["invalid_blocks"] == []
    assert out["mismatches"] == []
    assert out["changed_blocks"] == blocks       # nothing outside the requested blocks


def refused(out: dict[str, Any], *needles: str, crash: tuple = (None,)) -> str:
    assert out["crash"] in crash
    assert len(out["handshake_errors"]) >= 1, out
    err = out["handshake_errors"][0]
    for needle in needles:
        assert needle in err, err
    assert out["copied_bytes"] == 0
    assert out["changed_blocks"] == []           # D's memory untouched
    if out["crash"] is None:
        # vLLM records the failure for this request only (failed / invalid blocks); a worker
        # the release kills may die before or after it reported the request (CI saw both)
        assert out["results"]["failed_recving"] or out["results"]["invalid_blocks"]
    return err


def v(ver: str) -> Version:
    return Version(ver.partition("+")[0])


# ------------------------------------------------------------------------------- stock


# vLLM 0.19-0.21 kill the decode worker one step after a failed handshake (KeyError in the
# block-size post-processing; pdpatch's handshake_failure_guard fixes that, not tested here).
STOCK_CRASH = Version("0.22")


@pytest.mark.parametrize("ver", VERSIONS)
def test_stock_rejects_the_mixed_pair(ver: str) -> None:
    out = scenario(ver, "stock", "pair")
    assert out["backends"] == ["FLASH_ATTN", "TRITON_ATTN"]
    crash = ("KeyError: 'prefill'",) if v(ver) < STOCK_CRASH else (None,)
    refused(out, "NIXL compatibility hash mismatch", crash=crash)


@pytest.mark.parametrize("ver", VERSIONS)
def test_stock_without_hash_check(ver: str) -> None:
    """With ``enforce_handshake_compat=false``: up to 0.22 the block-length assertion refuses
    (K-only vs K+V block lengths); from 0.23 the layouts coincide and only the name differed."""
    out = scenario(ver, "stock", "pair_no_enforce")
    if v(ver) < SPLIT_ERA:
        assert out["p_regions"] == 2 * out["d_regions"]      # FA: K and V regions per layer
        crash = (None, "KeyError: 'prefill'") if v(ver) < STOCK_CRASH else (None,)
        err = refused(out, "AssertionError", crash=crash)
        # 0.19 asserts without a message (region count), later releases name the shape
        assert v(ver) < TRITON_HND or "KV layer cache must be of shape" in err, err
    else:
        ok_pull(out, [1, 2, 3])


# ----------------------------------------------------------------------------- patched


@pytest.mark.parametrize("ver", VERSIONS)
@pytest.mark.parametrize("name", ["pair", "pair_reverse"])
def test_mixed_pair_transfers_the_right_bytes(ver: str, name: str) -> None:
    out = scenario(ver, "patched", name)
    ok_pull(out, [1, 2, 3])
    assert moved(out) == 3 * 2 * 2 * 2 * 16 * 64 * 2   # blocks x layers x K,V x heads
    stats = out["stats"]
    assert stats["hash_alternates_accepted"] == 1
    if v(ver) < SPLIT_ERA:
        assert {out["p_regions"], out["d_regions"]} == {2, 4}    # split vs fused
        assert stats["conversions"] == 1 and stats["mixed_accepted"] == 0
        staged_once(out["staging"])
    else:
        assert out["p_regions"] == out["d_regions"] == 2
        assert stats["conversions"] == 0 and stats["mixed_accepted"] == 1
        if v(ver) < PACKED_ERA:     # kvcached's split-half pools may still convert: an agent
            assert out["staging"]["staged_reads"] == 0 and out["staging"]["not_staged"] == {}
            assert out["staging"]["allocated"] == 0     # no buffer until a READ is staged
        else:                       # nothing converts from 0.26: no agent
            assert out["staging"] is None


def moved(out: dict[str, Any]) -> int:
    """Bytes the fake NIXL copied for vLLM's READs: all it copied, less what the staging agent
    read besides (into staging, never the KV cache): READs measuring the peer's transport, and
    a gap READ's bytes between requested rows (head slices of P's blocks: the other heads)."""
    staging = out.get("staging") or {}
    return out["copied_bytes"] - (staging.get("calibration_bytes") or 0) - \
        (staging.get("gap_bytes") or 0)


STAGING_COUNTS = ("staged_reads", "gap_reads", "gap_bytes", "calibration_bytes",
                  "descriptors_staged", "descriptors_stock", "chunked_reads", "chunks")


def own_counts(ranks: dict[str, Any]) -> dict[str, Any]:
    """A TP scenario's D ranks, each with its own staging counts: one process runs both and
    the patch's staging counters are per process, so rank 1's are its totals less rank
    0's."""
    s0, s1 = ranks["rank0"]["staging"], ranks["rank1"]["staging"]
    if s0 is None or s1 is None:
        return ranks
    own = {**s1, **{k: s1[k] - s0[k] for k in STAGING_COUNTS}}
    return {**ranks, "rank1": {**ranks["rank1"], "staging": own}}


def staged_once(staging: dict[str, Any] | None) -> None:
    """One READ went through staging, with fewer NIXL descriptors than vLLM's list needs:
    blocks 4, 5, 6 are a run, contiguous in P's memory."""
    assert staging is not None
    assert staging["staged_reads"] == 1 and staging["not_staged"] == {}
    assert staging["descriptors_staged"] < staging["descriptors_stock"]
    assert staging["gather_failures"] == 0
    assert staging["free"] == staging["allocated"] == 128 << 20   # the slots came back
    # one run per layer and pool: no gap could shorten the READ, so the peer's transport is
    # not measured in its first request (test_nixl_transfer: measured where a gap could)
    assert staging["calibration_bytes"] == 0 and staging["gap_budgets"] == {}


@pytest.mark.parametrize("ver", [x for x in VERSIONS if v(x) < SPLIT_ERA])
def test_blocks_apart_share_descriptors_through_gap_reads(ver: str) -> None:
    """P's blocks 3, 5, 8 into D's 1, 2, 3 with ``PDPATCH_KV_GAP_KIB=1024``: one READ per
    layer and K/V pool of split P (2 x 2) instead of one per block segment (12, which
    staging without gaps could not cut: it leaves such READs to vLLM); only D's requested
    blocks change, and the bytes between P's blocks stay in staging."""
    out = scenario(ver, "patched", "pair_gap")
    ok_pull(out, [1, 2, 3])
    staging = out["staging"]
    assert staging["staged_reads"] == staging["gap_reads"] == 1, staging
    assert (staging["descriptors_staged"], staging["descriptors_stock"]) == (4, 12)
    assert staging["gap_bytes"] == 2 * 2 * 3 * 4096     # blocks 4, 6, 7 of each pool
    assert staging["gap_budgets"] == {}                  # set, not measured
    assert staging["free"] == staging["allocated"]


@pytest.mark.parametrize("ver", [x for x in VERSIONS if v(x) < SPLIT_ERA])
def test_read_larger_than_staging_is_chunked_behind_one_handle(ver: str) -> None:
    """1.5 MiB of blocks through 1 MiB of staging: six chunk READs (two lanes of 256 KiB in
    the half of the buffer one chunked READ may take) behind the one handle vLLM polls, the
    right bytes in D's blocks only, vLLM's notification sent once, after the chunks, and
    carried by none of them; vLLM records the whole READ from the agent's telemetry; every
    lane back."""
    out = scenario(ver, "patched", "pair_chunked")
    ok_pull(out, [1, 2, 3])
    assert moved(out) == 3 * 2 * 2 * 2 * 512 * 64 * 2
    staging = out["staging"]
    assert staging["staged_reads"] == staging["chunked_reads"] == 1, staging
    assert staging["chunks"] == 6 and staging["chunk_failures"] == 0
    assert staging["not_staged"] == {}
    assert staging["free"] == staging["allocated"] == 1 << 20
    assert out["read_notifs"] == [None] * 6
    assert len(out["notifs_sent"]) == 1 and out["notifs_sent"][0].startswith("req-1")
    assert out["xfer_stats"]["bytes_transferred"] == [moved(out)]
    assert out["xfer_stats"]["num_descriptors"] == [staging["descriptors_staged"]]


@pytest.mark.parametrize("ver", [x for x in VERSIONS if v(x) < SPLIT_ERA])
def test_conversion_without_staging_goes_per_segment(ver: str) -> None:
    out = scenario(ver, "patched", "pair_unstaged")
    ok_pull(out, [1, 2, 3])
    assert out["stats"]["conversions"] == 1
    assert out["staging"] is None


@pytest.mark.parametrize("ver", VERSIONS)
def test_equal_layouts_stay_a_pass_through(ver: str) -> None:
    out = scenario(ver, "patched", "pair_same")
    ok_pull(out, [1, 2, 3])
    stats = out["stats"]
    assert stats["advertised"] == 2
    assert (stats["conversions"], stats["mixed_accepted"], stats["hash_alternates_accepted"],
            stats["rejected"], stats["coalesced"]) == (0, 0, 0, 0, 0)
    # vLLM's own READ: no staging agent from 0.26 (nothing converts), none of its READs staged
    assert out["staging"] is None or out["staging"]["staged_reads"] == 0


@pytest.mark.parametrize("ver", COALESCE_VERSIONS)
def test_coalesce_stages_same_layout_reads(ver: str) -> None:
    """``PDPATCH_KV_COALESCE=1``, FlashAttention on both sides: vLLM's own descriptor pairs (no
    conversion), read in P's address order: P's adjacent blocks 4, 5, 6 move in fewer
    descriptors than vLLM posts into D's blocks 1, 3, 5 (apart: NIXL cannot merge them), the
    right bytes land there and nowhere else, vLLM's notification goes to P once."""
    out = scenario(ver, "patched", "pair_coalesced")
    ok_pull(out, [1, 3, 5])
    staging = out["staging"]
    assert staging["staged_reads"] == 1 and staging["not_staged"] == {}, staging
    assert staging["descriptors_staged"] < staging["descriptors_stock"], staging
    assert staging["free"] == staging["allocated"]
    assert out["stats"]["coalesced"] == 1
    assert (out["stats"]["conversions"], out["stats"]["rejected"]) == (0, 0)
    assert len(out["notifs_sent"]) + len([n for n in out["read_notifs"] if n]) == 1


@pytest.mark.parametrize("ver", COALESCE_VERSIONS)
def test_coalesce_reads_larger_than_staging_in_chunks(ver: str) -> None:
    """Coalesced, six 256-token blocks (1.5 MiB) through 1 MiB of staging: the READ is read
    in chunks behind one handle, the bytes land in D's six blocks and nowhere else."""
    out = scenario(ver, "patched", "pair_coalesced_chunked")
    ok_pull(out, [0, 1, 2, 4, 6, 8])
    staging = out["staging"]
    assert staging["chunked_reads"] == 1 and staging["chunks"] > 1, staging
    assert staging["chunk_failures"] == 0 and staging["free"] == staging["allocated"]
    assert len(out["notifs_sent"]) == 1 and out["notifs_sent"][0].startswith("req-1")


@pytest.mark.parametrize("ver", COALESCE_VERSIONS)
def test_coalesce_with_heterogeneous_tp(ver: str) -> None:
    """P TP 2 -> D TP 1: whole blocks of each P rank into head slices of D's, staged and
    byte-exact.  P TP 1 -> D TP 2: head slices of P's blocks, which only a gap READ merges
    (across the other head's bytes, which stay in staging), byte-exact.  (Without gap reads
    they go as vLLM built them: test_nixl_transfer, head-slice cases.)"""
    down = scenario(ver, "patched", "tp_down_coalesced")
    ok_pull(down, [1, 2])
    assert down["staging"]["staged_reads"] == 2, down["staging"]
    assert down["staging"]["descriptors_staged"] < down["staging"]["descriptors_stock"]
    up = own_counts(scenario(ver, "patched", "tp_up_coalesced"))
    for rank in ("rank0", "rank1"):
        ok_pull(up[rank], [1, 2])
        staging = up[rank]["staging"]
        assert staging["staged_reads"] == staging["gap_reads"] == 1, staging
        assert staging["descriptors_staged"] < staging["descriptors_stock"]
        assert moved(up[rank]) == 2 * 2 * 2 * 1 * 16 * 64 * 2   # one head of two
    assert up["stats"]["coalesced"] == down["stats"]["coalesced"] == 2


@pytest.mark.parametrize("ver", COALESCE_VERSIONS)
def test_coalesced_head_slices_larger_than_staging_are_gap_read_in_chunks(ver: str) -> None:
    """P TP 1 -> D TP 2, each rank's head of nine 256-token blocks (1.125 MiB) through 1 MiB
    of staging: read across the other head's bytes in chunks -- fewer descriptors than vLLM's
    one per block and layer (and K/V), byte-exact, nothing outside the nine blocks touched."""
    up = own_counts(scenario(ver, "patched", "tp_up_coalesced_chunked"))
    for rank in ("rank0", "rank1"):
        ok_pull(up[rank], list(range(1, 10)))
        staging = up[rank]["staging"]
        assert staging["staged_reads"] == staging["gap_reads"] == 1, staging
        assert staging["chunked_reads"] == 1 and staging["chunks"] > 1, staging
        assert staging["descriptors_staged"] < staging["descriptors_stock"], staging
        assert moved(up[rank]) == 2 * 2 * 9 * 1 * 256 * 64 * 2     # one head of two


@pytest.mark.parametrize("ver", VERSIONS)
def test_heterogeneous_tp_through_the_conversion(ver: str) -> None:
    up = own_counts(scenario(ver, "patched", "tp_up"))
    for rank in ("rank0", "rank1"):
        ok_pull(up[rank], [1, 2])
        assert moved(up[rank]) == 2 * 2 * 2 * 1 * 16 * 64 * 2   # one head of two
    down = scenario(ver, "patched", "tp_down")
    ok_pull(down, [1, 2])
    kind = "conversions" if v(ver) < SPLIT_ERA else "mixed_accepted"
    assert up["stats"][kind] == 2 and down["stats"][kind] == 2


@pytest.mark.parametrize("ver", VERSIONS)
def test_block_size_ratio_into_blocks_first_memory(ver: str) -> None:
    """D blocks of 32 tokens, P blocks of 16, D blocks-first.  vLLM 0.19-0.25 cannot receive
    smaller blocks into blocks-first memory (its V descriptors are not divided by the ratio:
    the stock same-backend pair overruns into the next block, then crashes in the receive
    post-processing), so pdpatch refuses that pairing by name; on packed 0.33+ it works (0.34
    with the ``remote_num_tokens`` a proxy forwards from P, which it requires for the pairing
    of blocks of different sizes)."""
    out = scenario(ver, "patched", "block_ratio")
    if v(ver) < PACKED_ERA:
        refused(out, "GeometryMismatch", "blocks-first", "block-size ratio")
    else:
        ok_pull(out, [1])


@pytest.mark.parametrize("ver", VERSIONS)
def test_block_size_ratio_through_the_conversion(ver: str) -> None:
    """Fused P (16-token blocks) into a split FlashAttention D (32-token blocks): converted, and
    vLLM's own receive post-processing leaves P's two blocks back to back in D's one."""
    out = scenario(ver, "patched", "block_ratio_reverse")
    ok_pull(out, [1])
    assert out["stats"]["conversions"] == 1


@pytest.mark.parametrize("ver", VERSIONS)
@pytest.mark.parametrize("name", ["span_advertised", "span_stock_fields"])
def test_span_mismatch_fails_the_peer_clearly(ver: str, name: str) -> None:
    out = scenario(ver, "patched", name)
    err = refused(out, "GeometryMismatch", "spans differ", "local =")
    assert out["remote_dlists"] == 0 and out["reads"] == 0      # nothing registered or read
    assert "remote = remote engine prefill" in out["stats"]["last_error"]
    assert out["stats"]["rejected"] == 1, err


@pytest.mark.parametrize("ver", VERSIONS)
def test_not_interchangeable_backends_stay_rejected(ver: str) -> None:
    """CPU attention re-packs its cache after a transfer from another backend (0.23+), so it is
    not in pdpatch's interchangeable set: the hash still refuses it."""
    out = scenario(ver, "patched", "pair_cpu")
    refused(out, "NIXL compatibility hash mismatch")
    assert out["stats"]["hash_alternates_accepted"] == 0


@pytest.mark.parametrize("ver", [x for x in VERSIONS if v(x) >= UNEVEN_LAYERS])
def test_mixed_pair_is_checked_on_the_layers_the_release_pairs(ver: str) -> None:
    """Layers of different sizes (2 KV heads, then 1), P's ``kv_caches`` dict in the other
    order, so P advertises its layers as ``[layers.1, layers.0]``.  From 0.30 the release
    pairs them by layer name -- by position in name order (0.30-0.33), through
    ``region_members`` (0.34+) -- and serves the pair byte-exactly with the hash check off;
    pdpatch accepts it as exactly (before, it compared P's layer 1 with D's layer 0 and refused
    a pair stock serves).  0.29 pairs by position in dict order, P's layer 1 with D's layer 0:
    the release refuses (block lengths), and so does pdpatch, naming the layer (0.26-0.28
    register no layers of different sizes)."""
    out = scenario(ver, "patched", "layer_order")
    stock = scenario(ver, "stock", "layer_order_no_enforce")
    assert out["advertised_names"] == [f"model.layers.{i}.self_attn.attn" for i in (1, 0)]
    by_name = v(ver) in vllm_sites.REGIONS_IN_LAYER_NAME_ORDER or \
        v(ver) in vllm_sites.REGIONS_PAIRED_BY_LAYER
    if by_name:
        ok_pull(stock, [1, 2, 3])
        ok_pull(out, [1, 2, 3])
        assert (out["stats"]["mixed_accepted"], out["stats"]["rejected"]) == (1, 0)
    else:
        refused(stock)
        refused(out, "GeometryMismatch", "layer 0", "heads")
        assert out["stats"]["rejected"] == 1


@pytest.mark.parametrize("ver", VERSIONS)
def test_a_known_peer_rank_is_left_to_the_release(ver: str) -> None:
    """``add_remote_agent`` again for a peer rank the worker added (its ``_remote_agents``
    keyed by rank up to 0.25, by (pp rank, tp rank) from 0.26): the release returns the agent
    it has, and pdpatch neither plans, counts nor stages the peer again (it counted a second
    acceptance on 0.26+ before)."""
    out = scenario(ver, "patched", "readd_known_rank")
    ok_pull(out, [1, 2, 3])
    assert out["readd_error"] is None and out["readd_same_agent"] is True
    assert out["readd_new_dlists"] == 0
    assert out["stats_after"] == out["stats"]


@pytest.mark.parametrize("ver", COALESCE_VERSIONS)
def test_a_known_peer_rank_is_not_staged_again(ver: str) -> None:
    out = scenario(ver, "patched", "readd_known_rank_coalesced")
    ok_pull(out, [1, 2, 3])
    assert out["stats"]["coalesced"] == 1
    assert out["readd_error"] is None and out["readd_same_agent"] is True
    assert out["stats_after"] == out["stats"]


@pytest.mark.parametrize("ver", VERSIONS)
def test_stock_decoder_ignores_the_advertised_field(ver: str) -> None:
    out = scenario(ver, "patched", "advert_ignored")
    assert "pdpatch_kv_geometry" in out["wire_keys"]
    assert out["stock_decoded_type"] == "NixlAgentMetadata"
    assert out["stock_decoded_has_field"] is False
    ok_pull(out, [1, 2, 3])          # D with kv_segments off: vLLM's own decoder and code path


@pytest.mark.parametrize("ver", VERSIONS)
def test_wire_classes_are_scoped_and_uninstall_restores(ver: str) -> None:
    out = scenario(ver, "patched", "globals")
    mine = "pdpatch.patches.kv_segments.handshake"
    during = [list(x) for x in out["during_handshake"]]
    assert during == [[mine, True]]    # the payload global ours, the decoded metadata vLLM's
    assert list(out["restored_after_handshake"]) == [True, True]
    assert list(out["restored_after_uninstall"]) == [True, True]
    assert out["patched"]["done_recving"] == ["req-1"]
    assert out["status"] == "uninstalled"
    assert "NIXL compatibility hash mismatch" in out["after_uninstall"]["handshake_errors"][0]


def test_advertisement_survives_sleep_and_wake() -> None:
    out = scenario(INSTALLED, "patched", "restore")
    assert out == {"before": True, "after": True, "same_keys": True}


@pytest.mark.parametrize("ver", OLD[:1] or ["<none>"])  # runs in its release's worker group
def test_triton_ignoring_hnd_is_refused_not_garbled(ver: str) -> None:
    """vLLM 0.19's Triton backend keeps token-major memory while NIXL advertises "HND".  A
    FlashAttention (head-major) peer and it hold the same bytes in different orders: pdpatch
    reads the order from the tensors' strides and refuses the pair by name, in both
    directions, instead of copying whole segments whose contents mean different things."""
    if ver == "<none>" or v(ver) >= TRITON_HND:
        pytest.skip("no 0.19 source tree")
    for name in ("pair", "pair_reverse"):
        out = scenario(f"{ver}+hnd", "patched", name)
        refused(out, "HeadOrderMismatch", "head-major", "token-major")


# ------------------------------------------------------------ head-major P, token-major D


REORDER_VERSIONS = [ver for ver in VERSIONS if v(ver) in vllm_sites.RECEIVE_PERMUTE_SOUND]
SCRAMBLE_VERSIONS = [ver for ver in REORDER_VERSIONS
                     if v(ver) in vllm_sites.RECEIVE_PERMUTE_SCRAMBLES]


@pytest.mark.parametrize("ver", [ver for ver in REORDER_VERSIONS
                                 if ver not in SCRAMBLE_VERSIONS])
def test_stock_reorder_on_receive(ver: str) -> None:
    """vLLM's own enable_permute_local_kv, same backend on both sides: right for K/V-first
    FlashAttention (<= 0.22, 4-D K and V caches) and from 0.32 (its reorder reads the packed
    cache in memory order), but blocks-first FlashAttention (0.23-0.25) hands the 5-D cache to
    a reorder written for 4-D ones -- the decode worker dies on the first received block
    (IndexError in index_copy_, raised in get_finished)."""
    out = scenario(ver, "stock", "pair_reorder_same")
    ratio = scenario(ver, "stock", "pair_reorder_ratio_same")     # D's blocks twice P's
    if v(ver) < SPLIT_ERA or v(ver) >= Version("0.32"):
        ok_pull(out, [1, 2, 3])
        ok_pull(ratio, [1])
    else:
        assert out["crash"] is not None and "index_copy_" in out["crash"], out["crash"]
        assert ratio["crash"] is not None and "too many values to unpack" in ratio["crash"], \
            ratio["crash"]


@pytest.mark.parametrize("ver", REORDER_VERSIONS)
@pytest.mark.parametrize("name", ["pair_reorder", "pair_reorder_same", "pair_reorder_ratio",
                                  "pair_reorder_ratio_same", "pair_reorder_ratio_fused"])
def test_head_major_prefill_into_token_major_decode(ver: str, name: str) -> None:
    """With pdpatch: a decode engine forced token-major (as kvcached forces it) turns on vLLM's
    reorder itself, kv_segments copies P's head-major segments verbatim (a split <-> fused
    conversion up to 0.22), and D's blocks then hold exactly P's K and V -- blocks-first caches
    included, and 0.26-0.31's token-major packed caches (their memory-order view).  The
    operator's own flag on a same-backend pair works too, and so do D's blocks twice the size
    of P's (``*_ratio``: vLLM's block-size-and-layout reorder, which stock 0.26-0.31 scramble
    with) -- except into 0.23-0.25's blocks-first caches, where the release's READ overruns
    into the next block (test_block_size_ratio_into_blocks_first_memory) and its reorder then
    kills the worker (test_stock_reorder_on_receive): there the peer is refused by name, and
    nothing is read.  The same for Triton's blocks-first caches up to 0.25 (``*_fused``, a
    Triton P and D): on 0.20-0.21 the refused request is then reported failed without the
    release's post-processing (handshake_failure_guard), whose reorder would kill the worker
    for it all the same."""
    if name == "pair_reorder_ratio_fused" and v(ver) < TRITON_HND:
        pytest.skip("0.19's Triton ignores the head-major layout: no head-major Triton peer")
    out = scenario(ver, "patched", name)
    ratio = "_ratio" in name
    assert out["permute_flag"] is True
    blocks_first = v(ver) < PACKED_ERA and (name == "pair_reorder_ratio_fused"
                                            or v(ver) >= SPLIT_ERA)
    if ratio and blocks_first and v(ver) in vllm_sites.BLOCKS_FIRST_RATIO_OVERRUN:
        refused(out, "pdpatch layout", "blocks-first", "same --block-size")
        return
    ok_pull(out, [1] if ratio else [1, 2, 3])


@pytest.mark.parametrize("ver", [ver for ver in REORDER_VERSIONS if v(ver) >= TRITON_HND])
def test_head_major_prefill_into_token_major_decode_at_other_tp(ver: str) -> None:
    """The same with P TP 1 -> D TP 2 and P TP 2 -> D TP 1 (seen on GPU engines: a kvcached
    decode at TP 2 and a stock prefill at TP 1).  Until the release's reorder runs, a received
    block holds head-major bytes, so each rank's heads go to their head-major place in it."""
    up = scenario(ver, "patched", "tp_up_reorder")
    for rank in ("rank0", "rank1"):
        ok_pull(up[rank], [1, 2])
    ok_pull(scenario(ver, "patched", "tp_down_reorder"), [1, 2])


@pytest.mark.parametrize("ver", REORDER_VERSIONS)
def test_head_order_left_alone_is_refused_by_name(ver: str) -> None:
    out = scenario(ver, "patched", "pair_reorder_off")
    assert out["permute_flag"] is False
    refused(out, "HeadOrderMismatch", "enable_permute_local_kv", "PDPATCH_LAYOUT_FORCE=1")


@pytest.mark.parametrize("ver", SCRAMBLE_VERSIONS)
def test_stock_reorder_scrambles_token_major_packed_caches(ver: str) -> None:
    """0.26-0.31: vLLM's own reorder reshapes the logical view of a token-major cache, whose
    logical shape is head-major there, instead of its memory order (on GPU engines, run cc:
    vLLM 0.30, a kvcached decode engine with the operator's flag, 0/6 answers intact).  The
    pull completes without an error and the blocks hold other bytes than P's K and V -- why
    the layout patch hands that reorder the cache's memory-order view on these releases
    (test_head_major_prefill_into_token_major_decode shows the same pull right with it)."""
    out = scenario(ver, "stock", "pair_reorder_same")
    assert out["crash"] is None and out["handshake_errors"] == [], out
    assert out["changed_blocks"] == [1, 2, 3]
    wrong = {m.split(" <- ")[0].rsplit(" ", 1)[-1] for m in out["mismatches"]}
    assert wrong == {"1", "2", "3"}, out["mismatches"]
    # D's blocks twice P's: its block-size-and-layout reorder reads the logical view too
    ratio = scenario(ver, "stock", "pair_reorder_ratio_same")
    assert ratio["crash"] is None and ratio["changed_blocks"] == [1], ratio
    assert len(ratio["mismatches"]) == 8, ratio["mismatches"]   # K and V of both P blocks
