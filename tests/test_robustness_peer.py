"""``peer_check``: impossible values in a peer's handshake metadata are named at handshake time.
The metadata is the real ``NixlAgentMetadata`` of the installed release that a real registered
worker advertises; the end-to-end proof (a fake side channel serving P's real reply, corrupted,
to a real decode engine) is ``tests/e2e/test_robustness_e2e.py``.  The old-release matrix runs
every handshake of its scenarios with the patch active, so a false rejection of a real peer
fails those tests."""

from __future__ import annotations

import dataclasses

import pytest
import robust_matrix
import robust_worker as rw

from pdpatch.patches.peer_check.wrappers import problems


@pytest.fixture(scope="module")
def real_meta():
    return rw.own_metadata(rw.build_worker("prefill-engine", role="kv_producer", num_blocks=40))


def test_real_metadata_passes(real_meta):
    assert problems(real_meta) == []


@pytest.mark.parametrize("changes, needle", [
    ({"num_blocks": -5}, "num_blocks is -5, not a positive integer"),
    ({"num_blocks": 0}, "num_blocks is 0"),
    ({"num_blocks": 10**12}, "num_blocks 1000000000000 x block length"),
    ({"num_blocks": 10**12, "region_num_blocks": None}, "beyond a 48-bit address space"),
    ({"region_num_blocks": [10**12, 10**12]}, "beyond a 48-bit address space"),
    ({"block_size": 0}, "block_size is 0"),
    ({"physical_blocks_per_logical_kv_block": 0}, "physical_blocks_per_logical_kv_block is 0"),
    ({"device_id": -1}, "device_id is -1"),
    ({"kv_caches_base_addr": []}, "kv_caches_base_addr must be a non-empty list"),
    ({"block_lens": [0, 0]}, "block_lens must be positive integers"),
    ({"block_lens": [8192]}, "1 block_lens for 2 regions"),
    ({"block_strides": [0, 0]}, "block_strides must be one integer per region"),
    ({"region_num_blocks": [1]}, "region_num_blocks must be one positive integer per region"),
])
def test_impossible_values_named(real_meta, changes, needle):
    found = problems(dataclasses.replace(real_meta, **changes))
    assert any(needle in f for f in found), found


def test_peer_check_handshake_installed_rejects_and_serves_on(fresh_pdpatch):
    """Through the real handshake path: the rejected peer's request fails, a good peer after."""
    assert fresh_pdpatch.install()["peer_check"].status == "active"
    d = rw.build_worker("decode-engine", num_blocks=32)
    p = rw.build_worker("prefill-engine", role="kv_producer", num_blocks=40)
    bad = rw.remote_metadata(p, "prefill-bad", "BAD0", num_blocks=-5)
    good = rw.remote_metadata(p, "prefill-ok", "OK0")
    errors = rw.connect_by_handshake(d, {}, 1, peers={"prefill-bad": ({0: bad}, 1),
                                                      "prefill-ok": ({0: good}, 1)})
    assert rw.step(d, rw.recv_metadata([{"req_id": "r-bad", "local_ids": [[1]],
                                         "remote_ids": [[2]], "engine": "prefill-bad",
                                         "port": rw.PORT + 1}])) is None
    res, crash = rw.run_until(d, lambda a: "r-bad" in a["failed_recving"])
    assert crash is None and res["failed_recving"] == ["r-bad"], res
    assert errors == ["PeerMetadataInvalid: pdpatch: NIXL handshake rejected, peer prefill-bad "
                      "advertised impossible metadata: num_blocks is -5, not a positive "
                      "integer [peer_check]"]
    assert rw.step(d, rw.recv_metadata([{"req_id": "r-ok", "local_ids": [[3]],
                                         "remote_ids": [[4]], "engine": "prefill-ok",
                                         "port": rw.PORT + 2}])) is None
    res, crash = rw.run_until(d, lambda a: "r-ok" in a["done_recving"])
    assert crash is None and "r-ok" not in res["failed_recving"], res


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_peer_check_target_wraps_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    targets = robust_matrix.report(ver)["targets"]["peer_check"]
    assert [s for s, _ in targets.values()] == ["wrapped"], targets
