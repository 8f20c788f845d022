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
from typing import Any

from pdpatch.hashing.algorithms import Algorithm
from pdpatch.hashing.config import KeyConfig
from pdpatch.hashing.encoders import chain
from pdpatch.hashing.errors import InputError, KeyConfigError
from pdpatch.hashing.extra_keys import ExtraKeys, LoraSpec, MMItem, PromptEmbeds
from pdpatch.hashing.formats import HashFormat, format_for
from pdpatch.hashing.inputs import MAX_TOKEN_ID, token_ids
from pdpatch.hashing.seed import ResolvedSeed

EVENT_INT_MASK = (1 << 64) - 1


class BlockKeyHasher:
    """Incremental block keys of one request on one server configuration.

    Args:
        config: the server's :class:`KeyConfig` (release, algorithm, hash block size, seed).
        prompt: the prompt token ids (positions given as embeddings hold 0).
        lora, mm, cache_salt, prompt_embeds: the request's extra-key inputs.

    Raises :class:`~pdpatch.hashing.errors.InputError` for an input no server accepts and
    :class:`~pdpatch.hashing.errors.UnreproducibleSeedError` where the server's NONE_HASH is
    random.
    """

    def __init__(self, config: KeyConfig, prompt: Iterable[int] = (), *,
                 lora: LoraSpec | None = None, mm: Sequence[MMItem] | None = (),
                 cache_salt: str | None = None,
                 prompt_embeds: PromptEmbeds | None = None) -> None:
        if not isinstance(config, KeyConfig):
            raise KeyConfigError(f"config must be a KeyConfig, got {type(config).__name__}")
        self.config = config
        self.format: HashFormat = config.format
        self.algorithm: Algorithm = config.algorithm
        self.hash_block_size = config.hash_block_size
        self.lookahead = config.lookahead
        self.seed: ResolvedSeed | None
        self.none_hash, self.seed = config.resolve_none_hash()
        self.tokens: list[int]
        self.tokens, self.extra = hashed_inputs(self.format, prompt, lora=lora, mm=mm,
                                                cache_salt=cache_salt,
                                                prompt_embeds=prompt_embeds)
        self.keys: list[bytes] = []
        self.keys.extend(self._call())

    def extend(self, tokens: Iterable[int]) -> list[bytes]:
        """Append tokens (``Request.append_output_token_ids``) and return the new keys."""
        self.tokens.extend(held_ids(self.format, token_ids(tokens, len(self.tokens)),
                                    len(self.tokens)))
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
                extra = (extra, toks[e]) if la == 1 else (extra, *toks[e:e + la])
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


def hashed_inputs(fmt: HashFormat, prompt: Iterable[int] = (), **request_inputs: Any
                  ) -> tuple[list[int], ExtraKeys]:
    """A request's validated inputs as ``fmt`` hashes them, without hashing anything: the
    prompt's token ids (a copy: :meth:`BlockKeyHasher.extend` appends to it) and its extra
    keys (``request_inputs``: lora, mm, cache_salt, prompt_embeds)."""
    tokens = list(held_ids(fmt, token_ids(prompt)))
    return tokens, ExtraKeys(fmt, prompt_length=len(tokens), **request_inputs)


def held_ids(fmt: HashFormat, ids: list[int], first_position: int = 0) -> list[int]:
    """``ids`` (checked by :func:`~pdpatch.hashing.inputs.token_ids`), or an InputError where
    ``fmt``'s release cannot hold one of them (0.34+: int32 token ids)."""
    if fmt.max_token_id < MAX_TOKEN_ID and ids and max(ids) > fmt.max_token_id:
        i = next(i for i, t in enumerate(ids) if t > fmt.max_token_id)
        raise InputError(f"token id #{first_position + i} is {ids[i]}: vLLM {fmt.release} holds "
                         f"token ids as int32 (at most {fmt.max_token_id}) and refuses it")
    return ids


def block_keys(tokens: Iterable[int], config: KeyConfig, **request_inputs: Any
               ) -> list[bytes]:
    """Keys of every full block of ``tokens`` (one hasher call, as at request creation) on the
    server ``config`` describes; ``request_inputs``: lora, mm, cache_salt, prompt_embeds."""
    return BlockKeyHasher(config, tokens, **request_inputs).keys


def to_event_int(key: bytes) -> int:
    """The KV-event form (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default): the low 64
    bits, i.e. the last 8 bytes big-endian."""
    return int.from_bytes(key, "big") & EVENT_INT_MASK


def with_group_id(key: bytes, group_id: int) -> bytes:
    """vLLM's block-pool key ``BlockHashWithGroupId``: key + 4-byte big-endian group id."""
    return key + operator.index(group_id).to_bytes(4, "big", signed=False)


def coarse_keys(fine_keys: Sequence[bytes], factor: int, vllm_version: str) -> list[bytes]:
    """Keys of a KV-cache group whose block size is ``factor * hash_block_size``
    (``BlockHashListWithBlockSize``): the last fine key of each full coarse block (0.24+), or
    the concatenation of its fine keys (0.12-0.23).  The KV-event ints agree in both cases."""
    fmt = format_for(vllm_version)
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise KeyConfigError(f"the coarse factor must be an int >= 1, got {factor!r}")
    if factor == 1:
        return list(fine_keys)
    if fmt.coarse_view == "none":
        raise KeyConfigError(f"vLLM {fmt.release} has a single hash block size (0.12+ only)")
    n = len(fine_keys) // factor
    if fmt.coarse_view == "last":
        return [fine_keys[(j + 1) * factor - 1] for j in range(n)]
    return [b"".join(fine_keys[j * factor:(j + 1) * factor]) for j in range(n)]
