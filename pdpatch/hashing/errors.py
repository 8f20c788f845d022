"""Errors of the block-key library: each says what to change, not only what went wrong."""

from __future__ import annotations


class HashingError(ValueError):
    """A request for keys that vLLM itself would not produce (bad algorithm, version, input)."""


class UnreproducibleSeedError(HashingError):
    """The peer's NONE_HASH is random, so nobody else can compute its keys.

    vLLM derives NONE_HASH (the parent of block 0) from ``os.urandom`` when PYTHONHASHSEED is
    unset and the algorithm is xxhash/xxhash_cbor (every algorithm before 0.29).  Pretending to
    reproduce such keys would only produce silent prefix-cache misses, so we refuse.
    """


class XxhashUnavailableError(ModuleNotFoundError):
    """The xxhash algorithms need the ``xxhash`` package, which vLLM does not install."""


class PeerParamsError(ValueError):
    """Block-key parameters received from the network are malformed or too large."""
