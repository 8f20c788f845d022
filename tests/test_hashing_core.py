"""pdpatch.hashing without vLLM: release rules, seeds, errors, incremental hashing, helpers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpatch.hashing import (
    ALGORITHMS,
    BlockKeyHasher,
    HashingError,
    InputError,
    KeyConfig,
    KeyConfigError,
    LoraSpec,
    MMItem,
    PromptEmbeds,
    UnreproducibleSeedError,
    XxhashUnavailableError,
    block_keys,
    coarse_keys,
    fingerprint_of,
    format_for,
    get_algorithm,
    to_event_int,
    with_group_id,
)
from pdpatch.hashing.formats import KEY_FORMATS

T = [1, 23, 24, 255, 256, 65535, 65536, 128000, 151643, 0, 7, 42, 1000, 2000, 30000, 100000,
     *range(500, 516), 9, 8, 7, 6, 5, 4, 3, 2]


def cfg(**over) -> KeyConfig:
    """A server configuration: vLLM 0.33.0, sha256, 16, PYTHONHASHSEED=0 unless overridden."""
    return KeyConfig(**{"vllm_version": "0.33.0", "algo": "sha256", "hash_block_size": 16,
                        "pythonhashseed": "0", **over})


@pytest.mark.parametrize(("release", "era"), [
    ("0.10.2", "0.10.2"), ("0.11.0", "0.10.2"), ("0.11.1", "0.11.1"), ("0.12.0", "0.11.1"),
    ("0.16.1", "0.11.1"),
    ("0.17.0", "0.17"), ("0.18.0", "0.17"), ("0.19.0", "0.19"), ("0.30.0", "0.19"),
    ("0.31.0", "0.31"), ("0.33.0", "0.31"), ("0.34.0", "0.31")])
def test_key_format_eras(release: str, era: str) -> None:
    assert format_for(release).key_format == era
    assert era in KEY_FORMATS


@pytest.mark.parametrize("spelling", ["0.33.0", "0.33", "v0.33.0", "0.33.0+cpu", "0.33.0rc1"])
def test_release_spellings(spelling: str) -> None:
    assert format_for(spelling).release == "0.33.0"


def test_release_rules_change_where_the_wheels_changed() -> None:
    f = format_for
    assert "xxhash" not in f("0.12.0").algorithms and "xxhash" in f("0.13.0").algorithms
    assert (f("0.23.0").coarse_view, f("0.24.0").coarse_view) == ("concat", "last")
    assert not f("0.28.0").default_seed_for_crypto and f("0.29.0").default_seed_for_crypto
    assert (f("0.30.0").mm_resume, f("0.31.0").mm_resume) == ("last_item", "window")
    assert not f("0.32.0").lookahead and f("0.33.0").lookahead
    assert (f("0.33.0").max_token_id, f("0.34.0").max_token_id) == (2**64 - 1, 2**31 - 1)
    assert not f("0.18.0").mm_strict_bounds and f("0.19.0").mm_strict_bounds


def test_integer_era_and_garbage_versions_are_refused() -> None:
    with pytest.raises(HashingError, match="integers"):
        format_for("0.10.1.1")
    with pytest.raises(HashingError, match="not a vLLM version"):
        format_for("latest")


def test_newer_release_uses_latest_rules_unverified(caplog) -> None:
    fmt = format_for("0.35.2")
    assert not fmt.verified and fmt.key_format == "0.31" and fmt.lookahead


def test_ids_past_the_releases_int32_are_refused() -> None:
    """0.34 holds token ids as int32: no 0.34 server has a key for a larger id (0.33 does)."""
    big = [5, 2**31]
    assert len(BlockKeyHasher(cfg(hash_block_size=2), big).keys) == 1
    with pytest.raises(InputError, match=r"token id #1 is 2147483648: vLLM 0.34.0 .* int32"):
        BlockKeyHasher(cfg(vllm_version="0.34.0", hash_block_size=2), big)
    h = BlockKeyHasher(cfg(vllm_version="0.34.0", hash_block_size=2), [5, 2**31 - 1])
    with pytest.raises(InputError, match=r"token id #3 is"):
        h.extend([1, 2**40])
    assert len(h.tokens) == 2 and len(h.keys) == 1      # the refused append left no trace


def test_seed_is_the_exact_string() -> None:
    """'0' and '00' differ; '' and 'random' are seeds too (vLLM uses the raw env string)."""
    none_hashes = {s: BlockKeyHasher(cfg(algo="sha256_cbor", pythonhashseed=s)).none_hash
                   for s in ("0", "00", "", "random")}
    assert len(set(none_hashes.values())) == 4
    assert none_hashes["0"].hex() == \
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    assert BlockKeyHasher(cfg(algo="xxhash_cbor", pythonhashseed="random")).none_hash.hex() == \
        "32e23dc39776371d9f8b217365649b32"  # research note §5


@pytest.mark.parametrize(("algo", "release", "ok"), [
    ("sha256", "0.33.0", True), ("sha256_cbor", "0.29.0", True),
    ("sha256", "0.28.0", False), ("sha256_cbor", "0.12.0", False),
    ("xxhash", "0.33.0", False), ("xxhash_cbor", "0.29.0", False), ("xxhash", "0.20.0", False)])
def test_unset_seed(algo: str, release: str, ok: bool) -> None:
    if ok:
        h = BlockKeyHasher(cfg(algo=algo, vllm_version=release, pythonhashseed=None))
        assert h.seed is not None and h.seed.seed == "vllm-none-hash"
        assert h.seed.source == "default"
        return
    with pytest.raises(UnreproducibleSeedError) as e:
        BlockKeyHasher(cfg(algo=algo, vllm_version=release, pythonhashseed=None))
    msg = str(e.value)
    assert "not reproducible" in msg and "PYTHONHASHSEED identically on P and D" in msg


def test_xxhash_missing_error_says_vllm_does_not_depend_on_it() -> None:
    """Run in a child where ``import xxhash`` fails (the package hidden, not faked)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["xxhash"] = None  # makes `import xxhash` raise ImportError
        from pdpatch.hashing import HashingError, KeyConfig, XxhashUnavailableError, block_keys
        def cfg(algo):
            return KeyConfig(vllm_version="0.33.0", algo=algo, hash_block_size=2,
                             pythonhashseed="0")
        try:
            block_keys([1, 2], cfg("xxhash_cbor"))
        except XxhashUnavailableError as e:
            print("ERR", isinstance(e, HashingError), e)
        print("SHA", block_keys([1, 2], cfg("sha256"))[0].hex())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "ERR True" in out and "pip install xxhash" in out
    assert "vLLM itself does not depend on xxhash" in out
    assert "SHA " in out  # the sha256 algorithms need nothing extra
    assert issubclass(XxhashUnavailableError, ModuleNotFoundError)
    assert issubclass(XxhashUnavailableError, HashingError)


