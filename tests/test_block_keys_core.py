"""The pure part of the ``block_keys`` patch -- fingerprints and the P/D comparison
(:mod:`pdpatch.hashing.verdict`), the patch's bounds and rate limits -- with no vLLM import.
Keys come from :mod:`pdpatch.hashing` (checked byte for byte against real vLLM in
``test_hashing_*``); the connector-level proof is ``test_block_keys_vllm.py``."""

from __future__ import annotations

import json

import pytest

from pdpatch import config
from pdpatch.hashing import KeyConfig, LoraSpec
from pdpatch.hashing import verdict as V
from pdpatch.hashing.errors import HashingError, PeerParamsError
from pdpatch.hashing.extra_keys import ExtraKeys
from pdpatch.hashing.formats import format_for
from pdpatch.hashing.peer_check import (
    build_params,
    params_for_keys,
    parse_params,
    request_summary,
    request_summary_of,
)
from pdpatch.patches import block_keys as bk

PROMPT = list(range(1000, 1100))       # 6 full blocks of 16 + 4 tokens


def engine(algo: str = "sha256", seed: str | None = "0", hbs: int = 16,
           version: str = "0.33.0", none_hash: bytes | None = None) -> V.EngineKeys:
    """An engine as the patch sees it: its live NONE_HASH is what vLLM derived (or given)."""
    if none_hash is None:
        none_hash = KeyConfig(algo=algo, hash_block_size=hbs, vllm_version=version,
                              pythonhashseed=seed).validate().none_hash
    return V.engine_keys(algo=algo, hash_block_size=hbs, vllm_version=version,
                          none_hash=none_hash, pythonhashseed=seed)


def request_on(eng: V.EngineKeys, prompt: list[int] = PROMPT, **inputs) -> V.RequestKeys:
    """The request as that engine's vLLM would have hashed it (``request.block_hashes``)."""
    fp = eng.fingerprint
    h = KeyConfig(algo=fp.algo, hash_block_size=fp.hash_block_size,
                  vllm_version=fp.vllm_version, none_hash=fp.none_hash).hasher(prompt, **inputs)
    n = V.prompt_block_count(len(h.keys), len(prompt), fp.hash_block_size)
    return V.RequestKeys(h.keys[:n], prompt, ExtraKeys(eng.fmt, **inputs))


def wire(eng: V.EngineKeys, req: V.RequestKeys):
    """P's params through JSON and D's parser."""
    return parse_params(json.loads(json.dumps(V.build_p_params(eng, req, bk.MAX_HEX_KEYS))))


def verdict(p: V.EngineKeys, d: V.EngineKeys, p_prompt=PROMPT, d_prompt=PROMPT,
            p_inputs=None, d_inputs=None) -> V.Verdict:
    peer = wire(p, request_on(p, p_prompt, **(p_inputs or {})))
    return V.judge(d, request_on(d, d_prompt, **(d_inputs or {})), peer)


# ---------------------------------------------------------------------------- fingerprints


def test_seed_source_is_the_one_that_reproduces_none_hash():
    assert engine(seed="0").seed_label == "PYTHONHASHSEED"
    assert engine(seed=None).seed_label == "default"            # 0.29+ sha256
    assert engine(seed=None).compact["seed"] == "default"
    # xxhash without PYTHONHASHSEED: vLLM drew NONE_HASH from os.urandom
    rnd = engine("xxhash_cbor", seed=None, none_hash=b"\x01" * 16)
    assert rnd.seed_label == "random" and rnd.compact["seed"] == "reported"
    # an environment changed after the engine started: the live value wins
    moved = engine(seed="1", none_hash=engine(seed="0").fingerprint.none_hash)
    assert moved.seed_label == "reported"
    assert moved.compact["nh"] == engine(seed="0").compact["nh"]
    # <= 0.28: no default seed even for sha256
    assert engine(seed=None, version="0.28.0", none_hash=b"\x02" * 32).seed_label == "random"


def test_describe_names_everything_an_operator_diffs():
    line = engine().describe()
    for part in ("algo=sha256", "seed=PYTHONHASHSEED", "none_hash_id=", "hash_block_size=16",
                 "key_format=0.31", "vllm=0.33.0", "pickle_protocol=5"):
        assert part in line, line
    assert engine(seed="0").describe() != engine(seed="1").describe()


