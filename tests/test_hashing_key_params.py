"""P/D block-key agreement: params P sends, D's bounded parser, the mismatch causes."""

from __future__ import annotations

import contextlib
import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpatch.hashing import (
    BlockKeyHasher,
    KeyConfig,
    LoraSpec,
    MMItem,
    PeerParamsError,
    PromptEmbeds,
)
from pdpatch.hashing.key_params import (
    Limits,
    build_params,
    compare,
    parse_params,
    parse_params_json,
)

PROMPT = [(i * 7919) % 150000 for i in range(100)]
BASE = dict(algo="sha256_cbor", hash_block_size=16, vllm_version="0.33.0", pythonhashseed="0",
            lora=LoraSpec("ad", "/adapters/ad"), cache_salt="tenant",
            mm=[MMItem("img", 4, 20)])


CONFIG_FIELDS = ("vllm_version", "algo", "hash_block_size", "pythonhashseed")


def hasher(**over) -> BlockKeyHasher:
    kw = {**BASE, **over}
    config = KeyConfig(**{k: kw.pop(k) for k in CONFIG_FIELDS})
    return BlockKeyHasher(config, kw.pop("prompt", PROMPT), **kw)


def roundtrip(h: BlockKeyHasher, **kw):
    """What D receives: P's params through JSON (as kv_transfer_params travel)."""
    return parse_params(json.loads(json.dumps(build_params(h, **kw))))


def test_match_returns_no_cause() -> None:
    assert compare(hasher(), roundtrip(hasher())) == []
    assert compare(hasher(), roundtrip(hasher(), include_keys=10)) == []


def test_params_are_small_and_hex() -> None:
    long = hasher(prompt=list(range(32768)))
    text = json.dumps(build_params(long))
    assert len(text) < 800  # O(1) in the prompt length
    with_keys = build_params(hasher(), include_keys=10)
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in with_keys["keys"])
    assert "keys" not in build_params(long, include_keys=10)  # 2048 keys > 10


@pytest.mark.parametrize(("over", "causes"), [
    (dict(pythonhashseed="1"), ["seed"]),
    (dict(pythonhashseed=None), ["seed"]),  # 0.29+ default seed vs PYTHONHASHSEED=0
    (dict(algo="sha256"), ["algo"]),
    (dict(hash_block_size=32), ["hash_block_size"]),
    (dict(prompt=[*PROMPT[:50], 1, *PROMPT[51:]]), ["prompt"]),
    (dict(prompt=PROMPT + [5] * 16), ["prompt"]),
    (dict(lora=LoraSpec("ad", "/other/path")), ["lora"]),
    (dict(lora=None), ["lora"]),
    (dict(cache_salt="other"), ["cache_salt"]),
    (dict(mm=[MMItem("img", 5, 20)]), ["mm"]),
    (dict(vllm_version="0.30.0"), ["key_format"]),
    (dict(vllm_version="0.30.0", mm=[MMItem("img", 5, 20)]), ["key_format", "mm"]),
    (dict(pythonhashseed="1", cache_salt=None), ["seed", "cache_salt"]),
])
def test_each_mismatch_cause(over, causes) -> None:
    d_side = hasher()
    p_side = hasher(**over)
    assert compare(d_side, roundtrip(p_side)) == causes
    assert compare(p_side, roundtrip(d_side)) == causes


def test_lora_path_only_matters_where_vllm_hashes_it() -> None:
    old = dict(vllm_version="0.30.0")
    assert compare(hasher(**old), roundtrip(hasher(lora=LoraSpec("ad", "/x"), **old))) == []


def test_prompt_embeds_cause() -> None:
    pe1 = PromptEmbeds(bytes(range(200)), 2)
    pe2 = PromptEmbeds(bytes(reversed(range(200))), 2)
    kw = dict(prompt=[0] * 100, mm=[], lora=None, cache_salt=None)
    assert compare(hasher(prompt_embeds=pe1, **kw),
                   roundtrip(hasher(prompt_embeds=pe2, **kw))) == ["prompt_embeds"]


def test_pickle_protocol_cause() -> None:
    p = build_params(hasher(algo="sha256"))
    p["fp"]["pp"] = 4  # a peer on an interpreter whose HIGHEST_PROTOCOL differs
    p["kd"] = "0" * 32
    assert compare(hasher(algo="sha256"), parse_params(p)) == ["pickle_protocol"]


def test_unexplained_difference_is_reported_as_keys() -> None:
    p = build_params(hasher())
    p["kd"] = "f" * 32
    assert compare(hasher(), parse_params(p)) == ["keys"]


