"""Block keys of a request, computed as vLLM's request block hasher computes them.

``H_i = F((H_{i-1}, tuple(tokens[i*B:(i+1)*B]), E_i))`` with ``H_{-1} = NONE_HASH``, for full
blocks only, at ``B = hash_block_size`` (which is *not* ``--block-size`` for hybrid models: see
:func:`coarse_keys`).

:class:`BlockKeyHasher` mirrors a vLLM ``Request``: the constructor is the hasher call vLLM makes
when the request is created (over the prompt), every :meth:`BlockKeyHasher.extend` is the call
``append_output_token_ids`` makes.  Keys from one call over all tokens equal keys built up
incrementally, except where vLLM itself differs (multimodal blocks completed during decode on
releases <= 0.30, reproduced as vLLM computes them).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pdpatch.hashing.algorithms import Algorithm, get_algorithm
from pdpatch.hashing.encoders import chain
from pdpatch.hashing.errors import HashingError
from pdpatch.hashing.extra_keys import ExtraKeys, LoraSpec, MMItem, PromptEmbeds
from pdpatch.hashing.formats import HashFormat, format_for
from pdpatch.hashing.seed import ResolvedSeed, derive_none_hash, resolve_seed

EVENT_INT_MASK = (1 << 64) - 1


class BlockKeyHasher:
    """Incremental block keys of one request on one peer configuration.

    Args:
        algo: ``--prefix-caching-hash-algo`` of the peer.
        hash_block_size: the granularity vLLM hashes at (``--block-size`` for single-group
            models; see ``resolve_kv_cache_block_sizes``).
        vllm_version: the peer's release; selects extra-key shapes and seed rules.
        pythonhashseed: the peer EngineCore's raw PYTHONHASHSEED (None: unset).
        none_hash: use this NONE_HASH instead of deriving it (a peer that reported its own,
            e.g. read from ``kv_cache_utils.NONE_HASH`` in-process).
        lora, mm, cache_salt, prompt_embeds: the request's extra-key inputs.
        lookahead: vLLM 0.33's EAGLE lookahead tokens (0 whenever a KV connector is set).
        prompt: the prompt token ids (positions given as embeddings hold 0).
    """

    def __init__(self, *, algo: str = "sha256", hash_block_size: int = 16,
                 vllm_version: str | None = None, pythonhashseed: str | None = None,
                 none_hash: bytes | None = None, lora: LoraSpec | None = None,
                 mm: Sequence[MMItem] = (), cache_salt: str | None = None,
                 prompt_embeds: PromptEmbeds | None = None, lookahead: int = 0,
                 prompt: Iterable[int] = ()) -> None:
        self.format: HashFormat = format_for(vllm_version)
        if algo not in self.format.algorithms:
            raise HashingError(
                f"vLLM {self.format.release} has no '{algo}' block-hash algorithm "
                f"(it offers {', '.join(sorted(self.format.algorithms))})")
        self.algorithm: Algorithm = get_algorithm(algo)
        if not isinstance(hash_block_size, int) or hash_block_size < 1:
            raise HashingError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
        self.hash_block_size = hash_block_size
        if lookahead and not self.format.lookahead:
            raise HashingError(f"vLLM {self.format.release} has no lookahead block hashes (0.33+)")
        if lookahead < 0:
            raise HashingError("lookahead must be >= 0")
        self.lookahead = lookahead
        self.seed: ResolvedSeed | None
        if none_hash is not None:
            if not isinstance(none_hash, bytes) or not none_hash:
                raise HashingError("none_hash must be non-empty bytes")
            self.seed = None
            self.none_hash = none_hash
        else:
            self.seed = resolve_seed(self.algorithm, self.format, pythonhashseed)
            self.none_hash = derive_none_hash(self.algorithm, self.seed.seed)
        self.extra = ExtraKeys(self.format, lora=lora, mm=mm, cache_salt=cache_salt,
                               prompt_embeds=prompt_embeds)
        self.tokens: list[int] = []
        self.keys: list[bytes] = []
        self.extend(prompt)

    def extend(self, tokens: Iterable[int]) -> list[bytes]:
        """Append tokens (``Request.append_output_token_ids``) and return the new keys."""
        self.tokens.extend(tokens)
        new = self._call()
        self.keys.extend(new)
        return new

    def extras_for(self, start_block: int, count: int) -> list[Any]:
        """The extra keys vLLM attaches to blocks ``start_block .. start_block+count-1``
        when one hasher call starts at ``start_block``."""
        b = self.hash_block_size
        start = start_block * b
        ek = self.extra
        if ek.constant and not self.lookahead:
            base = tuple(ek.lora_keys) or None
            extras: list[Any] = [base] * count
            if start == 0 and count and ek.salt_keys(0):
                extras[0] = tuple(ek.lora_keys + ek.salt_keys(0))
            return extras
        extras = []
        mm_idx = ek.resume_index(start)
        la = self.lookahead
        toks = self.tokens
        for s in range(start, start + count * b, b):
            e = s + b
            if la:
                extra, mm_idx = ek.lookahead_block(s, e, e + la, mm_idx)
                extra = ((extra, operator.index(toks[e])) if la == 1
                         else (extra, *map(operator.index, toks[e:e + la])))
            else:
                extra, mm_idx = ek.block(s, e, mm_idx)
            extras.append(extra)
        return extras

    def _call(self) -> list[bytes]:
        """One ``request_block_hasher(request)`` call of vLLM."""
        b = self.hash_block_size
        done = len(self.keys)
        usable = len(self.tokens) - self.lookahead
        count = usable // b - done
        if count <= 0:
            return []
        extras = self.extras_for(done, count)
        parent = self.keys[-1] if self.keys else self.none_hash
        # from block 0 the chain reads the list in place (a 32k prompt is not copied again)
        tokens = self.tokens if not done else self.tokens[done * b:(done + count) * b]
        return chain(self.algorithm, parent, tokens, b, extras)


@dataclass(frozen=True)
class KeyConfig:
    """A peer's hashing configuration, resolved once (e.g. at engine start) and reused for
    every request: ``KeyConfig(...).hasher(prompt, lora=...)``."""

    algo: str = "sha256"
    hash_block_size: int = 16
    vllm_version: str | None = None
    pythonhashseed: str | None = None
    none_hash: bytes | None = None
    lookahead: int = 0

    def hasher(self, prompt: Iterable[int] = (), **request_inputs: Any) -> BlockKeyHasher:
        """A hasher for one request (``request_inputs``: lora, mm, cache_salt,
        prompt_embeds)."""
        return BlockKeyHasher(algo=self.algo, hash_block_size=self.hash_block_size,
                              vllm_version=self.vllm_version,
                              pythonhashseed=self.pythonhashseed, none_hash=self.none_hash,
                              lookahead=self.lookahead, prompt=prompt, **request_inputs)

    def validate(self) -> BlockKeyHasher:
        """Raise now (HashingError, UnreproducibleSeedError, XxhashUnavailableError) what every
        request would raise later; returns an empty hasher (for the fingerprint)."""
        return self.hasher()


def block_keys(tokens: Iterable[int], **kwargs: Any) -> list[bytes]:
    """Keys of every full block of ``tokens`` (one hasher call, as at request creation).

    Takes the keyword arguments of :class:`BlockKeyHasher`.
    """
    return BlockKeyHasher(prompt=tokens, **kwargs).keys


def to_event_int(key: bytes) -> int:
    """The KV-event form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default): the low 64
    bits, i.e. the last 8 bytes big-endian."""
    return int.from_bytes(key, "big") & EVENT_INT_MASK


def with_group_id(key: bytes, group_id: int) -> bytes:
    """vLLM's block-pool key ``BlockHashWithGroupId``: key + 4-byte big-endian group id."""
    return key + operator.index(group_id).to_bytes(4, "big", signed=False)


def coarse_keys(fine_keys: Sequence[bytes], factor: int, vllm_version: str | None = None
                ) -> list[bytes]:
    """Keys of a KV-cache group whose block size is ``factor * hash_block_size``
    (``BlockHashListWithBlockSize``): the last fine key of each full coarse block (0.24+), or
    the concatenation of its fine keys (0.12-0.23).  The KV-event ints agree in both cases."""
    fmt = format_for(vllm_version)
    if not isinstance(factor, int) or factor < 1:
        raise HashingError(f"factor must be a positive int, got {factor!r}")
    if factor == 1:
        return list(fine_keys)
    if fmt.coarse_view == "none":
        raise HashingError(f"vLLM {fmt.release} has a single hash block size (0.12+ only)")
    n = len(fine_keys) // factor
    if fmt.coarse_view == "last":
        return [fine_keys[(j + 1) * factor - 1] for j in range(n)]
    return [b"".join(fine_keys[j * factor:(j + 1) * factor]) for j in range(n)]
