"""The one configuration of block keys: which server the keys are for.

A server's block keys depend on four of its settings, and a key computed with any of them wrong
looks right and never matches.  So none has a default here: :class:`KeyConfig` takes each
explicitly, ``pdpatch hash`` / ``pdpatch fingerprint`` build the same object from their flags
(or from its JSON form, :meth:`KeyConfig.from_mapping`), and both read the seed the same way.
The one shortcut is ``vllm_version="installed"``: the release of the vLLM installed next to
pdpatch, for code running on the server's own machine (an error where none is installed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdpatch.hashing.algorithms import ALGORITHMS, Algorithm, get_algorithm
from pdpatch.hashing.errors import KeyConfigError, shown
from pdpatch.hashing.formats import HashFormat, format_for
from pdpatch.hashing.seed import ResolvedSeed, derive_none_hash, resolve_seed

if TYPE_CHECKING:
    from pdpatch.hashing.keys import BlockKeyHasher

INSTALLED = "installed"
MAX_HASH_BLOCK_SIZE = 1 << 20
MAX_LOOKAHEAD = 64

FIELD_HINTS = {
    "vllm_version": "the server's vLLM release (`vllm --version`, e.g. 0.33.0), or 'installed' "
                    "for the vLLM installed here",
    "algo": "the server's --prefix-caching-hash-algo (vLLM's default: sha256)",
    "hash_block_size": "the server's hash block size: its KV-cache block size (--block-size; "
                       "when not given the platform and attention backend choose it, 16 on "
                       "most CUDA backends) for a model with one KV-cache group",
    "pythonhashseed": "the server EngineCore's PYTHONHASHSEED, verbatim ('' and '0' are seeds "
                      "too); null/None when it is unset (vLLM's default)",
    "lookahead": "EAGLE lookahead tokens of vLLM 0.33+, the engine's num_hash_lookahead_tokens "
                 "(0 unless EAGLE drops the trailing block; 0.33 also 0 with any KV "
                 "connector, 0.34 only with one that does not support lookahead block hashes: "
                 "NIXL does)",
}
"""What each field is, for error messages and ``--help`` (the CLI's flags say the same)."""
REQUIRED_FIELDS = ("vllm_version", "algo", "hash_block_size", "pythonhashseed")


def _installed_release() -> str:
    from pdpatch import versions

    v = versions.vllm_version()
    if v is None:
        raise KeyConfigError("vllm_version 'installed': no vLLM is installed here; name the "
                             "server's release instead (e.g. 0.33.0)")
    return str(v)


def _bounded_int(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise KeyConfigError(f"{name} must be an int in [{lo}, {hi}], got {shown(value)}")
    return value


@dataclass(frozen=True, kw_only=True)
class KeyConfig:
    """A server's block-key configuration, validated once and reused for every request:
    ``KeyConfig(...).hasher(prompt, lora=...)``.

    ``vllm_version``, ``algo``, ``hash_block_size`` and ``pythonhashseed`` are required (see
    :data:`FIELD_HINTS` for where each is read on a server).  ``none_hash`` replaces the seed
    with a NONE_HASH read from a running engine (``kv_cache_utils.NONE_HASH``), which
    reproduces even a random one.  Raises :class:`KeyConfigError` for a value no server runs
    with.
    """

    vllm_version: str
    algo: str
    hash_block_size: int
    pythonhashseed: str | None
    none_hash: bytes | None = None
    lookahead: int = 0

    def __post_init__(self) -> None:
        installed = isinstance(self.vllm_version, str) and self.vllm_version == INSTALLED
        release = _installed_release() if installed else self.vllm_version
        fmt = format_for(release)
        object.__setattr__(self, "vllm_version", fmt.release)
        if not isinstance(self.algo, str) or self.algo not in ALGORITHMS:
            raise KeyConfigError(f"unknown block-hash algorithm {shown(self.algo)}; vLLM "
                                 f"offers {', '.join(ALGORITHMS)}")
        if self.algo not in fmt.algorithms:
            raise KeyConfigError(
                f"vLLM {fmt.release} has no '{self.algo}' block-hash algorithm "
                f"(it offers {', '.join(sorted(fmt.algorithms))})")
        _bounded_int(self.hash_block_size, "hash_block_size", 1, MAX_HASH_BLOCK_SIZE)
        if self.pythonhashseed is not None and not isinstance(self.pythonhashseed, str):
            raise KeyConfigError(
                "pythonhashseed is PYTHONHASHSEED's string as the server's environment holds "
                f"it, or None for unset; got {type(self.pythonhashseed).__name__}")
        # a derived NONE_HASH is a digest (16 or 32 bytes); a random one, 32 bytes of urandom
        if self.none_hash is not None and (not isinstance(self.none_hash, bytes)
                                           or len(self.none_hash) not in (16, 32)):
            raise KeyConfigError("none_hash must be an engine's NONE_HASH: 16 or 32 bytes, got "
                                 f"{shown(self.none_hash)}")
        _bounded_int(self.lookahead, "lookahead", 0, MAX_LOOKAHEAD)
        if self.lookahead and not fmt.lookahead:
            raise KeyConfigError(f"vLLM {fmt.release} has no lookahead block hashes (0.33+)")

    @property
    def format(self) -> HashFormat:
        return format_for(self.vllm_version)

    @property
    def algorithm(self) -> Algorithm:
        """The hash function (``XxhashUnavailableError`` for xxhash* without ``xxhash``)."""
        return get_algorithm(self.algo)

    def resolve_none_hash(self) -> tuple[bytes, ResolvedSeed | None]:
        """NONE_HASH and the seed it comes from (None: given as ``none_hash``).  Raises
        :class:`UnreproducibleSeedError` where the server's NONE_HASH is random."""
        if self.none_hash is not None:
            return self.none_hash, None
        seed = resolve_seed(self.algorithm, self.format, self.pythonhashseed)
        return derive_none_hash(self.algorithm, seed.seed), seed

    def hasher(self, prompt: Iterable[int] = (), **request_inputs: Any) -> BlockKeyHasher:
        """A hasher for one request (``request_inputs``: lora, mm, cache_salt,
        prompt_embeds)."""
        from pdpatch.hashing.keys import BlockKeyHasher  # keys.py imports this module

        return BlockKeyHasher(self, prompt, **request_inputs)

    def validate(self) -> BlockKeyHasher:
        """Raise now (UnreproducibleSeedError, XxhashUnavailableError) what every request
        would raise later; returns an empty hasher (for the fingerprint)."""
        return self.hasher()

    def to_mapping(self) -> dict[str, Any]:
        """The JSON form :meth:`from_mapping` reads (without a reported ``none_hash``)."""
        return {"vllm_version": self.vllm_version, "algo": self.algo,
                "hash_block_size": self.hash_block_size, "pythonhashseed": self.pythonhashseed,
                "lookahead": self.lookahead}

    @classmethod
    def from_mapping(cls, data: Any) -> KeyConfig:
        """A configuration from its JSON form: every field of :data:`REQUIRED_FIELDS` present
        (``pythonhashseed`` null for unset), ``lookahead`` optional, nothing else."""
        if not isinstance(data, Mapping):
            raise KeyConfigError(f"a block-key configuration is an object with "
                                 f"{', '.join(REQUIRED_FIELDS)}; got {type(data).__name__}")
        unknown = [k for k in data if k not in FIELD_HINTS]
        if unknown:
            raise KeyConfigError(f"unknown block-key configuration field {shown(unknown[0])}; "
                                 f"the fields are {', '.join(FIELD_HINTS)}")
        for name in REQUIRED_FIELDS:
            if name not in data:
                raise KeyConfigError(f"block-key configuration without {name}: "
                                     f"{FIELD_HINTS[name]}")
        return cls(**data)
