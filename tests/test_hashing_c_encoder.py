"""The compiled block encoder (``pdpatch/hashing/_block_items.c``) on its own: cbor2's and
pickle's bytes for every int it covers, None for everything else (the Python paths then decide,
see ``test_hashing_encoders.py``, which runs every chain test with and without it).

The test setup builds pdpatch with ``PDPATCH_REQUIRE_C_ENCODER=1``, so the encoder must be here.
"""

from __future__ import annotations

import pickle

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpatch.hashing import encoders
from pdpatch.hashing.encoders import cbor_head

BOUNDARIES = sorted({b + d for b in (0, 23, 24, 255, 256, 65535, 65536, 2**31, 2**32 - 1,
                                     2**32, 2**63 - 1) for d in (-1, 0, 1) if 0 <= b + d < 2**63})
PICKLE_BOUNDARIES = sorted({b + d for b in (-(2**31), -1, 0, 255, 256, 65535, 65536, 2**31 - 1)
                            for d in (-1, 0, 1) if -(2**31) <= b + d < 2**31})
pickle_token = st.one_of(st.integers(0, 255), st.integers(256, 65535),
                         st.integers(65536, 2**31 - 1), st.integers(-(2**31), -1),
                         st.sampled_from(PICKLE_BOUNDARIES))
token = st.one_of(st.integers(0, 23), st.integers(24, 255), st.integers(256, 65535),
                  st.integers(65536, 2**32 - 1), st.integers(2**32, 2**63 - 1),
                  st.sampled_from(BOUNDARIES))


def cbor_items():
    assert encoders.C_ENCODER, "pdpatch was installed without its compiled block encoder"
    return encoders._compiled.cbor_items


def pickle_items():
    assert encoders.C_ENCODER, "pdpatch was installed without its compiled block encoder"
    return encoders._compiled.pickle_items


def pickled_items(block: tuple) -> bytes:
    """The items of ``block`` in ``pickle.dumps(block, 5)``: between the PROTO/FRAME header
    and MARK, and the closing TUPLE (or TUPLE1-3), MEMOIZE, STOP."""
    data = pickle.dumps(block, protocol=5)
    start = 2 + 9 + (1 if len(block) > 3 else 0)     # PROTO 5, FRAME <8 bytes>, MARK
    return data[start:len(data) - 3]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(bs=st.integers(1, 80), nblocks=st.integers(0, 5), data=st.data())
def test_block_items_are_cbor2s_bytes(bs: int, nblocks: int, data) -> None:
    tokens = data.draw(st.lists(token, min_size=bs * nblocks, max_size=bs * nblocks + 3))
    expected = [cbor2.dumps(tuple(tokens[i * bs:(i + 1) * bs]), canonical=True)
                [len(cbor_head(4, bs)):] for i in range(nblocks)]
    assert cbor_items()(tokens, nblocks, bs) == expected
    assert cbor_items()(tuple(tokens), nblocks, bs) == expected


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
@given(bs=st.integers(1, 80), nblocks=st.integers(0, 5), data=st.data())
def test_pickle_items_are_picklers_bytes(bs: int, nblocks: int, data) -> None:
    tokens = data.draw(st.lists(pickle_token, min_size=bs * nblocks, max_size=bs * nblocks + 3))
    expected = [pickled_items(tuple(tokens[i * bs:(i + 1) * bs])) for i in range(nblocks)]
    assert pickle_items()(tokens, nblocks, bs) == expected
    assert pickle_items()(tuple(tokens), nblocks, bs) == expected


class _Id(int):
    """An int subclass: serializers may encode it unlike an int."""


EITHER_BAD = [True, False, 1.0, "7", _Id(5), None, np.int64(4), 2**64]


@pytest.mark.parametrize(("encode", "bad"), [
    *[(cbor_items, b) for b in [*EITHER_BAD, -1, 2**63]],
    *[(pickle_items, b) for b in [*EITHER_BAD, 2**31, -(2**31) - 1]],
])
def test_items_leave_everything_else_to_python(encode, bad) -> None:
    assert encode()([5, 300, 70000, bad, 8, 9], 2, 3) is None
    assert encode()([5, 300, 70000, 8, 9, 10, bad], 2, 3) is not None   # past the blocks


@pytest.mark.parametrize("encode", [cbor_items, pickle_items])
def test_items_take_lists_and_tuples_only(encode) -> None:
    assert encode()(iter([1, 2]), 1, 2) is None
    assert encode()(np.array([1, 2]), 1, 2) is None
    assert encode()([], 0, 16) == []
    assert cbor_items()([1, 2, 3], 1, 2) == [b"\x01\x02"]
    assert pickle_items()([1, 2, 3], 1, 2) == [b"K\x01K\x02"]


@pytest.mark.parametrize("encode", [cbor_items, pickle_items])
@pytest.mark.parametrize(("tokens", "count", "bs"), [([1, 2, 3], 2, 2), ([1, 2], 1, 0),
                                                     ([1, 2], -1, 1)])
def test_items_refuse_impossible_requests(encode, tokens, count, bs) -> None:
    with pytest.raises(ValueError):
        encode()(tokens, count, bs)


def _first_non_id_reference(tokens: list) -> int:
    for i, t in enumerate(tokens):
        if type(t) is not int or not 0 <= t < 2**64:
            return i
    return -1


any_item = st.one_of(token, st.integers(-(2**70), 2**70), st.sampled_from(
    [*EITHER_BAD, -1, 2**63, 2**64 - 1, 2**60 - 1, 2**60, -(2**60), 2**30, -(2**30)]))


@settings(max_examples=300, deadline=None)
@given(st.lists(any_item, max_size=12))
def test_first_non_id_is_the_input_check(tokens) -> None:
    """The C loop of pdpatch.hashing.inputs.token_ids: the first item that is not an exact int
    in [0, 2**64), whatever its width."""
    assert encoders.C_ENCODER
    first = encoders._compiled.first_non_id
    assert first(tokens) == first(tuple(tokens)) == _first_non_id_reference(tokens)
    with pytest.raises(TypeError):
        first(iter(tokens))
