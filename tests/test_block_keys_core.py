"""The pure part of the ``block_keys`` patch -- canonical keys, fingerprints and the P/D
comparison (:mod:`pdpatch.hashing.verdict`), the patch's bounds and rate limits -- with no vLLM
import.  Keys come from :mod:`pdpatch.hashing` (checked byte for byte against real vLLM in
``test_hashing_*``); the connector-level proof is ``test_block_keys_vllm.py``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdpatch.hashing import KeyConfig, LoraSpec, MMItem
from pdpatch.hashing import verdict as V
from pdpatch.hashing.errors import HashingError, PeerParamsError
from pdpatch.hashing.key_params import parse_params
from pdpatch.patches.block_keys import wrappers as bk

PROMPT = list(range(1000, 1100))       # 6 full blocks of 16 + 4 tokens


def engine(algo: str = "sha256", seed: str | None = "0", hbs: int = 16,
           version: str = "0.33.0", none_hash: bytes | None = None) -> V.EngineKeys:
    """An engine as the patch sees it: its live NONE_HASH is what vLLM derived (or given)."""
    if none_hash is None:
        none_hash = KeyConfig(algo=algo, hash_block_size=hbs, vllm_version=version,
                              pythonhashseed=seed).validate().none_hash
    return V.engine_keys(algo=algo, hash_block_size=hbs, vllm_version=version,
                          none_hash=none_hash, pythonhashseed=seed)


def wire(eng: V.EngineKeys, req: V.RequestInputs, include_keys: int = bk.MAX_HEX_KEYS):
    """P's params through JSON and D's parser."""
    return parse_params(json.loads(json.dumps(V.build_p_params(eng, req, include_keys))))


def verdict(p: V.EngineKeys, d: V.EngineKeys | None, p_prompt=PROMPT, d_prompt=PROMPT,
            p_inputs=None, d_inputs=None) -> V.Verdict:
    peer = wire(p, V.RequestInputs(p_prompt, p_inputs or {}))
    return V.judge(d, V.RequestInputs(d_prompt, d_inputs or {}), peer)


def random_engine(algo: str = "xxhash_cbor", version: str = "0.33.0", byte: int = 1):
    """An engine whose vLLM drew NONE_HASH from os.urandom (PYTHONHASHSEED unset)."""
    width = 16 if algo.startswith("xxhash") else 32
    return engine(algo, seed=None, version=version, none_hash=bytes([byte]) * width)


# ---------------------------------------------------------------------------- fingerprints


def test_seed_source_is_the_one_that_reproduces_none_hash():
    assert engine(seed="0").seed_label == "PYTHONHASHSEED"
    assert engine(seed=None).seed_label == "default"            # 0.29+ sha256
    assert engine(seed=None).compact["seed"] == "default"
    rnd = random_engine()
    assert rnd.seed_label == "random" and rnd.compact["seed"] == "reported"
    # an environment changed after the engine started: the live value wins
    moved = engine(seed="1", none_hash=engine(seed="0").fingerprint.none_hash)
    assert moved.seed_label == "reported"
    assert moved.compact["nh"] == engine(seed="0").compact["nh"]
    # <= 0.28: no default seed even for sha256
    assert random_engine("sha256", "0.28.0", 2).seed_label == "random"


def test_describe_names_everything_an_operator_diffs():
    line = engine().describe()
    for part in ("algo=sha256", "seed=PYTHONHASHSEED", "none_hash_id=", "hash_block_size=16",
                 "key_format=0.31", "vllm=0.33.0", "pickle_protocol=5"):
        assert part in line, line
    assert engine(seed="0").describe() != engine(seed="1").describe()


def test_algorithm_the_release_lacks_is_refused():
    with pytest.raises(HashingError):
        engine("xxhash", version="0.12.0", none_hash=b"\x00" * 16)


# ---------------------------------------------------------------------------- canonical keys


def test_canonical_keys_are_vllms_chain_with_pdpatchs_own_none_hash():
    req = V.RequestInputs(PROMPT, {"lora": LoraSpec("a", "/a"), "cache_salt": "s"})
    h = req.canonical(16)
    same = KeyConfig(algo="sha256_cbor", hash_block_size=16, vllm_version="0.33.0",
                     pythonhashseed=None, none_hash=V.CANONICAL_NONE_HASH).hasher(
        PROMPT, **req.inputs)
    assert h.keys == same.keys and len(h.keys) == 6
    # no engine's default NONE_HASH: canonical keys are never an engine's own keys
    default = KeyConfig(algo="sha256_cbor", vllm_version="0.33.0", hash_block_size=16,
                        pythonhashseed=None).validate().none_hash
    assert default != V.CANONICAL_NONE_HASH
    assert req.canonical(32).keys != h.keys and len(req.canonical(32).keys) == 3


# ---------------------------------------------------------------------------- the comparison


def test_same_request_matches_whatever_the_engines_configuration():
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        assert verdict(engine(algo), engine(algo)).status == "match", algo
    lora = {"lora": LoraSpec("a", "/a"), "cache_salt": "s"}
    assert verdict(engine(), engine(), p_inputs=lora, d_inputs=lora).status == "match"


@pytest.mark.parametrize(("p", "d", "naming"), [
    (engine(), engine(seed="1"), ["seed"]),
    (engine(), engine("sha256_cbor"), ["algo"]),
    (engine(), engine(hbs=32), ["hash_block_size"]),
    (engine(hbs=64), engine(hbs=16, seed="1"), ["hash_block_size", "seed"]),
    # PYTHONHASHSEED unset on both (vLLM's default): random NONE_HASH per engine
    (random_engine(byte=1), random_engine(byte=2), ["seed"]),
    (random_engine("sha256", "0.28.0", 1), random_engine("sha256", "0.28.0", 2), ["seed"]),
    (engine(version="0.30.0"), engine(), []),
])
def test_engines_that_name_blocks_differently_still_match(p, d, naming):
    """The KV does not depend on how each engine names blocks in its own prefix cache, so such
    pairs are not sent to local compute; the difference is reported apart."""
    lora = {"lora": LoraSpec("a", "/a")}
    for inputs in ({}, lora):
        v = verdict(p, d, p_inputs=inputs, d_inputs=inputs)
        assert v.status == "match" and v.causes == (), v
        assert list(v.naming) == naming + (["key_format"] if p.compact["kf"] != d.compact["kf"]
                                           else []), v
    assert verdict(p, d, PROMPT[:10], PROMPT[:10]).status == "match"   # shorter than a block


@pytest.mark.parametrize(("kw", "want"), [
    ({"d_prompt": [*PROMPT[:20], 7, *PROMPT[21:]]}, ["prompt"]),
    ({"d_prompt": [*PROMPT[:-1], 7]}, ["prompt"]),        # partial last block only
    ({"d_prompt": [*PROMPT, 5]}, ["prompt"]),
    ({"p_prompt": PROMPT[:10], "d_prompt": [*PROMPT[:9], 7]}, ["prompt"]),   # no full block
    ({"p_inputs": {"lora": LoraSpec("a", "/a")},
      "d_inputs": {"lora": LoraSpec("a", "/mnt/a")}}, ["lora"]),             # the path counts
    ({"p_inputs": {"lora": LoraSpec("a", "/a")}}, ["lora"]),
    ({"p_inputs": {"cache_salt": "x"}, "d_inputs": {"cache_salt": "y"}}, ["cache_salt"]),
    ({"p_inputs": {"cache_salt": "x"}}, ["cache_salt"]),
])
def test_each_request_difference_is_named(kw, want):
    for p, d in ((engine(), engine()), (random_engine(byte=1), random_engine(byte=2)),
                 (engine(hbs=16), engine(hbs=48, version="0.28.0", seed="5"))):
        v = verdict(p, d, **kw)
        assert v.status == "mismatch" and list(v.causes) == want, (p, d, v)


def test_lookahead_keys_of_a_034_engine_with_nixl_still_match():
    """0.34 keeps EAGLE's lookahead block hashes with the NIXL connector (0.33 turned them off
    with any KV connector): such an engine names its blocks unlike a 0.33 P, the request's
    canonical keys do not change."""
    none_hash = KeyConfig(algo="sha256", hash_block_size=16, vllm_version="0.34.0",
                          pythonhashseed="0").validate().none_hash
    eagle = V.engine_keys(algo="sha256", hash_block_size=16, vllm_version="0.34.0",
                          none_hash=none_hash, pythonhashseed="0", lookahead=2)
    assert "lookahead=2" in eagle.describe() and "vllm=0.34.0" in eagle.describe()
    for p, d in ((engine(), eagle), (eagle, engine())):
        v = verdict(p, d)
        assert v.status == "match" and v.naming == ("lookahead",), v
    assert verdict(engine(), eagle, d_prompt=PROMPT[:-1]).causes == ("prompt",)


def test_a_release_that_hashes_less_still_compares_every_input():
    """0.30 keys a LoRA by name only; the canonical keys take its path too, on either side."""
    old = engine(version="0.30.0")
    v = verdict(old, old, p_inputs={"lora": LoraSpec("a", "/a")},
                d_inputs={"lora": LoraSpec("a", "/b")})
    assert v.causes == ("lora",)


def test_d_without_its_own_fingerprint_still_judges():
    assert verdict(engine(), None).status == "match"
    assert verdict(engine(), None, d_prompt=PROMPT[:-1]).causes == ("prompt",)


def test_keys_not_computed_canonically_are_rejected():
    from pdpatch.hashing.key_params import build_params

    eng = engine()
    own = KeyConfig(algo="sha256", vllm_version="0.33.0", hash_block_size=16,
                    pythonhashseed="0").hasher(PROMPT)       # the engine's own keys
    peer = parse_params(json.loads(json.dumps(build_params(own, include_keys=32))))
    v = V.judge(eng, V.RequestInputs(PROMPT, {}), peer)
    assert v.status == "rejected" and v.causes == ("malformed",)


def _full_chain_status(d_req: V.RequestInputs, p_req: V.RequestInputs, hbs: int) -> str:
    """The verdict from both sides' whole canonical key chains (what neither side computes for
    a long prompt now), then every input digest (the partial last block)."""
    from pdpatch.hashing.key_params import input_causes, request_summary

    mine, theirs = d_req.canonical(hbs), p_req.canonical(hbs)
    return "mismatch" if mine.keys != theirs.keys or \
        input_causes(request_summary(mine), request_summary(theirs)) else "match"


_TOKENS = st.lists(st.integers(0, 5), max_size=40)
_INPUTS = st.fixed_dictionaries({}, optional={
    "lora": st.builds(LoraSpec, st.sampled_from(["a", "b"]), st.sampled_from(["/a", "/b"])),
    "cache_salt": st.sampled_from(["x", "y"]),
    "mm": st.lists(st.builds(MMItem, st.sampled_from(["i", "j"]), st.integers(0, 3),
                             st.integers(1, 3)), max_size=1),
})


@settings(max_examples=300, deadline=None)
@given(p_tokens=_TOKENS, d_tokens=_TOKENS, p_inputs=_INPUTS, d_inputs=_INPUTS,
       hbs=st.sampled_from([1, 3, 16]), same=st.booleans(),
       include_keys=st.sampled_from([0, 2, bk.MAX_HEX_KEYS]))
def test_verdict_from_input_digests_is_the_full_key_chains(p_tokens, d_tokens, p_inputs,
                                                          d_inputs, hbs, same, include_keys):
    """Neither side computes a long prompt's key chain: P sends the input digests (its keys
    only up to ``include_keys`` blocks) and D judges from them.  For every pair of requests
    the verdict is the one both whole key chains give.  Fails if an input enters the keys but
    not the digests."""
    if same:
        d_tokens, d_inputs = p_tokens, p_inputs
    p = engine(hbs=hbs)
    p_req, d_req = V.RequestInputs(p_tokens, p_inputs), V.RequestInputs(d_tokens, d_inputs)
    try:
        peer = wire(p, p_req, include_keys)
        d_req.summary()
    except HashingError:        # e.g. a multimodal range past the prompt: no server has it
        return
    assert (peer.keys_digest is None) == (not 0 < peer.num_blocks <= include_keys)
    v = V.judge(engine(hbs=hbs), d_req, peer)
    assert v.status == _full_chain_status(d_req, p_req, hbs), (v, p_tokens, d_tokens)
    if same:
        assert v.status == "match"


def test_first_differing_block_is_reported():
    changed = [*PROMPT[:40], 1, *PROMPT[41:]]
    v = verdict(engine(), engine(), PROMPT, changed)
    assert "first differing block 2" in v.detail
    assert V.first_difference([b"a", b"b"], (b"a", b"b")) is None
    assert V.first_difference([b"a"], (b"a", b"b")) == 1
    assert V.first_difference([b"a"], None) is None


# ---------------------------------------------------------------------------- bounded params


def test_params_are_bounded_hex_json():
    eng = engine()
    long = list(range(32_000))
    big = V.build_p_params(eng, V.RequestInputs(long, {}), bk.MAX_HEX_KEYS)
    text = json.dumps(big)
    assert "keys" not in big and len(text) < 512              # 2000 blocks: digest only
    small = V.build_p_params(eng, V.RequestInputs(PROMPT, {}), bk.MAX_HEX_KEYS)
    assert len(small["keys"]) == 6 and all(len(k) == 64 for k in small["keys"])
    assert len(json.dumps(small)) < 1024
    edge_prompt = list(range(16 * bk.MAX_HEX_KEYS))
    edge = V.build_p_params(eng, V.RequestInputs(edge_prompt, {}), bk.MAX_HEX_KEYS)
    assert len(edge["keys"]) == bk.MAX_HEX_KEYS and len(json.dumps(edge)) < 2800


@pytest.mark.parametrize("raw", [
    None, "x", 1, [], {"v": 3}, {"v": True}, {"v": 2},
    {"v": 3, "fp": {"algo": "md5"}, "n": 1, "kd": "0" * 32, "x": {}},
])
def test_malformed_params_are_rejected(raw):
    with pytest.raises(PeerParamsError):
        parse_params(raw)


def test_tampered_params_are_rejected():
    eng = engine()
    good = V.build_p_params(eng, V.RequestInputs(PROMPT, {}), bk.MAX_HEX_KEYS)
    for key, value in [("kd", "__import__('os')"), ("n", -1), ("n", True),
                       ("keys", ["00" * 32] * 7), ("keys", ["zz" * 32] * 6),
                       ("keys", list(reversed(good["keys"]))), ("efp", {"algo": "md5"})]:
        bad = json.loads(json.dumps(good))
        bad[key] = value
        with pytest.raises(PeerParamsError):
            parse_params(bad)


# ---------------------------------------------------------------------------- policy, limits


def test_on_mismatch_policy():
    assert bk.on_mismatch_policy({}) == "recompute"
    assert bk.on_mismatch_policy({bk.ON_MISMATCH_ENV: "WARN"}) == "warn"   # errors: test_config


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
