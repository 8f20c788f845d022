"""pdpatch.hashing against the REAL hashing of the installed vLLM (0.34.0 in the test venv), live,
on randomized inputs.

Every example builds a real ``vllm.v1.request.Request`` with vLLM's own block hasher
(``get_request_block_hasher`` + ``init_none_hash`` under the example's PYTHONHASHSEED), appends
decode tokens with ``append_output_token_ids``, and demands that ``BlockKeyHasher`` produce the
same ``request.block_hashes``.  Both sides get the *same* string objects, so pickle's identity
memo sees the same structure.  Token ids are drawn up to what the release's ``Request`` holds
(:attr:`~pdpatch.hashing.formats.HashFormat.max_token_id`: int32 from 0.34), and
:func:`test_token_id_bound_is_the_releases` shows that bound is the release's own.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils as K  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.utils import tensor_data  # noqa: E402

from pdpatch.hashing import (  # noqa: E402
    ALGORITHMS,
    BlockKeyHasher,
    InputError,
    KeyConfig,
    LoraSpec,
    MMItem,
    PromptEmbeds,
    block_keys,
    coarse_keys,
    format_for,
    to_event_extra_keys,
    to_event_int,
)
from pdpatch.hashing.key_params import build_params, compare, parse_params  # noqa: E402
from pdpatch.hashing.request_adapter import hasher_for_request  # noqa: E402
from pdpatch.versions import release_of, vllm_version  # noqa: E402

VERSION = str(release_of(vllm_version()))
MAX_ID = format_for(VERSION).max_token_id


def cfg(algo: str, bs: int, seed: str | None = "0", **over) -> KeyConfig:
    return KeyConfig(vllm_version=VERSION, algo=algo, hash_block_size=bs, pythonhashseed=seed,
                     **over)

LIVE = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

token = st.one_of(st.integers(0, 23), st.integers(24, 255), st.integers(256, 65535),
                  st.integers(65536, 262143), st.sampled_from(
                      [t for t in (0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31,
                                   2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1) if t <= MAX_ID]),
                  st.integers(262144, MAX_ID))
name = st.text(min_size=1, max_size=10)
seed = st.sampled_from(["0", "", "random", "00", "424242"])


@pytest.fixture(autouse=True)
def _restore_vllm_none_hash():
    """init_none_hash sets module globals; leave them as we found them."""
    saved = {k: getattr(K, k) for k in ("NONE_HASH", "_NONE_HASH_SEED") if hasattr(K, k)}
    old_seed = os.environ.get("PYTHONHASHSEED")
    yield
    for k, v in saved.items():
        setattr(K, k, v)
    if old_seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = old_seed


def vllm_request(algo: str, pythonhashseed: str | None, bs: int, tokens: list[int] | None, *,
                 lora: LoraSpec | None = None, salt: str | None = None,
                 mm: list[MMItem] = (), embeds=None, lookahead: int = 0) -> Request:
    if pythonhashseed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = pythonhashseed
    fn = get_hash_fn_by_name(algo)
    K.init_none_hash(fn)
    hasher = K.get_request_block_hasher(bs, fn, num_hash_lookahead_tokens=lookahead)
    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=m.identifier,
                                   mm_position=PlaceholderRange(offset=m.offset,
                                                                length=m.length),
                                   mm_hash=m.identifier) for m in mm]
    return Request(
        request_id="r", prompt_token_ids=tokens, prompt_embeds=embeds,
        sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
        lora_request=(LoRARequest(lora_name=lora.name, lora_int_id=lora.int_id or 1,
                                  lora_path=lora.path) if lora else None),
        cache_salt=salt, mm_features=feats or None, block_hasher=hasher)


@st.composite
def mm_items(draw, n_tokens: int) -> list[MMItem]:
    """Sorted, non-overlapping placeholder ranges (what vLLM's processors produce)."""
    items, pos = [], draw(st.integers(0, max(0, n_tokens // 2)))
    for _ in range(draw(st.integers(0, 4))):
        length = draw(st.integers(1, 40))
        if pos + length > n_tokens:
            break
        ident = draw(st.sampled_from(["a", "img", "deadbeef" * 4])) + draw(name)
        items.append(MMItem(ident, pos, length))
        pos += length + draw(st.sampled_from([0, 0, 1, 7, 16]))
    return items


@LIVE
@given(algo=st.sampled_from(ALGORITHMS), pythonhashseed=seed, bs=st.integers(1, 33),
       data=st.data())
def test_random_requests_match_vllm(algo, pythonhashseed, bs, data) -> None:
    prompt = data.draw(st.lists(token, max_size=6 * bs + 3))
    lora = data.draw(st.none() | st.builds(LoraSpec, name, name, st.integers(1, 9)))
    salt = data.draw(st.none() | st.sampled_from(["", "s"]) | name)
    mm = data.draw(mm_items(len(prompt)))
    appends = data.draw(st.lists(st.lists(token, min_size=1, max_size=2 * bs), max_size=4))

    req = vllm_request(algo, pythonhashseed, bs, list(prompt), lora=lora, salt=salt, mm=mm)
    ours = BlockKeyHasher(cfg(algo, bs, pythonhashseed), prompt, lora=lora, mm=mm,
                          cache_salt=salt)
    assert ours.none_hash == K.NONE_HASH
    assert ours.keys == req.block_hashes
    for chunk in appends:
        before = len(req.block_hashes)
        req.append_output_token_ids(list(chunk))
        assert ours.extend(chunk) == req.block_hashes[before:]
        assert ours.keys == req.block_hashes
    # incremental == from scratch (0.31+), and == vLLM
    all_tokens = list(prompt) + [t for c in appends for t in c]
    assert block_keys(all_tokens, cfg(algo, bs, pythonhashseed), lora=lora, mm=mm,
                      cache_salt=salt) == req.block_hashes


@LIVE
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 17),
       lookahead=st.integers(1, 3), data=st.data())
def test_lookahead_keys_match_vllm(algo, bs, lookahead, data) -> None:
    prompt = data.draw(st.lists(token, max_size=5 * bs + 4))
    mm = data.draw(mm_items(len(prompt)))
    lora = data.draw(st.none() | st.builds(LoraSpec, name, name))
    appends = data.draw(st.lists(st.lists(token, min_size=1, max_size=bs + 2), max_size=3))
    req = vllm_request(algo, "0", bs, list(prompt), lora=lora, mm=mm, lookahead=lookahead)
    ours = BlockKeyHasher(cfg(algo, bs, lookahead=lookahead), prompt, lora=lora, mm=mm)
    assert ours.keys == req.block_hashes
    for chunk in appends:
        req.append_output_token_ids(list(chunk))
        ours.extend(chunk)
        assert ours.keys == req.block_hashes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 9), rows=st.integers(0, 40),
       cols=st.integers(1, 6), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       appends=st.lists(st.integers(0, 300), max_size=12))
