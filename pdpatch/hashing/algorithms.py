"""vLLM's four prefix-cache hash functions, byte for byte.

``F(obj) = digest(serialize(obj))`` with

=============  ==========================================  ============================
name           serializer                                  digest
=============  ==========================================  ============================
sha256         ``pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)``  ``hashlib.sha256`` (32 B)
sha256_cbor    ``cbor2.dumps(obj, canonical=True)``          ``hashlib.sha256`` (32 B)
xxhash         pickle as above                              ``xxhash.xxh3_128_digest`` (16 B)
xxhash_cbor    CBOR as above                                ``xxhash.xxh3_128_digest`` (16 B)
=============  ==========================================  ============================

(``vllm/utils/hashing.py``; ``vllm/utils/__init__.py`` before 0.12.)  ``Algorithm.hash_object``
is that formula, calling the same serializers vLLM calls, and is the reference the fast
encoders in :mod:`pdpatch.hashing.encoders` are tested against.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import cbor2

from pdpatch.hashing.errors import KeyConfigError, XxhashUnavailableError

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

XXHASH_MISSING = (
    "the '{algo}' block-hash algorithm needs the Python package 'xxhash' "
    "(pip install xxhash), which is not installed here. vLLM itself does not depend on "
    "xxhash either: a vLLM server started with --prefix-caching-hash-algo {algo} needs it "
    "installed too, or every request fails (vLLM issues #39785, #42720)"
)


def _xxh3_128_digest(algo: str) -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError as e:
        raise XxhashUnavailableError(XXHASH_MISSING.format(algo=algo)) from e
    fn = getattr(xxhash, "xxh3_128_digest", None)
    if fn is None:  # vLLM checks for this attribute too (python-xxhash < 2.0.2 lacks it)
        raise XxhashUnavailableError(
            XXHASH_MISSING.format(algo=algo) + f"; the installed xxhash "
            f"{getattr(xxhash, 'VERSION', '?')} has no xxh3_128_digest (need >= 2.0.2)")
    return fn


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def pickle_dumps(obj: Any) -> bytes:
    """vLLM's pickle serializer: the highest protocol of *this* interpreter."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def cbor_dumps(obj: Any) -> bytes:
    """vLLM's CBOR serializer."""
    return cbor2.dumps(obj, canonical=True)


@dataclass(frozen=True)
class Algorithm:
    """One of vLLM's block-hash functions."""

    name: str
    serializer: Literal["pickle", "cbor"]
    digest_size: int
    digest: Callable[[bytes], bytes]

    def serialize(self, obj: Any) -> bytes:
        return cbor_dumps(obj) if self.serializer == "cbor" else pickle_dumps(obj)

    def hash_object(self, obj: Any) -> bytes:
        """Exactly vLLM's ``hash_fn(obj)``."""
        return self.digest(self.serialize(obj))

    @property
    def crypto(self) -> bool:
        """Collision resistant: vLLM (0.29+) gives these a fixed default seed."""
        return self.name.startswith("sha256")


@lru_cache(maxsize=8)
def get_algorithm(name: str) -> Algorithm:
    """Like vLLM's ``get_hash_fn_by_name``; raises XxhashUnavailableError for xxhash* without
    the ``xxhash`` package (vLLM would only fail on the first request)."""
    if name not in ALGORITHMS:
        raise KeyConfigError(
            f"unknown block-hash algorithm {name!r}; vLLM offers {', '.join(ALGORITHMS)}")
    serializer: Literal["pickle", "cbor"] = "cbor" if name.endswith("_cbor") else "pickle"
    if name.startswith("xxhash"):
        return Algorithm(name, serializer, 16, _xxh3_128_digest(name))
    return Algorithm(name, serializer, 32, _sha256_digest)