def test_algorithm_the_release_lacks_is_refused():
    with pytest.raises(HashingError):
        engine("xxhash", version="0.12.0", none_hash=b"\x00" * 16)


# ---------------------------------------------------------------------------- the comparison


def test_same_configuration_and_request_match():
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        assert verdict(engine(algo), engine(algo)).status == "match", algo
    lora = {"lora": LoraSpec("a", "/a"), "cache_salt": "s"}
    assert verdict(engine(), engine(), p_inputs=lora, d_inputs=lora).status == "match"


@pytest.mark.parametrize(("p_hbs", "d_hbs"), [(16, 32), (32, 16), (16, 48), (64, 16)])
def test_different_hash_block_sizes_match_through_the_inputs(p_hbs, d_hbs):
    """vLLM's NIXL connector pairs engines of different block sizes (block_size_ratio): such a
    pair must not be sent to local compute for that alone."""
    v = verdict(engine(hbs=p_hbs), engine(hbs=d_hbs))
    assert v.status == "match", v
    assert f"P hashes every {p_hbs} tokens, D every {d_hbs}" in v.detail


@pytest.mark.parametrize(("p", "d", "kw", "want"), [
    ({}, {"seed": "1"}, {}, ["seed"]),
    ({}, {"algo": "sha256_cbor"}, {}, ["algo"]),
    ({}, {"hbs": 32, "seed": "1"}, {}, ["seed"]),
    ({}, {"hbs": 32}, {"d_prompt": [*PROMPT[:-1], 7]}, ["prompt"]),
    ({}, {"hbs": 32}, {"p_inputs": {"cache_salt": "x"}}, ["cache_salt"]),
    ({"algo": "xxhash_cbor", "seed": None}, {"algo": "xxhash_cbor", "seed": None}, {},
     ["seed"]),          # both random: nobody can share vLLM's secret NONE_HASH
    ({}, {}, {"d_prompt": [*PROMPT[:20], 7, *PROMPT[21:]]}, ["prompt"]),
    ({}, {}, {"d_prompt": [*PROMPT[:-1], 7]}, ["prompt"]),        # partial last block only
    ({}, {}, {"d_prompt": [*PROMPT, 5]}, ["prompt"]),
    ({}, {}, {"p_inputs": {"lora": LoraSpec("a", "/a")},
              "d_inputs": {"lora": LoraSpec("a", "/mnt/a")}}, ["lora"]),   # 0.31+: path
    ({}, {}, {"p_inputs": {"lora": LoraSpec("a", "/a")}}, ["lora"]),
    ({}, {}, {"p_inputs": {"cache_salt": "x"}, "d_inputs": {"cache_salt": "y"}},
     ["cache_salt"]),
])
def test_each_cause_is_named(p, d, kw, want):
    # a side without PYTHONHASHSEED on xxhash has a random NONE_HASH: give each its own
    pe = engine(**p, none_hash=b"\x01" * 16 if p.get("seed", "0") is None else None)
    de = engine(**d, none_hash=b"\x02" * 16 if d.get("seed", "0") is None else None)
    v = verdict(pe, de, **kw)
    assert v.status == "mismatch"
    assert list(v.causes) == want, v


def test_short_prompt_mismatch_is_caught_without_any_key():
    short = PROMPT[:10]
    v = verdict(engine(), engine(seed="1"), short, short)
    assert v.causes == ("seed",)
    assert verdict(engine(), engine(), short, short).status == "match"


def test_key_format_alone_is_no_cause_while_keys_agree():
    # a plain prompt: 0.30 and 0.33 build the same keys
    assert verdict(engine(version="0.30.0"), engine()).status == "match"
    # with a LoRA the formats build different keys
    lora = {"lora": LoraSpec("a", "/a")}
    v = verdict(engine(version="0.30.0"), engine(), p_inputs=lora, d_inputs=lora)
    assert v.causes == ("key_format",)


def test_first_differing_block_is_reported():
    changed = [*PROMPT[:40], 1, *PROMPT[41:]]
    v = verdict(engine(), engine(), PROMPT, changed)
    assert "first differing block 2" in v.detail
    assert V.first_difference([b"a", b"b"], (b"a", b"b")) is None
    assert V.first_difference([b"a"], (b"a", b"b")) == 1
    assert V.first_difference([b"a"], None) is None