def test_prompt_embeds_match_vllm(algo, bs, rows, cols, dtype, appends) -> None:
    gen = torch.Generator().manual_seed(rows * 31 + cols)
    embeds = torch.randn(max(rows, 1), cols, generator=gen).to(getattr(torch, dtype))
    req = vllm_request(algo, "0", bs, None, embeds=embeds)
    pe = PromptEmbeds(bytes(tensor_data(embeds)), cols * embeds.element_size())
    ours = BlockKeyHasher(cfg(algo, bs), [0] * embeds.shape[0], prompt_embeds=pe)
    assert ours.keys == req.block_hashes
    req.append_output_token_ids(list(appends))
    ours.extend(appends)
    assert ours.keys == req.block_hashes


def test_token_id_bound_is_the_releases() -> None:
    """The release's Request holds ``MAX_ID`` and, below this library's own bound, refuses the
    next id -- in the prompt and in a decode append -- as pdpatch does for that release."""
    req = vllm_request("sha256", "0", 1, [MAX_ID])
    req.append_output_token_ids([MAX_ID])
    ours = BlockKeyHasher(cfg("sha256", 1), [MAX_ID])
    ours.extend([MAX_ID])
    assert ours.keys == req.block_hashes
    if MAX_ID == 2**64 - 1:
        return
    with pytest.raises(OverflowError):
        vllm_request("sha256", "0", 1, [1, MAX_ID + 1])
    with pytest.raises(OverflowError):
        vllm_request("sha256", "0", 1, [1]).append_output_token_ids([MAX_ID + 1])
    with pytest.raises(InputError, match="int32"):
        BlockKeyHasher(cfg("sha256", 1), [1, MAX_ID + 1])
    with pytest.raises(InputError, match="int32"):
        BlockKeyHasher(cfg("sha256", 1), [1]).extend([MAX_ID + 1])


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_default_seed_matches_vllm(algo: str) -> None:
    toks = list(range(1000, 1100))
    req = vllm_request(algo, None, 16, toks)
    assert K.get_none_hash_seed() == "vllm-none-hash"
    assert block_keys(toks, cfg(algo, 16, None)) == req.block_hashes


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_reported_none_hash_reproduces_a_random_seed(algo: str) -> None:
    """A peer that reports its in-process NONE_HASH (even a random one) can be reproduced."""
    toks = list(range(50))
    req = vllm_request(algo, None, 8, toks)
    assert block_keys(toks, cfg(algo, 8, None, none_hash=K.NONE_HASH)) == req.block_hashes


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_coarse_event_ints_and_event_extra_keys_match_vllm(algo: str) -> None:
    toks = [(i * 7919) % 200000 for i in range(200)]
    lora, mm = LoraSpec("ad", "/p/ad"), [MMItem("img" + "x" * 5, 3, 40)]
    req = vllm_request(algo, "0", 8, toks, lora=lora, salt="t", mm=mm)
    ours = BlockKeyHasher(cfg(algo, 8), toks, lora=lora, mm=mm, cache_salt="t")
    assert ours.keys == req.block_hashes
    for factor in (2, 3, 5):
        view = K.BlockHashListWithBlockSize(req.block_hashes, 8, 8 * factor)
        assert coarse_keys(ours.keys, factor, VERSION) == list(view)
    assert [to_event_int(k) for k in ours.keys] == \
        [K.maybe_convert_block_hash(k) for k in req.block_hashes]
    extras, idx = [], 0
    for s in range(0, len(req.block_hashes) * 8, 8):
        e, idx = K.generate_block_hash_extra_keys(req, s, s + 8, idx)
        extras.append(e)
    assert ours.extras_for(0, len(ours.keys)) == extras
    assert to_event_extra_keys(ours.extras_for(0, len(ours.keys))) == \
        K.to_event_extra_keys(extras)


