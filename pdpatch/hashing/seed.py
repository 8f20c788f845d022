"""NONE_HASH, the parent of every request's block 0, resolved exactly as vLLM resolves it.

vLLM (``init_none_hash`` / ``resolve_none_hash_seed`` in ``v1/core/kv_cache_utils.py``):

* PYTHONHASHSEED set (to *anything*, including ``""`` and ``"random"``): the seed is that exact
  string, so ``"0"`` and ``"00"`` differ.  ``NONE_HASH = F(seed)``.
* unset, vLLM >= 0.29, sha256/sha256_cbor: the seed is ``"vllm-none-hash"``.
* unset otherwise (xxhash*, or any algorithm before 0.29): random bytes per EngineCore
  process.  Nobody can reproduce those keys; :func:`resolve_seed` raises instead of guessing.

The value that matters is the one in the **EngineCore process** environment of each peer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pdpatch.hashing.algorithms import Algorithm
from pdpatch.hashing.errors import KeyConfigError, UnreproducibleSeedError
from pdpatch.hashing.formats import HashFormat

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
SeedSource = Literal["PYTHONHASHSEED", "default"]


@dataclass(frozen=True)
class ResolvedSeed:
    """The string NONE_HASH is derived from, and why it is that string."""

    seed: str
    source: SeedSource


def seed_from_environ(environ: Mapping[str, str] | None = None) -> str | None:
    """PYTHONHASHSEED as a vLLM process with this environment would read it (None: unset)."""
    return (os.environ if environ is None else environ).get("PYTHONHASHSEED")


def resolve_seed(algorithm: Algorithm, fmt: HashFormat, pythonhashseed: str | None
                 ) -> ResolvedSeed:
    """Resolve the NONE_HASH seed of a peer whose PYTHONHASHSEED is ``pythonhashseed``.

    ``pythonhashseed`` is the raw environment value, ``None`` meaning unset.  Raises
    :class:`UnreproducibleSeedError` where vLLM would use a random seed.
    """
    if pythonhashseed is not None:
        if not isinstance(pythonhashseed, str):
            raise KeyConfigError(
                f"PYTHONHASHSEED is a string in vLLM's environment, got {pythonhashseed!r}")
        return ResolvedSeed(pythonhashseed, "PYTHONHASHSEED")
    if algorithm.crypto and fmt.default_seed_for_crypto:
        return ResolvedSeed(DEFAULT_NONE_HASH_SEED, "default")
    why = ("is not collision resistant, so vLLM keeps its seed secret"
           if not algorithm.crypto else "predates the fixed default seed of vLLM 0.29")
    alternative = ("upgrade to vLLM >= 0.29 and use sha256/sha256_cbor"
                   if not fmt.default_seed_for_crypto else "use sha256/sha256_cbor")
    raise UnreproducibleSeedError(
        f"not reproducible: with PYTHONHASHSEED unset, vLLM {fmt.release} derives NONE_HASH "
        f"for '{algorithm.name}' from os.urandom in every EngineCore process ('{algorithm.name}' "
        f"{why}), so neither pdpatch nor another vLLM instance can compute its block keys. "
        "Set PYTHONHASHSEED identically on P and D (in the environment the EngineCore "
        f"processes inherit), e.g. PYTHONHASHSEED=0, or {alternative}")


def derive_none_hash(algorithm: Algorithm, seed: str) -> bytes:
    """``NONE_HASH = F(seed)`` (a CBOR text string or a pickled ``str``)."""
    return algorithm.hash_object(seed)
