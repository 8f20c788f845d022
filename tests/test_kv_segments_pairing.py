"""How ``kv_segments`` pairs a peer's layers with the local ones, against vLLM's own pairing.

From vLLM 0.34 a decode worker pairs a peer's KV regions with its own through the layers both
hold (``NixlBaseConnectorWorker._pair_regions``), not by position; pdpatch's check of a
mixed-name peer mirrors it in :mod:`pdpatch.kv.pairing`.  Here both run on the same layer
lists -- PP slices, shared regions, another order, layers missing on either side -- and must
agree on every pair and every refusal.  vLLM's method runs on a real worker object seeded with
the attributes it reads (as ``test_descriptor_plan_vllm`` seeds the descriptor builders) and a
real ``KVCacheConfig``.  Up to 0.33 regions pair by position in each side's registration order,
layer names sorted by ``_region_sort_key`` from 0.30: :func:`pdpatch.kv.pairing.region_sort_key`
against the release's own.
"""

from __future__ import annotations

import random

import pytest
import robust_worker as rw

from pdpatch.kv import GeometryMismatch, KVGeometry, LayerGeometry, Segment
from pdpatch.kv.pairing import (
    in_region_order,
    pair_layers_by_name,
    pair_regions_by_layer,
    region_sort_key,
)

base_worker = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
Worker = base_worker.NixlBaseConnectorWorker
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
A, B, C, D = NAMES


def _vllm_pairs(local: list[list[str]], remote: list[list[str]], pp_size: int = 1
                ) -> list[tuple[int, int]] | str:
    """vLLM's ``_pair_regions`` on these region members: ``(remote region, local region)``
    pairs (the peer's own region numbers), or the name of what it raised."""
    if not hasattr(Worker, "_pair_regions"):
        pytest.skip("the installed vLLM pairs regions by position (before 0.34)")
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    w = object.__new__(Worker)
    w._packed_member_layouts = {}
    w.kv_cache_config = rw.kv_cache_config(8, [n for names in local for n in names],
                                           rw.attention_spec("llama", 2))
    w._set_region_layers(local)
    w.pp_size = pp_size
    w.block_len_per_layer = [4096] * len(local)
    w._region_is_mla = []
    w._has_mamba = False
    n = len(remote)
    meta = NixlAgentMetadata(
        engine_id="peer", agent_metadata=b"", kv_caches_base_addr=[1 << (20 + i) for i in range(n)],
        device_id=0, num_blocks=8, block_lens=[4096] * n, block_strides=[4096] * n,
        kv_cache_layout="LBHNC", block_size=16, ssm_sizes=(0, 0), attn_backend_name="FLASH_ATTN",
        physical_blocks_per_logical_kv_block=1, region_members=remote)
    try:
        pairs = w._pair_regions(meta)
    except (RuntimeError, NotImplementedError) as exc:
        return type(exc).__name__
    got = [(pairs.remote_regions[r], li) for r, li in zip(pairs.remote, pairs.local, strict=True)]
    return list(dict.fromkeys(got))


def _ours(local: list[list[str]], remote: list[list[str]], pp_size: int = 1
          ) -> list[tuple[int, int]] | str:
    try:
        return pair_regions_by_layer(local, remote, peer_may_hold_more=pp_size > 1)
    except GeometryMismatch:
        return "refused"


