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


@pytest.mark.parametrize(("release", "era"), [
    ("0.10.2", "0.10.2"), ("0.11.0", "0.10.2"), ("0.12.0", "0.12"), ("0.16.1", "0.12"),
    ("0.17.0", "0.17"), ("0.18.0", "0.17"), ("0.19.0", "0.19"), ("0.30.0", "0.19"),
    ("0.31.0", "0.31"), ("0.33.0", "0.31")])
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
    assert not f("0.18.0").mm_strict_bounds and f("0.19.0").mm_strict_bounds


def test_integer_era_and_garbage_versions_are_refused() -> None:
    with pytest.raises(HashingError, match="integers"):
        format_for("0.10.1.1")
    with pytest.raises(HashingError, match="not a vLLM version"):
        format_for("latest")


def test_newer_release_uses_latest_rules_unverified(caplog) -> None:
    fmt = format_for("0.35.2")
    assert not fmt.verified and fmt.key_format == "0.31" and fmt.lookahead


def test_seed_is_the_exact_string() -> None:
    """'0' and '00' differ; '' and 'random' are seeds too (vLLM uses the raw env string)."""
    none_hashes = {s: BlockKeyHasher(algo="sha256_cbor", pythonhashseed=s).none_hash
                   for s in ("0", "00", "", "random")}
    assert len(set(none_hashes.values())) == 4
    assert none_hashes["0"].hex() == \
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    assert BlockKeyHasher(algo="xxhash_cbor", pythonhashseed="random").none_hash.hex() == \
        "32e23dc39776371d9f8b217365649b32"  # research note §5


@pytest.mark.parametrize(("algo", "release", "ok"), [
    ("sha256", "0.33.0", True), ("sha256_cbor", "0.29.0", True),
    ("sha256", "0.28.0", False), ("sha256_cbor", "0.12.0", False),
    ("xxhash", "0.33.0", False), ("xxhash_cbor", "0.29.0", False), ("xxhash", "0.20.0", False)])
def test_unset_seed(algo: str, release: str, ok: bool) -> None:
    if ok:
        h = BlockKeyHasher(algo=algo, vllm_version=release, pythonhashseed=None)
        assert h.seed is not None and h.seed.seed == "vllm-none-hash"
        assert h.seed.source == "default"
        return
    with pytest.raises(UnreproducibleSeedError) as e:
        BlockKeyHasher(algo=algo, vllm_version=release, pythonhashseed=None)
    msg = str(e.value)
    assert "not reproducible" in msg and "PYTHONHASHSEED identically on P and D" in msg


