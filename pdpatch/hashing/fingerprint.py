"""What two peers must agree on for their block keys to be equal.

Equal keys need the same algorithm, the same NONE_HASH (algorithm + seed), the same
``hash_block_size``, the same extra-key format (the vLLM release era), for the pickle algorithms
the same pickle protocol (``pickle.HIGHEST_PROTOCOL`` of each interpreter), and no EAGLE
lookahead difference.  A :class:`Fingerprint` holds exactly these; its compact dict is what an
engine logs at startup and what travels in ``kv_transfer_params``.

The compact form carries an *id* of NONE_HASH (a truncated, domain-separated sha256), not
NONE_HASH itself: for xxhash vLLM keeps the seed secret on purpose, and the id is enough to tell
two values apart.
"""

from __future__ import annotations

import hashlib
import pickle
from dataclasses import dataclass
from typing import Any

from pdpatch.hashing.keys import BlockKeyHasher

NONE_HASH_ID_HEX = 16


def none_hash_id(none_hash: bytes) -> str:
    """A short public id of NONE_HASH (16 hex chars)."""
    return hashlib.sha256(b"pdpatch/none-hash/v1\0" + none_hash).hexdigest()[:NONE_HASH_ID_HEX]


@dataclass(frozen=True)
class Fingerprint:
    algo: str
    hash_block_size: int
    none_hash: bytes
    seed_source: str
    """``PYTHONHASHSEED``, ``default`` (vLLM 0.29+'s "vllm-none-hash") or ``reported`` (a
    NONE_HASH read from a running engine)."""
    key_format: str
    vllm_version: str
    pickle_protocol: int | None
    lookahead: int = 0

    @property
    def none_hash_id(self) -> str:
        return none_hash_id(self.none_hash)

    def to_dict(self) -> dict[str, Any]:
        """The compact, JSON-able form (logged and sent to the peer)."""
        return {
            "algo": self.algo,
            "hbs": self.hash_block_size,
            "nh": self.none_hash_id,
            "seed": self.seed_source,
            "kf": self.key_format,
            "vllm": self.vllm_version,
            "pp": self.pickle_protocol,
            "la": self.lookahead,
        }

    def describe(self) -> dict[str, Any]:
        """The operator's view (``pdpatch fingerprint``): the compact form plus NONE_HASH."""
        return {**self.to_dict(), "none_hash": self.none_hash.hex()}


def fingerprint_of(hasher: BlockKeyHasher) -> Fingerprint:
    """The fingerprint of the configuration ``hasher`` computes keys for."""
    return Fingerprint(
        algo=hasher.algorithm.name,
        hash_block_size=hasher.hash_block_size,
        none_hash=hasher.none_hash,
        seed_source=hasher.seed.source if hasher.seed is not None else "reported",
        key_format=hasher.format.key_format,
        vllm_version=hasher.format.release,
        pickle_protocol=pickle.HIGHEST_PROTOCOL if hasher.algorithm.serializer == "pickle"
        else None,
        lookahead=hasher.lookahead,
    )


FINGERPRINT_CAUSES = ("algo", "hash_block_size", "seed", "key_format", "pickle_protocol",
                      "lookahead")


def fingerprint_diff(local: dict[str, Any], peer: dict[str, Any]) -> list[str]:
    """Causes (in :data:`FINGERPRINT_CAUSES` order) why two compact fingerprints give
    different keys.  A NONE_HASH difference under the same algorithm is a ``seed`` cause; the
    vLLM release alone is not a cause (only its ``kf`` era is)."""
    causes = []
    if local["algo"] != peer["algo"]:
        causes.append("algo")
    if local["hbs"] != peer["hbs"]:
        causes.append("hash_block_size")
    if local["algo"] == peer["algo"] and local["nh"] != peer["nh"]:
        causes.append("seed")
    if local["kf"] != peer["kf"]:
        causes.append("key_format")
    if local["algo"] == peer["algo"] and local.get("pp") != peer.get("pp"):
        causes.append("pickle_protocol")
    if local.get("la", 0) != peer.get("la", 0):
        causes.append("lookahead")
    return causes
