"""D's verdict on P's block keys: canonical keys, the engines' fingerprints and the comparison,
pure.

What P and D must agree on for D to use P's KV is the *request*: the prompt tokens and every
input that shapes its KV (LoRA adapter, multimodal items, prompt embeddings) plus its cache
salt.  How each engine *names* blocks in its own prefix cache -- its hash algorithm, its
NONE_HASH (random per engine for xxhash, and for every algorithm up to vLLM 0.28, when
``PYTHONHASHSEED`` is unset), its hash block size, its release's key format -- does not matter
for the transfer: vLLM moves KV by block id and D caches the loaded blocks under its own names.

So both sides compute *canonical* keys: vLLM's block-key chain (:mod:`pdpatch.hashing.keys`)
with one fixed configuration -- :data:`CANONICAL_ALGO`, :data:`CANONICAL_FORMAT`'s key format and
a NONE_HASH that is pdpatch's own constant -- at P's hash block size, over each side's own
tokens and extra-key inputs.  Equal keys mean the same request, whatever the engines' seeds and
algorithms.  The keys are a function of the inputs, so P sends the digests of each input
(``prompt``, ``lora``, ``cache_salt``, ``mm``, ``prompt_embeds``) and the number of blocks, and
the keys themselves only for short prompts (to name the first differing block): neither side
computes the key chain of a long prompt unless the digests differ.  The engines' own
fingerprints travel too, for the log only.

The ``block_keys`` patch (:mod:`pdpatch.patches.block_keys`) translates vLLM's objects into these
(an :class:`EngineKeys` per engine, a :class:`RequestInputs` per request) and acts on the
:class:`Verdict`.  Nothing here imports vLLM, so every cause is tested without an engine.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdpatch.hashing.algorithms import get_algorithm
from pdpatch.hashing.config import KeyConfig
from pdpatch.hashing.errors import UnreproducibleSeedError
from pdpatch.hashing.fingerprint import Fingerprint, fingerprint_diff, fingerprint_of
from pdpatch.hashing.formats import HashFormat, format_for
from pdpatch.hashing.key_params import (
    PeerBlockKeys,
    build_params,
    compare,
    digest_params,
    input_causes,
    request_summary,
    summary_of,
)
from pdpatch.hashing.keys import BlockKeyHasher, hashed_inputs
from pdpatch.hashing.seed import derive_none_hash

CANONICAL_ALGO = "sha256_cbor"
"""Deterministic on every Python (CBOR, no pickle protocol) and collision resistant."""
CANONICAL_FORMAT = "0.33.0"
"""The key format of the canonical keys: the newest, which hashes the most of each input (the
LoRA path as well as its name)."""
CANONICAL_NONE_HASH = derive_none_hash(get_algorithm(CANONICAL_ALGO), "pdpatch/block-keys/v2")
_CANONICAL_FMT = format_for(CANONICAL_FORMAT)


@functools.cache
def canonical_config(hash_block_size: int) -> KeyConfig:
    """The configuration of canonical keys at ``hash_block_size`` (no seed: its own NONE_HASH);
    one per size, shared (a frozen ``KeyConfig`` takes ~10 us to validate, on D's check of
    every request)."""
    return KeyConfig(vllm_version=CANONICAL_FORMAT, algo=CANONICAL_ALGO,
                     hash_block_size=hash_block_size, pythonhashseed=None,
                     none_hash=CANONICAL_NONE_HASH)


@functools.cache
def _canonical_fingerprint(hash_block_size: int) -> Fingerprint:
    return fingerprint_of(canonical_config(hash_block_size).validate())


def canonical_blocks(num_tokens: int, hash_block_size: int) -> int:
    """How many canonical keys a prompt of ``num_tokens`` tokens has (full blocks only)."""
    return max(0, num_tokens - canonical_config(hash_block_size).lookahead) // hash_block_size


@dataclass(frozen=True)
class EngineKeys:
    """How one engine names blocks in its prefix cache (logged at start and sent along)."""

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
                         vllm_version=vllm_version, pythonhashseed=pythonhashseed,
                         none_hash=none_hash, lookahead=lookahead).validate()
        fp = fingerprint_of(live)
        label = "random" if derived is None else "reported"
    return EngineKeys(fp, format_for(vllm_version), label)


@dataclass(frozen=True)
class RequestInputs:
    """One request's prompt tokens and extra-key inputs (``lora``, ``mm``, ``cache_salt``,
    ``prompt_embeds``, as :func:`pdpatch.hashing.request_adapter.request_inputs` reads them)."""

    tokens: Sequence[int]
    inputs: Mapping[str, Any]

    def canonical(self, hash_block_size: int) -> BlockKeyHasher:
        """The request's canonical keys at ``hash_block_size``."""
        return canonical_config(hash_block_size).hasher(self.tokens, **self.inputs)

    def summary(self) -> dict[str, Any]:
        """The digests of the request's inputs as canonical keys hash them (no key chain)."""
        return summary_of(*hashed_inputs(_CANONICAL_FMT, self.tokens, **self.inputs))


