"""The fast encoders write exactly what cbor2 / pickle write (hypothesis, every int width).

``fast_chain`` is only allowed to exist because of these tests: it must equal
``reference_chain`` (the real serializers per block, i.e. vLLM's formula) byte for byte, and
must step aside (return None) for whatever it does not cover.  Every test runs twice: with the
compiled block encoder (``_block_items.c``) and with the pure-Python stream alone.
"""

from __future__ import annotations

import pickle

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdpatch.hashing import encoders
from pdpatch.hashing.algorithms import ALGORITHMS, get_algorithm
from pdpatch.hashing.encoders import (
    block_token_encodings,
    cbor_head,
    cbor_uint,
    chain,
    fast_chain,
    reference_chain,
)

BOUNDARIES = sorted({b + d for b in (0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31,
                                     2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1)
                     for d in (-1, 0, 1) if 0 <= b + d < 2**64})
# ids every fast path covers: CBOR up to 2**64-1, pickle's BININT up to 2**31-1
plain_token = st.one_of(st.integers(0, 23), st.integers(24, 255), st.integers(256, 65535),
                        st.integers(65536, 2**31 - 1),
                        st.sampled_from([b for b in BOUNDARIES if b < 2**31]))
any_token = st.one_of(plain_token, st.integers(2**31, 2**64 - 1), st.sampled_from(BOUNDARIES),
                      st.integers(-(2**40), -1), st.integers(2**64, 2**80),
                      st.integers(-(2**31), -1))
text = st.text(max_size=12)
extra_key = st.one_of(
    st.tuples(st.just("lora"), text, text),
    st.tuples(st.just("mm"), text, st.integers(-300, 300)),
    st.tuples(st.just("cache_salt"), text),
    st.tuples(st.just("prompt_embeds"), st.binary(min_size=32, max_size=32)),
    text, st.integers(0, 2**40), st.tuples(text, st.integers(-50, 50)),
    st.binary(max_size=2),  # b"" and 1-byte bytes are CPython singletons (pickle memo)
)
extras_value = st.one_of(st.none(), st.lists(extra_key, min_size=1, max_size=4).map(tuple))



@pytest.fixture(autouse=True, params=["compiled", "pure-python"])
def encoder(request, monkeypatch) -> str:
    """The test setup builds the C encoder (PDPATCH_REQUIRE_C_ENCODER=1): both paths run."""
    if request.param == "pure-python":
        monkeypatch.setattr(encoders, "_compiled", None)
    else:
        assert encoders.C_ENCODER, "pdpatch was installed without its compiled block encoder"
    return request.param


SLOW = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("value", BOUNDARIES)
def test_cbor_uint_boundaries(value: int) -> None:
    assert cbor_uint(value) == cbor2.dumps(value, canonical=True)


@given(st.integers(0, 2**64 - 1))
def test_cbor_uint_random(value: int) -> None:
    assert cbor_uint(value) == cbor2.dumps(value, canonical=True)


@given(st.one_of(st.integers(0, 70000), st.sampled_from([b for b in BOUNDARIES if b < 70000])))
def test_cbor_heads(n: int) -> None:
    """Byte-string and array headers (parent hash, token array) as cbor2 writes them."""
    assert cbor_head(2, n) == cbor2.dumps(b"\0" * n, canonical=True)[:-n or None]
    assert cbor_head(4, n) == cbor2.dumps((0,) * n, canonical=True)[:-n or None]


@SLOW
@given(cbor=st.booleans(), bs=st.integers(1, 80), nblocks=st.integers(1, 5), data=st.data())
def test_block_token_encodings_are_the_serializers_bytes(cbor, bs, nblocks, data) -> None:
    """Each block's cut of the one-call stream equals the serializer's bytes for that block's
    tuple alone (CBOR array / pickle MARK..TUPLE framing stripped)."""
    tokens = data.draw(st.lists(plain_token if not cbor else
                                st.one_of(plain_token, st.integers(2**31, 2**64 - 1)),
                                min_size=bs * nblocks, max_size=bs * nblocks))
    blocks = block_token_encodings(tokens, nblocks, bs, cbor)
    if not cbor and bs * nblocks < 4 and encoders._compiled is None:
        assert blocks is None       # the one-call stream needs MARK..TUPLE framing
        return
    assert blocks is not None
    for i, got in enumerate(blocks):
        block = tuple(tokens[i * bs:(i + 1) * bs])
        if cbor:
            assert cbor_head(4, bs) + got == cbor2.dumps(block, canonical=True)
        else:  # protocol 2 is what the stream uses; its int opcodes are protocol 5's
            framing = (b"(", b"t") if bs >= 4 else (b"", {1: b"\x85", 2: b"\x86", 3: b"\x87"}[bs])
            assert pickle.dumps(block, protocol=2) == \
                b"\x80\x02" + framing[0] + got + framing[1] + b"q\x00."


@pytest.mark.parametrize(("cbor", "bad"), [
    *[(True, b) for b in (-1, 2**64, True, 1.0, "7")],
    *[(False, b) for b in (2**31, -(2**31) - 1, True, 1.0, "7")],  # LONG1, NEWTRUE, BINFLOAT..
])
def test_block_token_encodings_refuse_what_they_do_not_cover(cbor: bool, bad) -> None:
    tokens = [5, 300, 70000, bad, 8, 9, 10, 11]
    assert block_token_encodings(tokens, 2, 4, cbor) is None


def test_pickle_stream_covers_negative_int32() -> None:
    """BININT is signed: -1 is 'J ff ff ff ff' in the real payload too."""
    assert block_token_encodings([5, -1, 7, 8], 1, 4, False) == [
        b"K\x05J\xff\xff\xff\xffK\x07K\x08"]


