"""pdpatch.hashing against golden keys captured from REAL vLLM releases.

The files under tests/fixtures/hash/ are written by scripts/make_hash_fixtures.py, which runs
each release's own hashing code (Request, get_request_block_hasher, init_none_hash, ...).  No
vLLM import here: this is the check that covers the releases we cannot import in CI.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from pdpatch.hashing import (
    BlockKeyHasher,
    InputError,
    KeyConfig,
    LoraSpec,
    MMItem,
    PromptEmbeds,
    UnreproducibleSeedError,
    coarse_keys,
    format_for,
    to_event_extra_keys,
    to_event_int,
)

FIXTURES = Path(__file__).parent / "fixtures" / "hash"
# one release on each side of every change of the hashing rules
REQUIRED = ("0.10.2", "0.11.0", "0.11.1", "0.12.0", "0.13.0", "0.16.0", "0.17.0", "0.18.0",
            "0.19.0", "0.23.0", "0.24.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
            "0.33.0", "0.34.0")


@cache
def load(release: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"vllm-{release}.json").read_text())


def _cases() -> list[Any]:
    out = []
    for path in sorted(FIXTURES.glob("vllm-*.json")):
        release = path.stem.removeprefix("vllm-")
        for i, case in enumerate(load(release)["cases"]):
            out.append(pytest.param(release, i, id=f"{release}-{case['algo']}-{case['name']}"))
    return out


def embeds_of(spec: dict[str, int]) -> PromptEmbeds:
    """The fixture script's tensor, arange(rows*cols)/7 as float16, without torch: the float16
    rounding of k/7 is computed with struct's IEEE half-precision format ('e')."""
    import struct

    rows, cols = spec["rows"], spec["cols"]
    values = [float(k) / 7 for k in range(rows * cols)]
    # torch computes k/7 in float32 and rounds to float16; float16(float32(x)) equals
    # float16(x) here (float32 keeps 24 bits, far more than half's 11)
    data = struct.pack(f"<{len(values)}e", *values)
    return PromptEmbeds(data, cols * 2)


def hasher_for(release: str, case: dict[str, Any]) -> BlockKeyHasher:
    lora = case.get("lora")
    prompt = case["prompt"]
    pe = None
    if case.get("prompt_embeds"):
        pe = embeds_of(case["prompt_embeds"])
        prompt = [0] * case["prompt_embeds"]["rows"]
    config = KeyConfig(vllm_version=release, algo=case["algo"],
                       hash_block_size=case["block_size"], pythonhashseed=case["seed"],
                       lookahead=case.get("lookahead", 0))
    return BlockKeyHasher(
        config, prompt,
        lora=LoraSpec(lora["name"], lora["path"], lora["id"]) if lora else None,
        mm=[MMItem(i, o, n) for i, o, n in case.get("mm") or []],
        cache_salt=case.get("cache_salt"), prompt_embeds=pe)


def test_every_boundary_release_has_fixtures() -> None:
    missing = [r for r in REQUIRED if not (FIXTURES / f"vllm-{r}.json").is_file()]
    assert not missing, f"run scripts/make_hash_fixtures.py {' '.join(missing)}"
    for r in REQUIRED:
        data = load(r)
        assert data["vllm"].split("+")[0] == r
        assert data["generated_by"] == "scripts/make_hash_fixtures.py"
        assert len(data["cases"]) >= 40


@pytest.mark.parametrize(("release", "index"), _cases())
def test_case_matches_real_vllm(release: str, index: int) -> None:
    case = load(release)["cases"][index]
    h = hasher_for(release, case)
    assert h.none_hash.hex() == case["none_hash"]
    assert len(h.keys) == case["keys_after_prompt"]
    for chunk in case.get("appends", []):
        h.extend(chunk)
    assert [k.hex() for k in h.keys] == case["keys"]
    if "event_ints" in case:
        assert [to_event_int(k) for k in h.keys] == case["event_ints"]
    for factor, expected in case.get("coarse", {}).items():
        assert [k.hex() for k in coarse_keys(h.keys, int(factor), release)] == expected
    if "event_extra_keys" in case:
        extras = h.extras_for(0, case["keys_after_prompt"])
        got = json.loads(json.dumps(to_event_extra_keys(extras)))
        assert got == case["event_extra_keys"]


@pytest.mark.parametrize("release", REQUIRED)
def test_unseeded_refusal_matches_vllm_randomness(release: str) -> None:
    """We refuse exactly where the real release drew a random NONE_HASH twice."""
    data = load(release)
    for algo, was_random in data["unseeded_random"].items():
        config = KeyConfig(vllm_version=release, algo=algo, hash_block_size=16,
                           pythonhashseed=None)
        if was_random:
            with pytest.raises(UnreproducibleSeedError, match="PYTHONHASHSEED"):
                config.validate()
        else:
            h = config.validate()
            unset = [c for c in data["cases"] if c["algo"] == algo and c["seed"] is None]
            assert unset and h.none_hash.hex() == unset[0]["none_hash"]


@pytest.mark.parametrize("release", [r for r in REQUIRED if "max_token_id" in load(r)])
def test_token_id_bound_is_the_releases(release: str) -> None:
    """The largest token id the release's own Request held when its fixture was made (0.34:
    int32) is the bound pdpatch refuses past; every id in its cases is within it."""
    bound = load(release)["max_token_id"]
    assert format_for(release).max_token_id == bound
    ids = [t for c in load(release)["cases"]
           for t in [*(c["prompt"] or []), *(t for a in c.get("appends", []) for t in a)]]
    assert max(ids) <= bound
    config = KeyConfig(vllm_version=release, algo="sha256", hash_block_size=1, pythonhashseed="0")
    if bound < 2**64 - 1:
        with pytest.raises(InputError, match="int32"):
            BlockKeyHasher(config, [1, bound + 1])
        with pytest.raises(InputError, match="int32"):
            BlockKeyHasher(config, [1]).extend([bound + 1])
    assert len(BlockKeyHasher(config, [bound]).keys) == 1


@pytest.mark.parametrize("release", REQUIRED)
def test_algorithms_offered_match(release: str) -> None:
    assert sorted(format_for(release).algorithms) == sorted(load(release)["algorithms"])


def test_fixtures_cover_every_integer_width() -> None:
    """The replayed inputs exercise every CBOR / pickle integer encoding width."""
    tokens = {t for c in load("0.33.0")["cases"] for t in (c["prompt"] or [])}
    widths = [(0, 23), (24, 255), (256, 65535), (65536, 2**31 - 1), (2**31, 2**32 - 1),
              (2**32, 2**64 - 1)]
    for lo, hi in widths:
        assert any(lo <= t <= hi for t in tokens), (lo, hi)
