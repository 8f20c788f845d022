"""The compiled CBOR block encoder (``pdpatch/hashing/_cbor_blocks.c``) on its own: cbor2's
bytes for every width it covers, None for everything else (the Python paths then decide, see
``test_hashing_encoders.py``, which runs every chain test with and without it).

The test setup builds pdpatch with ``PDPATCH_REQUIRE_C_ENCODER=1``, so the encoder must be here.
"""

from __future__ import annotations

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpatch.hashing import encoders
from pdpatch.hashing.encoders import cbor_head

BOUNDARIES = sorted({b + d for b in (0, 23, 24, 255, 256, 65535, 65536, 2**31, 2**32 - 1,
                                     2**32, 2**63 - 1) for d in (-1, 0, 1) if 0 <= b + d < 2**63})
token = st.one_of(st.integers(0, 23), st.integers(24, 255), st.integers(256, 65535),
                  st.integers(65536, 2**32 - 1), st.integers(2**32, 2**63 - 1),
                  st.sampled_from(BOUNDARIES))


def block_items():
    assert encoders.C_ENCODER, "pdpatch was installed without its compiled CBOR encoder"
    return encoders._c_block_items


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(bs=st.integers(1, 80), nblocks=st.integers(0, 5), data=st.data())
def test_block_items_are_cbor2s_bytes(bs: int, nblocks: int, data) -> None:
    tokens = data.draw(st.lists(token, min_size=bs * nblocks, max_size=bs * nblocks + 3))
    expected = [cbor2.dumps(tuple(tokens[i * bs:(i + 1) * bs]), canonical=True)
                [len(cbor_head(4, bs)):] for i in range(nblocks)]
    assert block_items()(tokens, nblocks, bs) == expected
    assert block_items()(tuple(tokens), nblocks, bs) == expected


class _Id(int):
    """An int subclass: serializers may encode it unlike an int."""


@pytest.mark.parametrize("bad", [True, False, -1, 2**63, 2**64, 1.0, "7", _Id(5), None,
                                 np.int64(4)])
def test_block_items_leave_everything_else_to_python(bad) -> None:
    assert block_items()([5, 300, 70000, bad, 8, 9], 2, 3) is None
    assert block_items()([5, 300, 70000, 8, 9, 10, bad], 2, 3) is not None  # past the blocks


def test_block_items_take_lists_and_tuples_only() -> None:
    assert block_items()(iter([1, 2]), 1, 2) is None
    assert block_items()(np.array([1, 2]), 1, 2) is None
    assert block_items()([1, 2, 3], 1, 2) == [b"\x01\x02"]
    assert block_items()([], 0, 16) == []


@pytest.mark.parametrize(("tokens", "count", "bs"), [([1, 2, 3], 2, 2), ([1, 2], 1, 0),
                                                     ([1, 2], -1, 1)])
def test_block_items_refuse_impossible_requests(tokens, count, bs) -> None:
    with pytest.raises(ValueError):
        block_items()(tokens, count, bs)