def test_xxhash_missing_error_says_vllm_does_not_depend_on_it() -> None:
    """Run in a child where ``import xxhash`` fails (the package hidden, not faked)."""
    code = textwrap.dedent("""
        import sys
        sys.modules["xxhash"] = None  # makes `import xxhash` raise ImportError
        from pdpatch.hashing import XxhashUnavailableError, block_keys
        try:
            block_keys([1, 2], algo="xxhash_cbor", hash_block_size=2, pythonhashseed="0")
        except XxhashUnavailableError as e:
            print("ERR", e)
        print("SHA", block_keys([1, 2], algo="sha256", hash_block_size=2,
                                pythonhashseed="0")[0].hex())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "ERR" in out and "pip install xxhash" in out
    assert "vLLM itself does not depend on xxhash" in out
    assert "SHA " in out  # the sha256 algorithms need nothing extra
    assert issubclass(XxhashUnavailableError, ModuleNotFoundError)


def test_unknown_algorithm_and_algorithm_not_in_release() -> None:
    with pytest.raises(HashingError, match="unknown block-hash algorithm"):
        get_algorithm("md5")
    with pytest.raises(HashingError, match="has no 'xxhash_cbor'"):
        BlockKeyHasher(algo="xxhash_cbor", vllm_version="0.12.0", pythonhashseed="0")


def test_bad_arguments() -> None:
    with pytest.raises(HashingError):
        BlockKeyHasher(hash_block_size=0, pythonhashseed="0")
    with pytest.raises(HashingError, match="lookahead"):
        BlockKeyHasher(lookahead=1, vllm_version="0.32.0", pythonhashseed="0")
    with pytest.raises(HashingError, match="string"):
        BlockKeyHasher(pythonhashseed=0)  # type: ignore[arg-type]
    with pytest.raises(HashingError, match="none_hash"):
        BlockKeyHasher(none_hash=b"")
    with pytest.raises(HashingError, match="MMItem"):
        BlockKeyHasher(mm=[("id", 0, 4)], pythonhashseed="0")  # type: ignore[list-item]
    with pytest.raises(HashingError, match="rows"):
        PromptEmbeds(b"\0" * 7, 2)


def test_full_blocks_only() -> None:
    assert len(block_keys(T, hash_block_size=16, pythonhashseed="0")) == 2
    assert block_keys(T[:15], hash_block_size=16, pythonhashseed="0") == []
    assert len(block_keys(T, hash_block_size=1, pythonhashseed="0")) == 40


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
    kw = dict(algo=algo, hash_block_size=bs, vllm_version=release, pythonhashseed="7",
              lora=lora, cache_salt=salt)
    whole = block_keys(tokens, **kw)
    h = BlockKeyHasher(**kw)
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
        kw = dict(algo="sha256_cbor", hash_block_size=32, vllm_version=release,
                  pythonhashseed="0", mm=mm)
        h = BlockKeyHasher(prompt=prompt, **kw)
        h.extend(range(8))
        assert (h.keys == block_keys(prompt + list(range(8)), **kw)) is equal


def test_event_int_group_id_and_coarse() -> None:
    keys = block_keys(list(range(64)), algo="sha256_cbor", hash_block_size=8, pythonhashseed="0")
    assert to_event_int(keys[0]) == int.from_bytes(keys[0][-8:], "big")
    assert with_group_id(keys[0], 3) == keys[0] + b"\0\0\0\3"
    assert coarse_keys(keys, 2, "0.33.0") == keys[1::2]
    concat = coarse_keys(keys, 2, "0.20.0")
    assert concat == [keys[i] + keys[i + 1] for i in range(0, 8, 2)]
    assert [to_event_int(k) for k in concat] == [to_event_int(k) for k in keys[1::2]]
    assert coarse_keys(keys, 3, "0.33.0") == [keys[2], keys[5]]
    assert coarse_keys(keys, 1) == keys
    with pytest.raises(HashingError):
        coarse_keys(keys, 2, "0.11.0")


def test_prompt_embeds_ignored_before_0_12() -> None:
    """vLLM <= 0.11 hashed embeddings prompts as their zero token ids only."""
    pe = PromptEmbeds(bytes(range(64)), 4)
    kw = dict(hash_block_size=4, vllm_version="0.11.0", pythonhashseed="0", prompt=[0] * 16)
    assert BlockKeyHasher(prompt_embeds=pe, **kw).keys == BlockKeyHasher(**kw).keys
    kw["vllm_version"] = "0.12.0"
    assert BlockKeyHasher(prompt_embeds=pe, **kw).keys != BlockKeyHasher(**kw).keys


def test_fingerprint_fields() -> None:
    fp = fingerprint_of(BlockKeyHasher(algo="xxhash", pythonhashseed="0", hash_block_size=32))
    d = fp.to_dict()
    assert d == {"algo": "xxhash", "hbs": 32, "nh": fp.none_hash_id, "seed": "PYTHONHASHSEED",
                 "kf": "0.31", "vllm": "0.33.0", "pp": 5, "la": 0}
    assert len(d["nh"]) == 16 and fp.none_hash.hex() not in str(d)
    assert fp.describe()["none_hash"] == "6fb31cc38bba6066183f7f2104b9c051"
    cbor = fingerprint_of(BlockKeyHasher(algo="sha256_cbor")).to_dict()
    assert cbor["pp"] is None and cbor["seed"] == "default"
    reported = fingerprint_of(BlockKeyHasher(algo="xxhash_cbor", none_hash=b"\1" * 16))
    assert reported.seed_source == "reported"