def _digests_only(h: BlockKeyHasher, **over) -> dict:
    """What P sends for a long prompt: no key chain, the input digests stand for it."""
    from pdpatch.hashing.fingerprint import fingerprint_of
    from pdpatch.hashing.key_params import digest_params, request_summary

    return {**json.loads(json.dumps(digest_params(fingerprint_of(h).to_dict(), len(h.keys),
                                                  request_summary(h)))), **over}


def test_digests_only_compare_as_the_keys() -> None:
    theirs = parse_params(_digests_only(hasher()))
    assert theirs.keys_digest is None and theirs.keys is None
    assert compare(hasher(), theirs) == []
    assert compare(hasher(cache_salt="other"), theirs) == ["cache_salt"]
    assert compare(hasher(pythonhashseed="1"), theirs) == ["seed"]
    assert compare(hasher(prompt=PROMPT[:-1]), theirs) == ["prompt"]   # the partial block
    assert compare(hasher(), parse_params(_digests_only(hasher(), n=7))) == ["keys"]


def test_keys_without_their_digest_are_rejected() -> None:
    with pytest.raises(PeerParamsError, match="'kd'"):
        parse_params(_digests_only(hasher(), keys=_good()["keys"]))


def _good() -> dict:
    return json.loads(json.dumps(build_params(hasher(), include_keys=8)))


def _set(path: str, value):
    def mutate(d: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            d = d[p]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
    return mutate


@pytest.mark.parametrize("mutate", [
    _set("v", 1), _set("v", True), _set("v", KeyError), _set("efp", "x"),
    _set("fp", "x"), _set("fp.algo", "md5"), _set("fp.algo", KeyError),
    _set("fp.hbs", 0), _set("fp.hbs", True), _set("fp.hbs", 1.0), _set("fp.hbs", 2**40),
    _set("fp.nh", "XYZ"), _set("fp.nh", "ABCDEF0123456789"), _set("fp.nh", "0" * 17),
    _set("fp.seed", "urandom"), _set("fp.kf", "9.9"), _set("fp.vllm", "__import__('os')"),
    _set("fp.vllm", "1" * 100), _set("fp.pp", -1), _set("fp.la", 1000),
    _set("n", -1), _set("n", "6"), _set("n", 2**40), _set("kd", "g" * 32), _set("kd", None),
    _set("keys", ["00"] * 6), _set("keys", "deadbeef"), _set("keys", [1, 2, 3, 4, 5, 6]),
    _set("keys", ["0" * 64] * 6),  # well-formed but not matching kd
    _set("x", None), _set("x.nt", -5), _set("x.td", "0" * 31), _set("x.ld", 5),
    _set("x.md", ["0" * 32]),
])
def test_malformed_params_are_rejected(mutate) -> None:
    d = _good()
    mutate(d)
    with pytest.raises(PeerParamsError):
        parse_params(d)


def test_not_a_dict_and_too_many_fields() -> None:
    for bad in (None, [], "x", 5, {1: 2}, {f"k{i}": i for i in range(100)}):
        with pytest.raises(PeerParamsError):
            parse_params(bad)


def test_keys_limit() -> None:
    d = json.loads(json.dumps(build_params(hasher(), include_keys=100)))
    parse_params(d)
    with pytest.raises(PeerParamsError, match="keys"):
        parse_params(d, Limits(max_keys=3))


def test_json_entry_point_bounds() -> None:
    good = json.dumps(_good())
    assert parse_params_json(good).num_blocks == 6
    with pytest.raises(PeerParamsError, match="larger"):
        parse_params_json(good + " " * 70000)
    with pytest.raises(PeerParamsError, match="not JSON"):
        parse_params_json("{'v': 1}")
    with pytest.raises(PeerParamsError):
        parse_params_json("[" * 50000 + "]" * 50000, Limits(max_json_bytes=200000))
    with pytest.raises(PeerParamsError):
        parse_params_json(json.dumps({**_good(), "n": math.inf}).replace("Infinity", "1e999"))


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=70),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=5), kids,
                                                              max_size=5),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(json_value)
def test_parser_fuzz_never_raises_anything_else(obj) -> None:
    with contextlib.suppress(PeerParamsError):  # anything else fails the test
        parse_params(obj)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["v", "fp", "n", "kd", "keys", "x"]), json_value)
def test_parser_fuzz_one_field(field, value) -> None:
    d = copy.deepcopy(_good())
    d[field] = value
    with contextlib.suppress(PeerParamsError):
        parse_params(d)