def test_prompt_blocks_only():
    assert V.prompt_block_count(7, 100, 16) == 6     # P's first token completed block 7
    assert V.prompt_block_count(6, 100, 16) == 6
    assert V.prompt_block_count(0, 10, 16) == 0


# ---------------------------------------------------------------------------- bounded params


def test_params_are_bounded_hex_json():
    eng = engine()
    long = list(range(32_000))
    big = V.build_p_params(eng, request_on(eng, long), bk.MAX_HEX_KEYS)
    text = json.dumps(big)
    assert "keys" not in big and len(text) < 512              # 2000 blocks: digest only
    small = V.build_p_params(eng, request_on(eng), bk.MAX_HEX_KEYS)
    assert len(small["keys"]) == 6 and all(len(k) == 64 for k in small["keys"])
    assert len(json.dumps(small)) < 1024
    edge_prompt = list(range(16 * bk.MAX_HEX_KEYS))
    edge = V.build_p_params(eng, request_on(eng, edge_prompt), bk.MAX_HEX_KEYS)
    assert len(edge["keys"]) == bk.MAX_HEX_KEYS and len(json.dumps(edge)) < 2600


@pytest.mark.parametrize("raw", [
    None, "x", 1, [], {"v": 1}, {"v": True}, {"v": 2},
    {"v": 1, "fp": {"algo": "md5"}, "n": 1, "kd": "0" * 32, "x": {}},
])
def test_malformed_params_are_rejected(raw):
    with pytest.raises(PeerParamsError):
        parse_params(raw)


def test_tampered_params_are_rejected():
    eng = engine()
    good = V.build_p_params(eng, request_on(eng), bk.MAX_HEX_KEYS)
    for key, value in [("kd", "__import__('os')"), ("n", -1), ("n", True),
                       ("keys", ["00" * 32] * 7), ("keys", ["zz" * 32] * 6),
                       ("keys", list(reversed(good["keys"])))]:
        bad = json.loads(json.dumps(good))
        bad[key] = value
        with pytest.raises(PeerParamsError):
            parse_params(bad)


# ---------------------------------------------------------------------------- policy, limits


def test_on_mismatch_policy():
    assert bk.on_mismatch_policy({}) == "recompute"
    assert bk.on_mismatch_policy({bk.ON_MISMATCH_ENV: "WARN"}) == "warn"
    with pytest.raises(config.ConfigError, match="recompute, warn"):
        bk.on_mismatch_policy({bk.ON_MISMATCH_ENV: "ignore"})


def test_option_is_declared_so_settings_accept_it():
    from pdpatch.patches import read_settings

    assert bk.ON_MISMATCH_ENV in bk.PATCH.options
    read_settings({bk.ON_MISMATCH_ENV: "warn", "PDPATCH_BLOCK_KEYS": "0"})


def test_rate_limiter_one_line_per_cause_per_interval():
    now = [0.0]
    rl = bk.RateLimiter(60.0, clock=lambda: now[0])
    assert rl.admit("seed") == 0
    assert rl.admit("seed") is None and rl.admit("seed") is None
    assert rl.admit("algo") == 0                      # another cause logs at once
    now[0] = 61.0
    assert rl.admit("seed") == 2                      # reports what it held back
    assert rl.admit("seed") is None


def test_peer_name_is_bounded_and_printable():
    assert bk._peer_name({"remote_engine_id": "e" * 1000}) == "e" * 64
    assert bk._peer_name({"remote_engine_id": "a\nb\u00e9"}) == "a\\nb\\xe9"
    assert bk._peer_name({"remote_engine_id": 5}) == "'int'"


# ---------------------------------------------------------------------------- library additions


def test_parts_builders_equal_the_hasher_builders():
    fmt = format_for("0.33.0")
    cfg = KeyConfig(pythonhashseed="0")
    inputs = {"lora": LoraSpec("a", "/a"), "cache_salt": "s"}
    h = cfg.hasher(PROMPT, **inputs)
    assert request_summary_of(PROMPT, ExtraKeys(fmt, **inputs)) == request_summary(h)
    from pdpatch.hashing.fingerprint import fingerprint_of

    for n in (0, 6, 10):
        assert params_for_keys(fingerprint_of(h).to_dict(), h.keys, request_summary(h),
                               include_keys=n) == build_params(h, include_keys=n)