def canonical_params(req: RequestInputs, hash_block_size: int, include_keys: int
                     ) -> dict[str, Any]:
    """P's canonical keys at ``hash_block_size`` as sent: the digests of each input and the
    number of blocks; for prompts of at most ``include_keys`` blocks the keys themselves and
    their digest too.  A longer prompt's key chain is not computed (P would compute it on the
    path of the request's first token): D decides from the digests as from the keys."""
    summary = req.summary()
    blocks = canonical_blocks(summary["nt"], hash_block_size)
    if 0 < blocks <= include_keys:
        return build_params(req.canonical(hash_block_size), include_keys=include_keys)
    return digest_params(_canonical_fingerprint(hash_block_size).to_dict(), blocks, summary)


def build_p_params(engine: EngineKeys, req: RequestInputs, include_keys: int) -> dict[str, Any]:
    """What P sends D (JSON-able, bounded): :func:`canonical_params` at P's hash block size
    and P's own fingerprint for the log."""
    return with_engine(engine, canonical_params(req, engine.hash_block_size, include_keys))


def with_engine(engine: EngineKeys, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` (from :func:`canonical_params`) with P's own fingerprint added."""
    params["efp"] = engine.compact
    return params


@dataclass(frozen=True)
class Verdict:
    status: str                     # match | mismatch | rejected
    causes: tuple[str, ...] = ()
    detail: str = ""
    naming: tuple[str, ...] = ()
    """How the engines' own block names differ (``seed``, ``algo``, ...): harmless for the
    transfer, worth one line in the log."""


_CANONICAL_FIELDS = ("algo", "nh", "kf", "vllm", "la")


@functools.cache
def _canonical_probe() -> dict[str, Any]:
    return fingerprint_of(canonical_config(1).validate()).to_dict()


def is_canonical(fingerprint: Mapping[str, Any]) -> bool:
    """Whether ``fingerprint`` describes canonical keys (at any hash block size)."""
    probe = _canonical_probe()
    return all(fingerprint.get(k) == probe[k] for k in _CANONICAL_FIELDS)


def same_request(req: RequestInputs, peer: PeerBlockKeys) -> bool:
    """Whether P's params describe ``req``, decided from the input digests alone.

    Canonical keys are a function of the request's inputs (tokens, LoRA, salt, multimodal
    items, embeddings) and of the canonical configuration at P's hash block size.  Equal
    input digests therefore mean equal keys -- and they cover the partial last block, which
    keys do not -- so :func:`judge` need not compute D's key chain (the work a request waits
    for on D's scheduler) to find a match; it does where a digest or the block count differs,
    to name the cause and the first differing block."""
    mine = req.summary()
    return peer.num_blocks == canonical_blocks(mine["nt"], peer.fingerprint["hbs"]) \
        and not input_causes(mine, peer.summary)


def judge(engine: EngineKeys | None, req: RequestInputs, peer: PeerBlockKeys) -> Verdict:
    """Compare D's request with P's validated params: D's canonical keys at P's hash block
    size against P's.  A mismatch names the inputs that differ (``keys`` when no digest
    explains it); the engines' naming differences are reported apart, never as causes
    (``engine``: D's own fingerprint, None where it is not known yet)."""
    if not is_canonical(peer.fingerprint):
        return Verdict("rejected", ("malformed",),
                       "the keys P sent are not pdpatch's canonical block keys")
    naming = tuple(fingerprint_diff(engine.compact, peer.engine)) \
        if engine is not None and peer.engine else ()
    if same_request(req, peer):
        return Verdict("match", naming=naming)
    mine = req.canonical(peer.fingerprint["hbs"])
    # never empty here: a digest or the block count differs
    causes = compare(mine, peer) or input_causes(request_summary(mine), peer.summary)
    detail = f"P: {peer.num_blocks} prompt blocks, D: {len(mine.keys)}"
    first = first_difference(mine.keys, peer.keys)
    if first is not None:
        detail += f", first differing block {first}"
    return Verdict("mismatch", tuple(causes), detail, naming)


def first_difference(mine: Sequence[bytes], theirs: Sequence[bytes] | None) -> int | None:
    if theirs is None:
        return None
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if a != b:
            return i
    return None if len(mine) == len(theirs) else min(len(mine), len(theirs))