def test_unknown_algorithm_and_algorithm_not_in_release() -> None:
    with pytest.raises(HashingError, match="unknown block-hash algorithm"):
        get_algorithm("md5")
    with pytest.raises(KeyConfigError, match="has no 'xxhash_cbor'"):
        cfg(algo="xxhash_cbor", vllm_version="0.12.0")


def test_bad_configurations_are_key_config_errors() -> None:
    for over, needle in [
        (dict(hash_block_size=0), "hash_block_size"),
        (dict(hash_block_size=True), "hash_block_size"),
        (dict(hash_block_size=16.0), "hash_block_size"),
        (dict(lookahead=1, vllm_version="0.32.0"), "lookahead"),
        (dict(lookahead=-1), "lookahead"),
        (dict(pythonhashseed=0), "string"),
        (dict(none_hash=b""), "none_hash"),
        (dict(none_hash=b"\0" * 8), "16 or 32 bytes"),
        (dict(algo="md5"), "unknown block-hash algorithm"),
        (dict(algo=["sha256"]), "unknown block-hash algorithm"),
        (dict(vllm_version=33), "string like"),
        (dict(vllm_version="latest"), "not a vLLM version"),
    ]:
        with pytest.raises(KeyConfigError, match=needle):
            cfg(**over)


def test_every_setting_is_required() -> None:
    """No release, algorithm, block size or seed is assumed: each is the server's."""
    full = dict(vllm_version="0.33.0", algo="sha256", hash_block_size=16, pythonhashseed=None)
    for name in full:
        with pytest.raises(TypeError, match=name):
            KeyConfig(**{k: v for k, v in full.items() if k != name})
    with pytest.raises(TypeError):
        block_keys(T)  # type: ignore[call-arg]


def test_installed_release_is_the_one_rule(monkeypatch) -> None:
    from packaging.version import Version

    from pdpatch import versions

    monkeypatch.setattr(versions, "vllm_version", lambda: Version("0.30.0+cpu"))
    assert cfg(vllm_version="installed").vllm_version == "0.30.0"
    monkeypatch.setattr(versions, "vllm_version", lambda: None)
    with pytest.raises(KeyConfigError, match="no vLLM is installed"):
        cfg(vllm_version="installed")