CASES = {
    # name: (local region members, peer region members, pp_size, refused)
    "same order": ([[A], [B]], [[A], [B]], 1, False),
    "peer in another order": ([[A], [B], [C]], [[C], [A], [B]], 1, False),
    "PP stage holds a slice": ([[B], [C]], [[A], [B], [C], [D]], 2, False),
    "peer's extra layers without PP": ([[B], [C]], [[A], [B], [C], [D]], 1, True),
    "peer shares a region": ([[A], [B]], [[A, B]], 1, False),
    "local side shares a region": ([[A, B]], [[B], [A]], 1, False),
    "both share, other partners": ([[A, B], [C, D]], [[A, C], [B, D]], 1, False),
    "a layer in two regions on the peer": ([[A], [B]], [[A], [A], [B]], 1, True),
    "a local layer the peer lacks": ([[A], [B], [C]], [[A], [C]], 1, True),
    "a local layer the PP peer lacks": ([[A], [B]], [[A]], 2, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pairs_equal_vllms_own(case: str) -> None:
    local, remote, pp, refuse = CASES[case]
    stock = _vllm_pairs(local, remote, pp)
    ours = _ours(local, remote, pp)
    if refuse:
        assert isinstance(stock, str), stock
        assert ours == "refused", ours
    else:
        assert ours == stock


def test_random_memberships_pair_as_vllm_does() -> None:
    """Random region memberships of one layer set on both sides (a layer in one region each,
    regions shared or not, any order): the same pairs as vLLM's."""
    rng = random.Random(7)
    for _ in range(200):
        names = NAMES[: rng.randint(1, 4)]

        def regions(names: list[str]) -> list[list[str]]:
            shuffled = rng.sample(names, len(names))
            cuts = sorted(rng.sample(range(1, len(names)), rng.randint(0, len(names) - 1)))
            return [shuffled[a:b] for a, b in zip([0, *cuts], [*cuts, len(names)], strict=True)]

        local, remote = regions(names), regions(names)
        assert _ours(local, remote) == _vllm_pairs(local, remote), (local, remote)


def test_layer_pairs_of_per_layer_geometries() -> None:
    """Per-layer tensors (what pdpatch advertises) pair by name: a PP stage's slice of the
    peer's layers, in the peer's order."""
    assert pair_layers_by_name([B, C], [D, C, B, A], peer_may_hold_more=True) == [(1, 1), (2, 0)]
    with pytest.raises(GeometryMismatch, match="no counterpart here"):
        pair_layers_by_name([B, C], [D, C, B, A])


def test_region_order_is_vllms() -> None:
    """0.30-0.33 register regions in ``_region_sort_key`` order (``layers.10`` after
    ``layers.2``), which pdpatch sorts both sides' per-layer geometries by."""
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0, 11)] + \
        ["model.layers.2.mlp.indexer", "draft.layers.0.attn"]
    stock = getattr(base_worker, "_region_sort_key", None)
    if stock is None:
        pytest.skip("the installed vLLM registers regions in kv_caches order (before 0.30)")
    assert [names[i] for i in in_region_order(names)] == sorted(names, key=stock)
    assert all(region_sort_key(n) == stock(n) for n in names)


def _geometry(heads: list[int], names: list[str]) -> KVGeometry:
    layers = [LayerGeometry(i << 20, h * 1024, 4, (Segment("KV", 0, h * 1024),), h, True)
              for i, h in enumerate(heads)]
    return KVGeometry(tuple(layers), 0, "g", tuple(names))


def test_layer_names_travel_with_the_advertised_geometry() -> None:
    """The names ride in the wire form's optional ``names`` key (a reader without it ignores
    it) and follow :meth:`KVGeometry.select`."""
    g = _geometry([2, 1], [B, A])
    wire = g.to_wire()
    assert wire["names"] == [B, A] and wire["v"] == 1
    assert KVGeometry.from_wire(wire) == g
    assert KVGeometry.from_wire({k: v for k, v in wire.items() if k != "names"}).names is None
    picked = g.select(in_region_order(g.names))
    assert picked.names == (A, B) and [la.num_heads for la in picked.layers] == [1, 2]
    assert g.with_num_blocks(2).names == g.names
    with pytest.raises(ValueError, match="as many layer names"):
        KVGeometry.from_wire({**wire, "names": [A]})
    with pytest.raises(ValueError, match="repeat"):
        KVGeometry.from_wire({**wire, "names": [A, A]})
