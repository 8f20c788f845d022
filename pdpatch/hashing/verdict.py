"""D's verdict on P's block keys: the engines' fingerprints and the comparison, pure.

The ``block_keys`` patch (:mod:`pdpatch.patches.block_keys`) translates vLLM's objects into
these (an :class:`EngineKeys` per engine, a :class:`RequestKeys` per request) and acts on the
:class:`Verdict`.  Nothing here imports vLLM, so every cause is tested without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdpatch.hashing.errors import UnreproducibleSeedError
from pdpatch.hashing.extra_keys import ExtraKeys
from pdpatch.hashing.fingerprint import Fingerprint, fingerprint_diff, fingerprint_of
from pdpatch.hashing.formats import HashFormat, format_for
from pdpatch.hashing.keys import KeyConfig
from pdpatch.hashing.peer_check import (
    PeerBlockKeys,
    keys_digest,
    params_for_keys,
    request_summary_of,
)


@dataclass(frozen=True)
class EngineKeys:
    """How one engine computes block keys: what it sends and what it compares with."""

    fingerprint: Fingerprint
    fmt: HashFormat
    seed_label: str
    """For the log: ``PYTHONHASHSEED`` / ``default`` (0.29+ "vllm-none-hash") / ``random``
    (vLLM drew NONE_HASH from os.urandom: no peer can share it)."""

    @property
    def compact(self) -> dict[str, Any]:
        return self.fingerprint.to_dict()

    @property
    def hash_block_size(self) -> int:
        return self.fingerprint.hash_block_size

    def describe(self) -> str:
        fp = self.compact
        return (f"algo={fp['algo']} seed={self.seed_label} none_hash_id={fp['nh']} "
                f"hash_block_size={fp['hbs']} key_format={fp['kf']} vllm={fp['vllm']} "
                f"pickle_protocol={fp['pp']} lookahead={fp['la']}")


def engine_keys(*, algo: str, hash_block_size: int, vllm_version: str, none_hash: bytes,
                pythonhashseed: str | None, lookahead: int = 0) -> EngineKeys:
    """The fingerprint of an engine whose live NONE_HASH is ``none_hash``.

    The seed source is the one that reproduces ``none_hash`` (PYTHONHASHSEED, or 0.29+'s
    default); anything else -- a random seed, or an environment changed since the engine
    started -- is reported as the live value alone.  Raises ``HashingError`` for a
    configuration vLLM itself would reject (an algorithm the release does not have).
    """
    cfg = KeyConfig(algo=algo, hash_block_size=hash_block_size, vllm_version=vllm_version,
                    pythonhashseed=pythonhashseed, lookahead=lookahead)
    try:
        derived = cfg.validate()
    except UnreproducibleSeedError:
        derived = None
    if derived is not None and derived.none_hash == none_hash:
        fp = fingerprint_of(derived)
        label = fp.seed_source
    else:
        live = KeyConfig(algo=algo, hash_block_size=hash_block_size,
                         vllm_version=vllm_version, none_hash=none_hash,
                         lookahead=lookahead).validate()
        fp = fingerprint_of(live)
        label = "random" if derived is None else "reported"
    return EngineKeys(fp, format_for(vllm_version), label)


@dataclass(frozen=True)
class RequestKeys:
    """One request as an engine hashed it: its prompt-block keys and hashing inputs."""

    keys: Sequence[bytes]
    tokens: Sequence[int]
    extra: ExtraKeys


def prompt_block_count(num_block_hashes: int, num_prompt_tokens: int, hbs: int) -> int:
    """Keys that cover the prompt only (P's ``block_hashes`` may already include a block its
    first generated token completed; D's never does at this point)."""
    return min(num_block_hashes, num_prompt_tokens // hbs)


def build_p_params(engine: EngineKeys, req: RequestKeys, include_keys: int) -> dict[str, Any]:
    """What P sends D (JSON-able, bounded): the keys themselves for prompts of at most
    ``include_keys`` blocks, the digest always."""
    return params_for_keys(engine.compact, req.keys, request_summary_of(req.tokens, req.extra),
                           include_keys=include_keys)


@dataclass(frozen=True)
class Verdict:
    status: str                     # match | mismatch | rejected
    causes: tuple[str, ...] = ()
    detail: str = ""


def judge(engine: EngineKeys, req: RequestKeys, peer: PeerBlockKeys) -> Verdict:
    """Compare D's view of a request with P's validated params.

    Mismatch when the keys differ, or -- even where the keys agree, e.g. a prompt shorter than
    one hash block -- when the configurations differ (algo, seed, hash block size, pickle
    protocol, lookahead) or a hashing input differs (prompt incl. its partial last block, LoRA,
    salt, multimodal, embeddings).  A different vLLM key format alone is no cause while the
    keys agree: for a plain prompt every release since 0.10.2 builds the same keys.

    A different hash block size is no cause either: vLLM's NIXL connector pairs engines with
    different block sizes (``block_size_ratio``), and keys hashed at different granularities
    cannot be compared one by one.  What decides the keys at any granularity -- algorithm,
    NONE_HASH, pickle protocol, lookahead and every hashing input -- is still compared, so
    such a pair matches exactly when D's keys are the ones P would compute at D's block size.
    """
    keys = req.keys
    keys_equal = (len(keys) == peer.num_blocks and keys_digest(keys) == peer.keys_digest
                  and (peer.keys is None or tuple(keys) == peer.keys))
    causes = fingerprint_diff(engine.compact, peer.fingerprint)
    if keys_equal and "key_format" in causes:
        causes.remove("key_format")
    regrouped = "hash_block_size" in causes
    if regrouped:
        causes.remove("hash_block_size")
    formats_differ = engine.compact["kf"] != peer.fingerprint["kf"]
    mine, theirs = request_summary_of(req.tokens, req.extra), peer.summary
    if mine["nt"] != theirs["nt"] or mine["td"] != theirs["td"]:
        causes.append("prompt")
    for key, cause in (("ld", "lora"), ("sd", "cache_salt"), ("md", "mm"),
                       ("ed", "prompt_embeds")):
        if key in ("ld", "sd") and formats_differ:
            continue                # shaped by the key format: not comparable across eras
        if mine[key] != theirs[key]:
            causes.append(cause)
    if not keys_equal and not causes and not regrouped:
        causes.append("keys")
    if not causes:
        return Verdict("match", detail=(
            f"P hashes every {peer.fingerprint['hbs']} tokens, D every "
            f"{engine.hash_block_size}: compared through the configuration and the hashing "
            "inputs" if regrouped else ""))
    detail = f"P: {peer.num_blocks} prompt blocks, D: {len(keys)}"
    first = first_difference(keys, peer.keys)
    if first is not None:
        detail += f", first differing block {first}"
    return Verdict("mismatch", tuple(causes), detail)


def first_difference(mine: Sequence[bytes], theirs: Sequence[bytes] | None) -> int | None:
    if theirs is None:
        return None
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return i
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))