def test_config_mapping_round_trip_and_errors() -> None:
    c = cfg(algo="xxhash_cbor", hash_block_size=32, pythonhashseed=None)
    assert KeyConfig.from_mapping(c.to_mapping()) == c
    for bad, needle in [
        ([], "an object"), ({}, "without vllm_version"),
        ({**c.to_mapping(), "block_size": 16}, "unknown"),
        ({k: v for k, v in c.to_mapping().items() if k != "pythonhashseed"}, "null/None"),
    ]:
        with pytest.raises(KeyConfigError, match=needle):
            KeyConfig.from_mapping(bad)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(prompt=[1, -1]), "token id #1 is -1"),
    (dict(prompt=[1, 2**64]), "2\\*\\*64"),
    (dict(prompt=[1, True]), "bool"),
    (dict(prompt=[1, 2.0]), "float"),
    (dict(prompt=["1"]), "str"),
    (dict(prompt="123"), "sequence of ints"),
    (dict(prompt=b"123"), "sequence of ints"),
    (dict(prompt=[0] * 8, mm=[("id", 0, 4)]), "MMItem"),
    (dict(prompt=[0] * 8, mm=MMItem("a", 0, 4)), "sequence of MMItem"),
    (dict(prompt=[0] * 8, mm=[MMItem("a", -1, 4)]), "offset"),
    (dict(prompt=[0] * 8, mm=[MMItem("a", 0, 0)]), "length"),
    (dict(prompt=[0] * 8, mm=[MMItem("", 0, 4)]), "identifier"),
    (dict(prompt=[0] * 8, mm=[MMItem(5, 0, 4)]), "identifier"),   # type: ignore[arg-type]
    (dict(prompt=[0] * 8, mm=[MMItem("a", 0, 4), MMItem("b", 3, 2)]), "overlap"),
    (dict(prompt=[0] * 8, mm=[MMItem("a", 4, 2), MMItem("b", 0, 2)]), "prompt order"),
    (dict(prompt=[0] * 8, mm=[MMItem("a", 4, 5)]), "past the prompt"),
    (dict(prompt=[0] * 8, mm=[MMItem("\ud800", 0, 4)]), "surrogate"),
    (dict(prompt=[0] * 8, cache_salt=5), "cache_salt"),
    (dict(prompt=[0] * 8, lora="a"), "LoraSpec"),
    (dict(prompt=[0] * 8, lora=LoraSpec("a")), "path"),                # 0.31+ hashes it
    (dict(prompt=[0] * 8, lora=LoraSpec("a", "")), "path"),
    (dict(prompt=[0] * 8, lora=LoraSpec("", "/a")), "name"),
    (dict(prompt=[0] * 8, lora=LoraSpec("a", "/a", 0)), "int_id"),
    (dict(prompt=[0] * 8, prompt_embeds=b"x"), "PromptEmbeds"),
    (dict(prompt=[0] * 8, prompt_embeds=PromptEmbeds(b"\0" * 4, 2)), "2 rows"),
])
def test_inputs_no_server_accepts_are_input_errors(kwargs, needle) -> None:
    with pytest.raises(InputError, match=needle):
        BlockKeyHasher(cfg(), **kwargs)


def test_inputs_by_release() -> None:
    """The LoRA field a release hashes is required there, and only there."""
    old = cfg(vllm_version="0.11.0")
    with pytest.raises(InputError, match="lora_int_id"):
        BlockKeyHasher(old, [1] * 16, lora=LoraSpec("a", "/a"))
    assert BlockKeyHasher(old, [1] * 16, lora=LoraSpec("a", int_id=2)).keys
    assert BlockKeyHasher(cfg(vllm_version="0.30.0"), [1] * 16, lora=LoraSpec("a")).keys


def test_plain_ids_and_int_likes() -> None:
    """numpy-style ints and ids up to 2**64-1 hash like the plain ints vLLM holds."""
    import numpy as np

    ids = [0, 5, 2**63, 2**64 - 1] * 4
    assert block_keys(np.array(ids, dtype=np.uint64).tolist(), cfg()) == \
        block_keys(ids, cfg())
    assert block_keys([np.int64(t) for t in ids[:2] * 8], cfg()) == \
        block_keys(ids[:2] * 8, cfg())
    assert block_keys(tuple(ids), cfg()) == block_keys(iter(ids), cfg()) == \
        block_keys(ids, cfg())
    with pytest.raises(InputError, match="token id #17"):
        BlockKeyHasher(cfg(), ids).extend([1, -1])


