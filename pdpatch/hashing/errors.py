"""Errors of the block-key library: each says what to change, not only what went wrong.

Every error the library raises for a bad configuration or a bad input is a
:class:`HashingError`, so a router or KV store needs one ``except`` clause, and the CLI turns
each into one line and exit status 2.
"""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40


def shown(value: Any) -> str:
    """A bad value for an error message: its type and a short repr (bounded in length and
    depth, so a hostile input cannot make the message itself fail)."""
    return f"{type(value).__name__} {_REPR.repr(value)}"


class HashingError(ValueError):
    """A request for keys that vLLM itself would not produce (bad algorithm, version, input)."""


class KeyConfigError(HashingError):
    """A configuration no vLLM server runs with (unknown release, algorithm, block size...)."""


class InputError(HashingError):
    """A request input no vLLM server accepts (negative token ids, overlapping multimodal
    items, a LoRA without the path vLLM hashes...): keys for it could never match a server's."""


class UnreproducibleSeedError(HashingError):
    """The peer's NONE_HASH is random, so nobody else can compute its keys.

    vLLM derives NONE_HASH (the parent of block 0) from ``os.urandom`` when PYTHONHASHSEED is
    unset and the algorithm is xxhash/xxhash_cbor (every algorithm before 0.29).  Pretending to
    reproduce such keys would only produce silent prefix-cache misses, so we refuse.
    """


class XxhashUnavailableError(HashingError, ModuleNotFoundError):
    """The xxhash algorithms need the ``xxhash`` package, which vLLM does not install.

    Also a ``ModuleNotFoundError``: code that handles a missing optional package generically
    keeps working."""


class PeerParamsError(ValueError):
    """Block-key parameters received from the network are malformed or too large."""