@LIVE
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 20), data=st.data())
def test_request_adapter_reads_real_requests(algo, bs, data) -> None:
    """hasher_for_request(real Request) == the request's own prompt block hashes."""
    prompt = data.draw(st.lists(st.integers(0, 262143), max_size=5 * bs + 3))
    lora = data.draw(st.none() | st.builds(LoraSpec, name, name, st.integers(1, 9)))
    salt = data.draw(st.none() | name)
    mm = data.draw(mm_items(len(prompt)))
    req = vllm_request(algo, "0", bs, list(prompt), lora=lora, salt=salt, mm=mm)
    config = cfg(algo, bs)
    req.append_output_token_ids([1, 2, 3])  # P has sampled a token: not part of the prompt
    prompt_blocks = len(prompt) // bs
    assert hasher_for_request(config, req).keys == req.block_hashes[:prompt_blocks]


@LIVE
@given(algo=st.sampled_from(ALGORITHMS), bs=st.integers(1, 9), data=st.data())
def test_request_adapter_prefix_keeps_the_releases_keys(algo, bs, data) -> None:
    """The first ``upto`` prompt tokens (what a prefill engine that stops short computes, or what
    a decode engine loads): multimodal items cut there and embeddings to its rows give the
    release's own keys of the blocks before it."""
    from pdpatch.hashing.request_adapter import prompt_tokens, request_inputs

    n = data.draw(st.integers(1, 6 * bs + 3))
    prompt = data.draw(st.lists(st.integers(0, 262143), min_size=n, max_size=n))
    mm = data.draw(mm_items(n))
    upto = data.draw(st.integers(1, n))
    req = vllm_request(algo, "0", bs, list(prompt), mm=mm, lora=LoraSpec("ad", "/ad"))
    h = cfg(algo, bs).hasher(prompt_tokens(req, upto), **request_inputs(req, upto=upto))
    assert h.keys == req.block_hashes[:upto // bs]
    assert all(i.offset + i.length <= upto for i in h.extra.mm)
    embeds = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3).to(torch.bfloat16)
    req = vllm_request(algo, "0", bs, None, embeds=embeds)
    h = cfg(algo, bs).hasher(prompt_tokens(req, upto), **request_inputs(
        req, upto=upto, embeds_bytes=lambda t: bytes(tensor_data(t))))
    assert h.keys == req.block_hashes[:upto // bs]


def test_request_adapter_prompt_embeds() -> None:
    embeds = torch.arange(24 * 3, dtype=torch.float32).reshape(24, 3).to(torch.bfloat16)
    req = vllm_request("sha256", "0", 4, None, embeds=embeds)
    config = cfg("sha256", 4)
    with pytest.raises(ValueError, match="embeds_bytes"):
        hasher_for_request(config, req)
    h = hasher_for_request(config, req, embeds_bytes=lambda t: bytes(tensor_data(t)))
    assert h.keys == req.block_hashes


def test_key_params_between_real_requests() -> None:
    """P's params (built from its real Request) checked by D against D's real Request."""
    toks = [(i * 104729) % 151000 for i in range(300)]
    lora = LoraSpec("ad", "/adapters/ad")
    p_cfg = cfg("xxhash_cbor", 16)
    p_req = vllm_request("xxhash_cbor", "0", 16, toks, lora=lora, salt="t")
    params = json.loads(json.dumps(build_params(hasher_for_request(p_cfg, p_req))))
    peer = parse_params(params)
    d_req = vllm_request("xxhash_cbor", "0", 16, list(toks), lora=lora, salt="t")
    assert compare(hasher_for_request(p_cfg, d_req), peer) == []
    other_salt = vllm_request("xxhash_cbor", "0", 16, list(toks), lora=lora, salt="u")
    assert compare(hasher_for_request(p_cfg, other_salt), peer) == ["cache_salt"]
    d_cfg = cfg("xxhash_cbor", 16, "1")
    assert compare(hasher_for_request(d_cfg, d_req), peer) == ["seed"]


@pytest.mark.parametrize("algo", ALGORITHMS)
def test_string_identity_what_a_router_must_do(algo: str) -> None:
    """The same image twice in one block: vLLM holds two identifier objects (computed per item,
    or decoded from the request's JSON), and so does ``pdpatch hash`` (its JSON input); one
    shared object gives other keys under the pickle algorithms only."""
    import io
    import sys as _sys

    from pdpatch.hashing import commands

    toks = [(i * 7919) % 150000 for i in range(64)]
    ident = "0123456789abcdef" * 4
    fresh = [MMItem("".join(list(ident)), 2, 4), MMItem("".join(list(ident)), 8, 4)]
    req = vllm_request(algo, "0", 16, toks, mm=fresh, lora=LoraSpec("ad", "/ad"))
    doc = json.dumps({"prompt_token_ids": toks, "lora": {"name": "ad", "path": "/ad"},
                      "mm": [{"identifier": ident, "offset": 2, "length": 4},
                             {"identifier": ident, "offset": 8, "length": 4}]})
    out, old = io.StringIO(), (_sys.stdin, _sys.stdout)
    _sys.stdin, _sys.stdout = io.StringIO(doc), out
    try:
        assert commands.main(["hash", "--vllm-version", VERSION, "--algo", algo,
                              "--block-size", "16", "--seed", "0"]) == 0
    finally:
        _sys.stdin, _sys.stdout = old
    assert out.getvalue().split() == [k.hex() for k in req.block_hashes]
    shared = [MMItem(ident, 2, 4), MMItem(ident, 8, 4)]
    differs = block_keys(toks, cfg(algo, 16), mm=shared,
                         lora=LoraSpec("ad", "/ad")) != req.block_hashes
    assert differs is (algo in ("sha256", "xxhash"))