def test_prompt_embeds_data_checks() -> None:
    with pytest.raises(InputError, match="rows"):
        PromptEmbeds(b"\0" * 7, 2)
    with pytest.raises(InputError, match="rows"):
        PromptEmbeds(b"", 2)
    with pytest.raises(InputError, match="row_bytes"):
        PromptEmbeds(b"\0" * 4, 0)
    with pytest.raises(InputError, match="bytes"):
        PromptEmbeds([0, 0], 2)  # type: ignore[arg-type]
    import array

    floats = array.array("f", [1.0, 2.0, 3.0, 4.0])
    assert PromptEmbeds(memoryview(floats), 8).num_rows == 2  # a float view counts bytes


def test_full_blocks_only() -> None:
    assert len(block_keys(T, cfg())) == 2
    assert block_keys(T[:15], cfg()) == []
    assert len(block_keys(T, cfg(hash_block_size=1))) == 40


@settings(max_examples=60, deadline=None)
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 20),
       tokens=st.lists(st.integers(0, 300000), max_size=120),
       cuts=st.lists(st.integers(0, 120), max_size=6),
       release=st.sampled_from(["0.31.0", "0.33.0", "0.24.0", "0.13.0"]),
       salt=st.none() | st.text(max_size=4), with_lora=st.booleans())
def test_incremental_equals_from_scratch(algo, bs, tokens, cuts, release, salt,
                                         with_lora) -> None:
    """Any split into hasher calls gives the same keys (no MM: old releases differ there
    exactly as vLLM does, see the fixtures' mm-decode cases)."""
    lora = LoraSpec("l", "/p") if with_lora else None
    config = cfg(algo=algo, hash_block_size=bs, vllm_version=release, pythonhashseed="7")
    whole = block_keys(tokens, config, lora=lora, cache_salt=salt)
    h = BlockKeyHasher(config, lora=lora, cache_salt=salt)
    pos = 0
    for cut in [*sorted(cuts), len(tokens)]:
        h.extend(tokens[pos:max(pos, cut)])
        pos = max(pos, cut)
    assert h.keys == whole


def test_mm_keys_with_incremental_window_0_31() -> None:
    """0.31+ keys a decode-completed block with every overlapping item; <= 0.30 only with the
    last item (vLLM's own behaviour, captured in the fixtures)."""
    prompt, mm = list(range(1000, 1056)), [MMItem("img-a", 5, 40), MMItem("img-b", 54, 2)]
    for release, equal in (("0.33.0", True), ("0.30.0", False)):
        config = cfg(algo="sha256_cbor", hash_block_size=32, vllm_version=release)
        h = BlockKeyHasher(config, prompt, mm=mm)
        h.extend(range(8))
        assert (h.keys == block_keys(prompt + list(range(8)), config, mm=mm)) is equal


def test_event_int_group_id_and_coarse() -> None:
    keys = block_keys(list(range(64)), cfg(algo="sha256_cbor", hash_block_size=8))
    assert to_event_int(keys[0]) == int.from_bytes(keys[0][-8:], "big")
    assert with_group_id(keys[0], 3) == keys[0] + b"\0\0\0\3"
    assert coarse_keys(keys, 2, "0.33.0") == keys[1::2]
    concat = coarse_keys(keys, 2, "0.20.0")
    assert concat == [keys[i] + keys[i + 1] for i in range(0, 8, 2)]
    assert [to_event_int(k) for k in concat] == [to_event_int(k) for k in keys[1::2]]
    assert coarse_keys(keys, 3, "0.33.0") == [keys[2], keys[5]]
    assert coarse_keys(keys, 1, "0.33.0") == keys
    with pytest.raises(HashingError):
        coarse_keys(keys, 2, "0.11.0")
    for factor in (0, -1, True, 2.0):
        with pytest.raises(KeyConfigError, match="coarse factor"):
            coarse_keys(keys, factor, "0.33.0")  # type: ignore[arg-type]


def test_prompt_embeds_ignored_before_0_11_1() -> None:
    """vLLM <= 0.11.0 hashed embeddings prompts as their zero token ids only."""
    pe = PromptEmbeds(bytes(range(64)), 4)
    old, new = cfg(hash_block_size=4, vllm_version="0.11.0"), cfg(hash_block_size=4,
                                                                  vllm_version="0.12.0")
    zeros = [0] * 16
    assert BlockKeyHasher(old, zeros, prompt_embeds=pe).keys == BlockKeyHasher(old, zeros).keys
    assert BlockKeyHasher(new, zeros, prompt_embeds=pe).keys != BlockKeyHasher(new, zeros).keys


