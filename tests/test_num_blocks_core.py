"""Pure block-count core: block dimension, reconciliation decisions, byte extents."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpatch import block_counts as bc
from pdpatch.block_counts import LayerBlocks


@pytest.mark.parametrize(("shape", "dim"), [
    ((2, 100, 16, 8, 64), 1),      # FlashAttention <= 0.22, K/V outermost
    ((100, 2, 16, 8, 64), 0),      # FlashInfer / FA 0.23-0.25 blocks-first
    ((100, 8, 16, 128), 0),        # packed K|V, >= 0.26
    ((100, 16, 576), 0),           # MLA
    ((2, 2, 16, 8, 64), 0),        # degenerate: two blocks either way
])
def test_block_dim(shape, dim):
    assert bc.block_dim(shape) == dim


def layers(*counts):
    return [LayerBlocks(f"l{i}", 0, c) for i, c in enumerate(counts)]


def test_slice_mode_narrows_only_over_allocated_layers():
    rec = bc.reconcile(layers(30, 12, 40), 12)
    assert rec.target == 12
    assert dict(rec.actions) == {"l0": "slice", "l1": "keep", "l2": "slice"}
    assert [lb.name for lb in rec.over_allocated] == ["l0", "l2"]
    assert rec.changed
    assert "2 of 3 KV tensors hold 30..40 blocks; sliced to the planned 12" in rec.describe()


def test_exact_allocation_changes_nothing():
    rec = bc.reconcile(layers(12, 12), 12)
    assert not rec.changed
    assert rec.describe() == "all 2 KV tensors hold the planned 12 blocks"


def test_under_allocation_is_an_error_naming_the_layer_and_the_plan():
    with pytest.raises(bc.UnderAllocatedError) as err:
        bc.reconcile(layers(30, 7), 12, context=" (engine E)")
    msg = str(err.value)
    assert "layer 'l1' has 7 (dim 0), the plan is 12 (engine E)" in msg
    assert "block ids up to 11" in msg


def test_under_allocation_is_an_error_in_virtual_mode_too():
    with pytest.raises(bc.UnderAllocatedError):
        bc.reconcile(layers(30, 7), 12, bc.MODE_VIRTUAL)


def test_virtual_mode_needs_one_count():
    rec = bc.reconcile(layers(30, 30), 12, bc.MODE_VIRTUAL)
    assert rec.target == 30 and set(rec.actions.values()) == {"virtual"}
    with pytest.raises(bc.InconsistentBlocksError, match=r"\[30, 31\]"):
        bc.reconcile(layers(30, 31), 12, bc.MODE_VIRTUAL)


def test_bad_mode_and_bad_plan():
    with pytest.raises(ValueError, match="unknown block-count mode"):
        bc.reconcile(layers(3), 3, "grow")
    with pytest.raises(bc.BlockCountError, match="positive"):
        bc.reconcile(layers(3), 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(shape),
                            st.lists(st.integers(0, 7), min_size=len(shape), max_size=len(shape)),
                            st.integers(0, 9))))
def test_byte_extent_matches_torch(case):
    shape, stride, offset = case
    n = offset + sum((a - 1) * s for a, s in zip(shape, stride, strict=True)) + 1
    base = torch.zeros(n + 3, dtype=torch.float16)
    view = base.as_strided(shape, stride, offset)
    lo, hi = bc.byte_extent(offset, shape, stride, 2)
    # every element's bytes lie in [lo, hi), and the first and last touched bytes are the bounds
    idx = torch.arange(base.numel()).as_strided(shape, stride, offset)
    assert lo == int(idx.min()) * 2 and hi == (int(idx.max()) + 1) * 2
    assert view.data_ptr() - base.data_ptr() >= lo


def test_byte_extent_of_an_empty_view():
    assert bc.byte_extent(4, (0, 3), (3, 1), 2) == (8, 8)


def test_merge_and_covering_range():
    assert bc.merge([(10, 20), (0, 5), (5, 8), (19, 30), (40, 40)]) == [(0, 8), (10, 30)]
    assert bc.covering_range([(0, 4), (4, 8), (2, 6)]) == (0, 8)
    assert bc.covering_range([(0, 4), (6, 8)]) is None