def _run_both(algo: str, parent: bytes, tokens: list[int], bs: int, extras: list) -> None:
    a = get_algorithm(algo)
    ref = reference_chain(a, parent, tokens, bs, extras)
    fast = fast_chain(a, parent, tokens, bs, extras)
    if fast is not None:
        assert fast == ref
    assert chain(a, parent, tokens, bs, extras) == ref


@SLOW
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 40), nblocks=st.integers(0, 6),
       data=st.data())
def test_fast_chain_equals_real_serializers(algo: str, bs: int, nblocks: int, data) -> None:
    tokens = data.draw(st.lists(plain_token, min_size=bs * nblocks, max_size=bs * nblocks))
    extras = data.draw(st.lists(extras_value, min_size=nblocks, max_size=nblocks))
    parent = data.draw(st.sampled_from([get_algorithm(algo).hash_object("0"), b"\x01" * 32,
                                        b"\x02" * 16, b"x"]))
    a = get_algorithm(algo)
    fast = fast_chain(a, parent, tokens, bs, extras)
    if (encoders.FAST_PICKLE or algo.endswith("_cbor")) and nblocks and \
            (algo.endswith("_cbor") or bs * nblocks >= 4 or encoders._compiled is not None):
        assert fast is not None, "every token is plain: the fast path must apply"
    _run_both(algo, parent, tokens, bs, extras)


@SLOW
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 20), nblocks=st.integers(1, 4),
       data=st.data())
def test_any_int_tokens_fall_back_correctly(algo: str, bs: int, nblocks: int, data) -> None:
    """Ids the streams do not cover (negative, LONG1, bignums) give the reference bytes."""
    tokens = data.draw(st.lists(any_token, min_size=bs * nblocks, max_size=bs * nblocks))
    extras = data.draw(st.lists(extras_value, min_size=nblocks, max_size=nblocks))
    _run_both(algo, b"\x07" * 16, tokens, bs, extras)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_pickle_identity_memo_in_extras(algo: str) -> None:
    """pickle memoizes by identity: a shared identifier object is a BINGET, two equal but
    distinct strings are not; the fast path must keep that difference."""
    ident = "".join(["img-", "shared"])
    other = "".join(["img-", "shared"])
    assert ident == other and ident is not other
    shared = (("mm", ident, 0), ("mm", ident, 5))
    distinct = (("mm", ident, 0), ("mm", other, 5))
    a = get_algorithm(algo)
    toks = list(range(100, 132))
    same = chain(a, b"\x01" * 16, toks, 16, [shared, shared])
    diff = chain(a, b"\x01" * 16, toks, 16, [distinct, distinct])
    assert same == reference_chain(a, b"\x01" * 16, toks, 16, [shared, shared])
    assert diff == reference_chain(a, b"\x01" * 16, toks, 16, [distinct, distinct])
    if algo.endswith("_cbor"):
        assert same == diff  # CBOR has no identity memo
    else:
        assert same != diff
        assert pickle.dumps(shared, 5) != pickle.dumps(distinct, 5)


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_numpy_and_bool_tokens_are_their_int_values(algo: str) -> None:
    np = pytest.importorskip("numpy")
    a = get_algorithm(algo)
    plain = [1, 0, 300, 70000, 5, 6]
    expected = reference_chain(a, b"p" * 32, plain, 2, [None] * 3)
    assert chain(a, b"p" * 32, list(np.array(plain, dtype=np.int64)), 2, [None] * 3) == expected
    assert chain(a, b"p" * 32, [True, False, 300, 70000, 5, 6], 2, [None] * 3) == expected


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_non_integer_tokens_are_rejected(algo: str) -> None:
    a = get_algorithm(algo)
    with pytest.raises(TypeError):
        chain(a, b"p" * 32, [1, 2.5, 3, 4], 2, [None, None])
    with pytest.raises(TypeError):
        chain(a, b"p" * 32, ["1", 2, 3, 4], 2, [None, None])


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_pickle_payload_near_frame_size_takes_reference_path(algo: str) -> None:
    """The C pickler splits frames at 64 KiB: the fast path must not try to imitate that."""
    a = get_algorithm(algo)
    bs = 14000  # 14000 BININT tokens = 70 kB
    toks = [70000 + i for i in range(bs)]
    assert fast_chain(a, b"\x01" * 16, toks, bs, [None]) is None
    assert chain(a, b"\x01" * 16, toks, bs, [None]) == \
        reference_chain(a, b"\x01" * 16, toks, bs, [None])
    big_extra = (b"\x00" * 70000,)  # vLLM 0.12-0.16 put raw prompt-embeds bytes here
    assert chain(a, b"\x01" * 16, [1, 2], 2, [big_extra]) == \
        reference_chain(a, b"\x01" * 16, [1, 2], 2, [big_extra])


@settings(max_examples=60, deadline=None)
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 12), nblocks=st.integers(1, 4),
       tail=st.lists(any_token, max_size=11), data=st.data())
def test_tokens_past_the_last_full_block_are_ignored(algo, bs, nblocks, tail, data) -> None:
    tokens = data.draw(st.lists(plain_token, min_size=bs * nblocks, max_size=bs * nblocks))
    extras = [None] * nblocks
    a = get_algorithm(algo)
    expected = reference_chain(a, b"\x05" * 32, tokens, bs, extras)
    assert chain(a, b"\x05" * 32, tokens + tail[:bs - 1], bs, extras) == expected
