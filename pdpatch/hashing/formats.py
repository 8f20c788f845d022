"""Which block-hash rules a vLLM release used, as data.

Every rule here was read from the wheels' own ``vllm/v1/core/kv_cache_utils.py`` and
``vllm/utils/hashing.py`` (every release 0.10.2 .. 0.34.0; see
``scripts/make_hash_fixtures.py``).  0.34 hashes exactly as 0.33 (``hash_block_tokens``, the
extra-key functions and ``vllm/utils/hashing.py`` unchanged; the block's tokens are read through
``token_slice`` of an int32 ``TokenBuffer``, 0.34.0 kv_cache_utils.py L1020-1023, and made a
tuple of the same ints, L730) but holds token ids as int32 (:attr:`HashFormat.max_token_id`).

A peer's keys can only be reproduced with the rules of the release it runs, so every entry point
takes a ``vllm_version`` (there is no default: a wrong release gives keys that look right and
never match) and resolves it here once.

Releases before 0.10.2 (integer-valued hashes, the ``builtin`` algorithm) are not supported.
Releases newer than the last one verified use its rules and say so through ``verified``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from packaging.version import InvalidVersion, Version

from pdpatch import versions, vllm_sites
from pdpatch.hashing.errors import KeyConfigError, shown
from pdpatch.hashing.inputs import MAX_TOKEN_ID

logger = logging.getLogger("pdpatch.hashing")

FIRST_SUPPORTED = Version("0.10.2")
LAST_VERIFIED = vllm_sites.NEWEST_SUPPORTED

LoraKey = Literal["int_id", "name", "tagged"]
MMKey = Literal["bare", "pair", "tagged"]
SaltKey = Literal["bare", "tagged"]
EmbedsKey = Literal["none", "raw", "digest", "tagged"]
CoarseView = Literal["none", "concat", "last"]
MMResume = Literal["last_item", "window"]


@dataclass(frozen=True)
class HashFormat:
    """The hashing rules of one vLLM release (only what changes the bytes)."""

    release: str
    """The release asked for, normalised (``0.33.0``)."""
    verified: bool
    """False for a release newer than the last one whose source was checked."""
    algorithms: frozenset[str]
    lora_key: LoraKey
    """``int_id``: ``lora_int_id`` (<=0.11.0); ``name``: ``lora_name`` (0.11.1-0.30);
    ``tagged``: ``("lora", name, path)`` (0.31+)."""
    mm_key: MMKey
    """``bare``: identifier (<=0.18); ``pair``: ``(identifier, off - s)`` (0.19-0.30);
    ``tagged``: ``("mm", identifier, off - s)`` (0.31+)."""
    mm_strict_bounds: bool
    """0.19+ skip an MM item ending exactly at the block start; <=0.18 compared with ``<``."""
    mm_resume: MMResume
    """Where a later hasher call (decode-completed block) resumes the MM scan: the last item
    only (<=0.30) or the items overlapping the window (0.31+)."""
    salt_key: SaltKey
    embeds_key: EmbedsKey
    """``raw``: the slice's bytes (0.11.1-0.16); ``digest``: sha256 of them (0.17-0.30);
    ``tagged``: ``("prompt_embeds", digest)`` (0.31+)."""
    coarse_view: CoarseView
    """How a KV-cache group with block size k*hash_block_size keys block j: the k fine hashes
    concatenated (0.12-0.23) or the last one (0.24+)."""
    default_seed_for_crypto: bool
    """0.29+: with PYTHONHASHSEED unset, sha256/sha256_cbor seed with ``"vllm-none-hash"``."""
    lookahead: bool
    """0.33+: EAGLE lookahead keys exist.  A server uses them (``num_hash_lookahead_tokens`` >
    0) only with EAGLE's trailing-block drop on; then 0.33 turns them off with any KV connector
    (0.33.0 config/vllm.py L678-692), 0.34 only with a connector whose
    ``supports_lookahead_block_hashes`` is False (0.34.0 config/vllm.py L633-654; NIXL's is
    True, nixl/connector.py L93-96; the base class's False, base.py L199-203)."""
    max_token_id: int
    """The largest token id the release's ``Request`` holds: any int up to 0.33 (this
    library's bound, 2**64-1), 2**31-1 from 0.34, whose prompt and all-token ids are int32
    ``TokenBuffer``s (0.34.0 token_buffer.py L20-33, request.py L139-163, L287-296: a larger id
    raises ``OverflowError`` there)."""

    @property
    def key_format(self) -> str:
        """The first release whose extra keys are built exactly like this one's.

        Two peers whose ``key_format`` differ build different keys for a LoRA, multimodal,
        salted or embeds request even with the same algorithm and seed.
        """
        for era, fmt in _KEY_FORMAT_ERAS:
            if fmt == (self.lora_key, self.mm_key, self.mm_strict_bounds, self.salt_key,
                       self.embeds_key):
                return era
        raise AssertionError("unreachable: every format has an era")  # pragma: no cover


_KEY_FORMAT_ERAS: tuple[tuple[str, tuple[str, str, bool, str, str]], ...] = (
    ("0.10.2", ("int_id", "bare", False, "bare", "none")),
    ("0.11.1", ("name", "bare", False, "bare", "raw")),
    ("0.17", ("name", "bare", False, "bare", "digest")),
    ("0.19", ("name", "pair", True, "bare", "digest")),
    ("0.31", ("tagged", "tagged", True, "tagged", "tagged")),
)

KEY_FORMATS = tuple(era for era, _ in _KEY_FORMAT_ERAS)

_SHA = frozenset({"sha256", "sha256_cbor"})
_ALL = frozenset({"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"})


def _release(vllm_version: str | Version) -> Version:
    """The caller's release (:func:`pdpatch.versions.parse_release`), or a
    :class:`KeyConfigError` saying what is wrong with it."""
    if not isinstance(vllm_version, Version) and (not isinstance(vllm_version, str)
                                                  or len(vllm_version) > 64):
        raise KeyConfigError(f"the vLLM release must be a string like '0.33.0', got "
                             f"{shown(vllm_version)}")
    try:
        return versions.parse_release(vllm_version)
    except InvalidVersion as e:
        raise KeyConfigError(f"not a vLLM version: {shown(vllm_version)}") from e


@lru_cache(maxsize=64)
def _format_for(release: Version) -> HashFormat:
    if release < FIRST_SUPPORTED:
        raise KeyConfigError(
            f"vLLM {release} hashes blocks to integers (releases before 0.10.2); "
            "pdpatch reproduces the bytes-valued keys of 0.10.2 and later only")
    verified = release < vllm_sites.SUPPORTED.upper()
    if not verified:
        logger.warning("vLLM %s is newer than the last release whose hashing pdpatch checked "
                       "(%s); using that release's rules", release, LAST_VERIFIED)

    def at_least(v: str) -> bool:
        return release >= Version(v)

    tagged = at_least("0.31")
    return HashFormat(
        release=str(release),
        verified=verified,
        algorithms=_ALL if at_least("0.13") else _SHA,
        lora_key="tagged" if tagged else "name" if at_least("0.11.1") else "int_id",
        mm_key="tagged" if tagged else "pair" if at_least("0.19") else "bare",
        mm_strict_bounds=at_least("0.19"),
        mm_resume="window" if tagged else "last_item",
        salt_key="tagged" if tagged else "bare",
        embeds_key=("tagged" if tagged else "digest" if at_least("0.17")
                    else "raw" if at_least("0.11.1") else "none"),
        coarse_view="last" if at_least("0.24") else "concat" if at_least("0.12") else "none",
        default_seed_for_crypto=at_least("0.29"),
        lookahead=at_least("0.33"),
        max_token_id=2**31 - 1 if at_least("0.34") else MAX_TOKEN_ID,
    )


def format_for(vllm_version: str | Version) -> HashFormat:
    """The rules of ``vllm_version``."""
    return _format_for(_release(vllm_version))
