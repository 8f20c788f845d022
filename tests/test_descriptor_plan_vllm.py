"""pdpatch's vLLM-ordered descriptor tables equal the REAL installed vLLM's (0.33+: Nx5 strided
rows) output for equal layouts.

The functions under comparison are vLLM's own: the static ``_block_strided_descs``, and the
``_build_fa_remote`` / ``_compute_desc_ids`` methods run on a ``NixlBaseConnectorWorker``
whose state is seeded the way vLLM's own unit tests seed ``FakeNixlConnectorWorker`` (only the
attributes those methods read; ``register_kv_caches`` needs real device memory and NIXL).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from kv_helpers import LayoutSpec, build_side

from pdpatch import vllm_sites
from pdpatch.kv import HeadSlice, PairPlan, infer_geometry

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
base_worker = pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (  # noqa: E402
    NixlAgentMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import TPMapping  # noqa: E402

from lab.bench.descriptors import seeded_worker  # noqa: E402

Worker = base_worker.NixlBaseConnectorWorker


def _packed(num_layers, num_blocks, bs, heads, head_dim, es, pad=0, cross=False, base=0):
    side = build_side(LayoutSpec("packed", block_pad=pad, cross_layer=cross), num_layers,
                      num_blocks, bs, heads, head_dim, es, base=base)
    return infer_geometry(side.infos, num_blocks=num_blocks, heads_dim=1)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("pad", [0, 8])
@pytest.mark.parametrize("cross", [False, True])
def test_local_rows_equal_vllm_block_strided_descs(ratio, pad, cross) -> None:
    g = _packed(3, 7, 8, 2, 4, 2, pad=pad, cross=cross, base=1 << 20)
    remote = _packed(3, 9, 8 // ratio, 2, 4, 2)
    ours = PairPlan(g, remote, block_size_ratio=ratio)
    ref = np.concatenate([
        Worker._block_strided_descs(la.base, la.segments[0].length // ratio, la.block_stride,
                                    la.num_blocks, ratio, 0)
        for la in g.layers
    ])
    assert np.array_equal(ours.local_rows(), ref)


@pytest.mark.parametrize(
    ("tp_ratio", "factor", "num_reads", "ratio"),
    [(1, 0, 1, 1), (2, 1, 1, 1), (4, 3, 1, 1), (2, 0, 1, 2), (1, 0, 2, 1), (1, 0, 4, 1)],
)
def test_remote_rows_equal_vllm_build_fa_remote(tp_ratio, factor, num_reads, ratio) -> None:
    """D_TP > P_TP (remote holds tp_ratio head slices, read slice `factor`), P_TP > D_TP
    (num_reads remotes each hold 1/num_reads of the local heads), block-size ratio."""
    L, bs_remote, local_heads, D, es = 3, 4, 4, 8, 2
    local = _packed(L, 10, bs_remote * ratio, local_heads, D, es, base=1 << 24)
    remote_heads = local_heads * tp_ratio // num_reads
    remote = _packed(L, 12, bs_remote, remote_heads, D, es, pad=16, base=1 << 30)
    pair = PairPlan(local, remote, remote_slice=HeadSlice(tp_ratio, factor),
                    local_slice=HeadSlice(num_reads, 0), block_size_ratio=ratio)

    w = seeded_worker([la.segments[0].length for la in local.layers], L)
    plan = TPMapping(
        source_ranks_per_group=(tuple(range(num_reads)),),
        all_source_ranks=tuple(range(num_reads)),
        rank_to_attention_slot={r: r for r in range(num_reads)},
        rank_offset_factor=factor,
    )
    meta = NixlAgentMetadata(
        engine_id="remote", agent_metadata=b"", device_id=0, num_blocks=12,
        kv_caches_base_addr=[la.base for la in remote.layers],
        block_lens=[la.segments[0].length for la in remote.layers],
        block_strides=[la.block_stride for la in remote.layers],
        kv_cache_layout="LBHNC", block_size=bs_remote, ssm_sizes=(0, 0),
        attn_backend_name="FLASH_ATTN", physical_blocks_per_logical_kv_block=1,
    )
    stock = w._build_fa_remote(plan, meta, ratio)
    assert np.array_equal(pair.remote_rows(), stock)


@pytest.mark.parametrize("ratio", [1, 2])
def test_desc_ids_equal_vllm_compute_desc_ids(ratio) -> None:
    L, n_local, n_remote = 4, 9, 20
    local = _packed(L, n_local, 4 * ratio, 2, 4, 2)
    remote = _packed(L, n_remote, 4, 2, 4, 2)
    pair = PairPlan(local, remote, block_size_ratio=ratio)
    lids = [7, 2, 5]
    rids = [19, 0, 3, 4, 11, 12][: len(lids) * ratio]
    w = seeded_worker([la.segments[0].length for la in local.layers], L)
    mapped_local = (np.asarray(lids)[:, None] * ratio + np.arange(ratio)).ravel()[: len(rids)]
    # 0.34 names the block list each region reads: pairs=(regions, keys), every region here
    # reading the one group's (base_worker.py L170-179, vllm_sites.REGIONS_PAIRED_BY_LAYER)
    group = {"pairs": (list(range(L)), [0] * L)} if \
        vllm_sites.running_release() in vllm_sites.REGIONS_PAIRED_BY_LAYER else {}
    stock_remote = w._compute_desc_ids([rids], n_remote, None, 1, **group)
    stock_local = w._compute_desc_ids([mapped_local.tolist()], n_local, ratio, 1, **group)
    ours_local, ours_remote = pair.desc_ids(lids, rids)
    assert np.array_equal(ours_remote, stock_remote)
    assert np.array_equal(ours_local, stock_local)