def test_fingerprint_fields() -> None:
    fp = fingerprint_of(BlockKeyHasher(cfg(algo="xxhash", hash_block_size=32)))
    d = fp.to_dict()
    assert d == {"algo": "xxhash", "hbs": 32, "nh": fp.none_hash_id, "seed": "PYTHONHASHSEED",
                 "kf": "0.31", "vllm": "0.33.0", "pp": 5, "la": 0}
    assert len(d["nh"]) == 16 and fp.none_hash.hex() not in str(d)
    assert fp.describe()["none_hash"] == "6fb31cc38bba6066183f7f2104b9c051"
    cbor = fingerprint_of(BlockKeyHasher(cfg(algo="sha256_cbor", pythonhashseed=None)))
    assert cbor.to_dict()["pp"] is None and cbor.seed_source == "default"
    reported = fingerprint_of(BlockKeyHasher(cfg(algo="xxhash_cbor", none_hash=b"\1" * 16)))
    assert reported.seed_source == "reported"
    # <= 0.28 draws an unset seed's NONE_HASH as 32 random bytes, whatever the algorithm
    assert len(BlockKeyHasher(cfg(algo="xxhash", none_hash=b"\2" * 32), T).keys) == 2


# ---------------------------------------------------------------------------- string identity
# vLLM holds a separate object for every string field of a request; pickle memoizes by
# identity inside one block, so one shared object for two fields gives another key.


def _fresh(s: str) -> str:
    return "".join(list(s))


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_one_object_for_two_fields_changes_pickle_keys_only(algo) -> None:
    ident = _fresh("image-0123456789")
    shared = [MMItem(ident, 0, 4), MMItem(ident, 4, 4)]           # one object, twice
    separate = [MMItem(ident, 0, 4), MMItem(_fresh(ident), 4, 4)]  # equal values, two objects
    config = cfg(algo=algo, hash_block_size=16)
    differs = block_keys(T, config, mm=shared) != block_keys(T, config, mm=separate)
    assert differs is (algo in ("sha256", "xxhash"))


def test_json_decoded_inputs_are_separate_objects_like_vllms() -> None:
    """What a router gets from a JSON decoder (and what pdpatch hash uses) is the separate-objects
    case; one-character Latin-1 strings are shared by CPython everywhere, on both sides."""
    import json

    doc = json.loads('{"a": "image-0123456789", "b": "image-0123456789", "c": "x", "d": "x"}')
    assert doc["a"] == doc["b"] and doc["a"] is not doc["b"]
    assert doc["c"] is doc["d"] is _fresh("x")


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=4), kids,
                                                              max_size=3),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(["prompt", "lora", "mm", "cache_salt", "prompt_embeds"]),
       value=st.one_of(json_like, st.lists(st.integers(-5, 2**65), max_size=40)),
       release=st.sampled_from(["0.10.2", "0.11.1", "0.19.0", "0.33.0"]))
def test_fuzz_any_input_gives_keys_or_a_hashing_error(field, value, release) -> None:
    """Whatever a caller passes as one input, the library answers with keys or an
    InputError -- never a TypeError, a KeyError or a key from a silently coerced value."""
    inputs = {"prompt": [5] * 40, field: value}
    try:
        h = BlockKeyHasher(cfg(vllm_version=release), inputs.pop("prompt"), **inputs)
    except InputError:
        return
    if field == "prompt":    # only lists of ids in range, each a plain int
        assert isinstance(value, list) and h.tokens == value
        assert all(type(t) is int and 0 <= t < 2**64 for t in value)
    elif field == "cache_salt":
        assert value is None or isinstance(value, str)
    elif field == "mm":      # no JSON value is an MMItem
        assert value is None or value == []
    else:                    # LoraSpec and PromptEmbeds only
        assert value is None


class _Indexable:
    """An int-like that is not an int (numpy scalars are such)."""

    def __index__(self) -> int:
        return 7


@pytest.mark.parametrize("values", [[1, -1], [True], [2**64], [1.0], ["7"], [2**63, 0],
                                    [3, _Indexable()], (1, 2)])
def test_token_checks_without_the_compiled_encoder(monkeypatch, values) -> None:
    """A build without a C compiler checks every id in Python, with the same outcome."""
    from pdpatch.hashing import inputs

    def outcome():
        try:
            return inputs.token_ids(values)
        except InputError as e:
            return str(e)

    compiled = outcome()
    monkeypatch.setattr(inputs, "_first_non_id", None)
    assert outcome() == compiled
