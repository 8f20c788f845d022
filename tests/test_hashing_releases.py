"""pdpatch.hashing against the REAL block hasher of every vLLM release 0.10.2-0.34, live.

Every run draws fresh random requests for each release -- every algorithm it offers, every
extra-key kind (LoRA, multimodal items, cache salt, prompt embeddings), odd block sizes, every
integer width, seeds set and unset, decode appends (the releases' decode-time multimodal
quirks), coarse keys, KV-event ints and extra keys where the release has them -- runs them
through the release's own code (``tests/release_hashing.py``: a real ``Request`` with the
``get_request_block_hasher`` of the release's wheel source tree) and demands byte-identical
results from :mod:`pdpatch.hashing`.  All cases of one release run in one child process,
forked from a pool that imported the shared third-party packages once
(``tests/release_pool.py``): the newest patch release of every minor before 0.19 and the
installed release's own tree (``scripts/block_key_releases.txt``; 0.34.0, also checked in
process, with hypothesis, by ``test_hashing_vllm_live.py``) and those from 0.19 below it
(``lab/vllm_releases.txt``).  Token ids are drawn up to what each release's
``Request`` holds (0.34+: int32), and the release's own code says whether that is pdpatch's
bound for it.  The golden fixtures (``test_hashing_fixtures.py``) need no source tree.

A failure prints the release, the random seed of the run and the case as JSON.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from packaging.version import Version
from release_pool import run_releases
from versions_harness import REPO, SOURCES_ROOT, listed_releases

from pdpatch import vllm_sites
from pdpatch.hashing import (
    ALGORITHMS,
    BlockKeyHasher,
    InputError,
    KeyConfig,
    KeyConfigError,
    LoraSpec,
    MMItem,
    PromptEmbeds,
    UnreproducibleSeedError,
    coarse_keys,
    format_for,
    to_event_extra_keys,
    to_event_int,
)

CASES_PER_ALGO = 14
WIDTHS = [(0, 23), (24, 255), (256, 65535), (65536, 2**31 - 1), (2**31, 2**32 - 1),
          (2**32, 2**63 - 1), (2**63, 2**64 - 1)]
# strings a server could hold: one-character ones (shared objects in CPython when Latin-1),
# non-ASCII, long hex hashes; equal values recur so that two fields can hold equal strings
STRINGS = ["a", "é", "€", "img", "x" * 40, "0123456789abcdef" * 4, "tenant-ä", "l", "/p/a"]
EMBEDS_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}


def older_releases() -> list[str]:
    lines = (REPO / "scripts" / "block_key_releases.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


RELEASES = sorted(set(older_releases() + listed_releases()), key=Version)


def fetched(release: str) -> bool:
    return (SOURCES_ROOT / release / ".complete").exists()


# ---------------------------------------------------------------------------- random requests


def token(rng: random.Random, max_id: int) -> int:
    """A token id of a random width, of at most ``max_id`` (the release's bound)."""
    widths = [(lo, min(hi, max_id)) for lo, hi in WIDTHS if lo <= max_id]
    lo, hi = widths[min(int(rng.expovariate(0.7)), len(widths) - 1)]
    return rng.choice([lo, hi, rng.randint(lo, hi)])


def text(rng: random.Random) -> str:
    if rng.random() < 0.7:
        return rng.choice(STRINGS)
    return "".join(rng.choice("ab0é€\u4e2d-_/") for _ in range(rng.randint(1, 9)))


def mm_items(rng: random.Random, n: int, bs: int) -> list[list[Any]]:
    """Items in prompt order, touching or apart, often starting or ending on a block
    boundary (where the releases' strict and loose bounds differ)."""
    items, pos = [], rng.choice([0, rng.randint(0, max(0, n // 2)), bs])
    for _ in range(rng.randint(1, 4)):
        length = rng.choice([1, bs, 2 * bs, rng.randint(1, 3 * bs)])
        if rng.random() < 0.3:
            length = max(1, -(-(pos + 1) // bs) * bs - pos)  # end on a block boundary
        if pos + length > n:
            break
        items.append([text(rng), pos, length])
        pos += length + rng.choice([0, 0, 1, bs, rng.randint(0, 2 * bs)])
    return items


def decode_block_items(rng: random.Random, bs: int) -> tuple[int, list[list[Any]]]:
    """A prompt length and items such that the prompt's partial last block -- completed by
    decode tokens -- overlaps two items, or follows an item that ends exactly where it starts
    (where releases <= 0.30 key decode-completed blocks unlike a prompt block, and <= 0.18 unlike
    0.19+)."""
    start = rng.randint(1, 3) * bs
    n = start + rng.randint(2, bs - 1)
    a_off = rng.randint(0, start - 1)
    if rng.random() < 0.5:
        return n, [[text(rng), a_off, start - a_off]]
    return n, [[text(rng), a_off, start + 1 - a_off],
               [text(rng), start + 1, rng.randint(1, n - start - 1)]]


def random_case(rng: random.Random, algo: str, max_id: int) -> dict[str, Any]:
    bs = rng.choice([1, 2, 3, 4, 5, 7, 8, 16, 16, 16, 17, 32])
    n = rng.randint(0, 5 * bs + 6)
    case: dict[str, Any] = {
        "algo": algo, "block_size": bs,
        "seed": rng.choice(["0", "0", "", "random", "00", "12345", None]),
        "prompt": [token(rng, max_id) for _ in range(n)],
        "appends": [[token(rng, max_id) for _ in range(rng.randint(1, 2 * bs + 1))]
                    for _ in range(rng.choice([0, 1, 1, 2, 4]))],
        "event_ints": True, "coarse": [2, 3], "event_extra_keys": True,
    }
    if rng.random() < 0.4:
        case["lora"] = {"name": text(rng), "path": text(rng), "id": rng.randint(1, 9)}
    if rng.random() < 0.4:
        case["cache_salt"] = rng.choice(["", text(rng)])
    if rng.random() < 0.2:
        rows, cols = rng.randint(1, 4 * bs + 3), rng.randint(1, 5)
        dtype = rng.choice(list(EMBEDS_DTYPES))
        size = rows * cols * EMBEDS_DTYPES[dtype]
        case["prompt"] = None
        case["prompt_embeds"] = {"rows": rows, "cols": cols, "dtype": dtype,
                                 "hex": rng.randbytes(size).hex()}
    elif bs >= 3 and rng.random() < 0.15:
        n, case["mm"] = decode_block_items(rng, bs)
        case["prompt"] = [token(rng, max_id) for _ in range(n)]
        case["appends"].insert(0, [token(rng, max_id) for _ in range(bs)])
    elif n and rng.random() < 0.4:
        case["mm"] = mm_items(rng, n, bs)
    return case


def cases_for(rng: random.Random, release: str) -> list[dict[str, Any]]:
    """Random cases for ``release``, whose token ids pdpatch's rules bound (0.34+: int32), and
    where that bound is below this library's, one id just past it in a prompt and in a decode
    append: the release must refuse both, as pdpatch does."""
    max_id = format_for(release).max_token_id
    cases = [random_case(rng, algo, max_id) for algo in ALGORITHMS for _ in range(CASES_PER_ALGO)]
    if max_id < 2**64 - 1:
        base = {"algo": "sha256", "block_size": 2, "seed": "0"}
        cases.append({**base, "prompt": [1, max_id + 1], "appends": [], "refused": True})
        cases.append({**base, "prompt": [1, max_id], "appends": [[max_id + 1]], "refused": True})
    return cases


# ---------------------------------------------------------------------------- pdpatch's side


def ours(release: str, case: dict[str, Any]) -> dict[str, Any]:
    """What pdpatch computes for ``case`` (strings decoded from JSON, as vLLM's are)."""
    case = json.loads(json.dumps(case))
    config = KeyConfig(vllm_version=release, algo=case["algo"],
                       hash_block_size=case["block_size"], pythonhashseed=case["seed"])
    lora, embeds = case.get("lora"), case.get("prompt_embeds")
    prompt = case["prompt"]
    pe = None
    if embeds:
        pe = PromptEmbeds(bytes.fromhex(embeds["hex"]),
                          embeds["cols"] * EMBEDS_DTYPES[embeds["dtype"]])
        prompt = [0] * embeds["rows"]
    h = BlockKeyHasher(config, prompt,
                       lora=LoraSpec(lora["name"], lora["path"], lora["id"]) if lora else None,
                       mm=[MMItem(i, o, n) for i, o, n in case.get("mm") or []],
                       cache_salt=case.get("cache_salt"), prompt_embeds=pe)
    after_prompt = len(h.keys)
    for chunk in case["appends"]:
        h.extend(chunk)
    out = {"none_hash": h.none_hash.hex(), "keys": [k.hex() for k in h.keys],
           "keys_after_prompt": after_prompt, "event_ints": [to_event_int(k) for k in h.keys]}
    fmt = format_for(release)
    if fmt.coarse_view != "none":
        out["coarse"] = {str(f): [k.hex() for k in coarse_keys(h.keys, f, release)]
                         for f in case["coarse"]}
    if fmt.key_format == "0.31":
        extras = to_event_extra_keys(h.extras_for(0, after_prompt))
        out["event_extra_keys"] = json.loads(json.dumps(extras, default=lambda b: {
            "hex": b.hex()}))
    return out


# ---------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def runs() -> tuple[int, dict[str, Any], dict[str, Any]]:
    present = [v for v in RELEASES if fetched(v)]
    if not present:
        pytest.skip(f"no vLLM source tree under {SOURCES_ROOT} (scripts/fetch_vllm_sources.sh)")
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    payloads = {v: {"cases": cases_for(rng, v)} for v in present}
    return seed, payloads, run_releases(present, "release_hashing", "drive", payloads)


def test_every_minor_from_0_10_2_is_listed() -> None:
    """Every minor from 0.10 through the newest release pdpatch supports, once."""
    newest = vllm_sites.NEWEST_SUPPORTED.release[:2]
    minors = sorted(Version(v).release[:2] for v in RELEASES)
    assert minors == [(0, m) for m in range(10, newest[1] + 1)], minors
    assert RELEASES[0] == "0.10.2"


@pytest.mark.parametrize("release", RELEASES)
def test_random_requests_match_the_releases_own_hasher(release, runs) -> None:
    if not fetched(release):
        pytest.skip(f"vLLM {release} source tree not fetched (scripts/fetch_vllm_sources.sh)")
    seed, payloads, results = runs
    got = results[release].check()
    assert got["vllm"].split("+")[0] == release
    assert sorted(got["algorithms"]) == sorted(format_for(release).algorithms)
    # the largest token id the release's own Request holds is the bound pdpatch has for it
    assert got["max_token_id"] == format_for(release).max_token_id, got["max_token_id"]
    compared = 0
    for case, theirs in zip(payloads[release]["cases"], got["results"], strict=True):
        where = f"vLLM {release}, run seed {seed}, case {json.dumps(case)}"
        if case.get("refused"):
            assert "OverflowError" in theirs.get("error", ""), f"{where}: {theirs}"
            with pytest.raises(InputError, match="int32"):
                ours(release, case)
            continue
        assert "error" not in theirs, f"{where}: vLLM raised {theirs['error']}"
        if theirs.get("skipped"):
            if case["algo"] not in got["algorithms"]:
                with pytest.raises(KeyConfigError):
                    ours(release, case)
            continue
        if case["seed"] is None and got["unseeded_random"][case["algo"]]:
            with pytest.raises(UnreproducibleSeedError):
                ours(release, case)
            continue
        mine = ours(release, case)
        assert {k: theirs.get(k) for k in mine} == mine, where
        compared += 1
    # most cases of the release's algorithms compare keys (not only refusals and skips)
    offered = [c for c in payloads[release]["cases"]
               if c["algo"] in got["algorithms"] and not c.get("refused")]
    assert compared >= len(offered) // 4, (compared, len(offered))


@pytest.mark.parametrize("release", RELEASES)
def test_unset_seed_is_refused_exactly_where_the_release_is_random(release, runs) -> None:
    if not fetched(release):
        pytest.skip(f"vLLM {release} source tree not fetched (scripts/fetch_vllm_sources.sh)")
    got = runs[2][release].check()
    for algo, random_none_hash in got["unseeded_random"].items():
        config = KeyConfig(vllm_version=release, algo=algo, hash_block_size=16,
                           pythonhashseed=None)
        if random_none_hash:
            with pytest.raises(UnreproducibleSeedError):
                config.validate()
        else:
            assert config.validate().seed.source == "default"
