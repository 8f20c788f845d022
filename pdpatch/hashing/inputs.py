"""The checks every request input passes before it is hashed.

A key computed from an input no vLLM server accepts never matches a server's key, yet looks
like one; so such inputs are refused with an :class:`~pdpatch.hashing.errors.InputError` that
says what a server would have, instead of being hashed:

* token ids: ints (not bools) in ``[0, 2**64)`` -- vLLM's renderer rejects negative ids (and
  ids past the vocabulary, which only the server knows);
* multimodal items: a non-empty string identifier and a placeholder range of at least one
  token inside the prompt, in prompt order and not overlapping (touching is fine: two images
  back to back), as vLLM's processors produce them;
* the cache salt: a string;
* a LoRA adapter: the fields the release hashes (see :class:`~pdpatch.hashing.extra_keys.LoraSpec`).

The checks keep the caller's string objects (pickle's identity memo depends on them, see
:mod:`pdpatch.hashing.extra_keys`) and turn other int-like ids (numpy scalars) into ints.
"""

from __future__ import annotations

import array
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pdpatch.hashing.errors import InputError, shown

MAX_TOKEN_ID = 2**64 - 1
"""The largest id CBOR encodes as an integer; real vocabularies end far below."""

try:
    from pdpatch.hashing._block_items import first_non_id as _first_non_id
except ImportError:  # built without a C compiler: every id is looked at in Python
    _first_non_id = None


def token_id(value: Any, where: str) -> int:
    """One token id as a plain int (``where`` names it in the error)."""
    if isinstance(value, bool):
        raise InputError(f"{where} is a bool ({value!r}), not a token id")
    try:
        tid = operator.index(value)
    except TypeError:
        raise InputError(f"{where} is {shown(value)}, not a token id (an int)") from None
    if not 0 <= tid <= MAX_TOKEN_ID:
        raise InputError(f"{where} is {tid}: token ids are in [0, 2**64) "
                         "(vLLM's renderer rejects negative ids)")
    return tid


def _plain_ids(ids: list[Any] | tuple[Any, ...]) -> bool:
    """Every item a plain int in ``[0, 2**64)``, checked in two C-speed passes of the standard
    library (for a build without the compiled module: ~1.5 ms for 32k ids, not ~18 ms)."""
    if set(map(type, ids)) - {int}:
        return False
    try:
        array.array("Q", ids)
    except OverflowError:
        return False
    return True


def token_ids(values: Iterable[Any], first_position: int = 0) -> list[int]:
    """``values`` as a list of plain-int token ids, or InputError naming the first bad one.

    A list of plain ints (what vLLM and a JSON decoder hold) is checked in one C call where
    pdpatch was built with its compiled encoder, and returned as it is (not copied).
    """
    if isinstance(values, (str, bytes, bytearray, memoryview, Mapping)) \
            or not isinstance(values, Iterable):
        raise InputError(f"token ids must be a sequence of ints, got {type(values).__name__}")
    ids = values if type(values) in (list, tuple) else list(values)
    start = 0
    if _first_non_id is not None:
        start = _first_non_id(ids)
    elif _plain_ids(ids):
        start = -1
    if start < 0:
        return ids if type(ids) is list else list(ids)
    out = list(ids[:start])
    out.extend(token_id(v, f"token id #{first_position + i}")
               for i, v in enumerate(ids[start:], start))
    return out


def text(value: Any, what: str, *, empty: bool = True) -> str:
    """A string input, returned as the very object given.  A lone surrogate (JSON's
    ``"\\ud800"``) is refused: no server's JSON parser accepts one, and CBOR cannot encode it."""
    if not isinstance(value, str):
        raise InputError(f"{what} must be a string, got {shown(value)}")
    if not empty and not value:
        raise InputError(f"{what} must not be empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(f"{what} is not valid Unicode (it holds a lone surrogate)") from None
    return value


def positive_int(value: Any, what: str, *, minimum: int = 1) -> int:
    """An int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{what} must be an int >= {minimum}, got {shown(value)}")
    return value


def mm_ranges(ranges: Sequence[tuple[int, int]], prompt_length: int) -> None:
    """Placeholder ranges ``(offset, length)`` as vLLM's processors produce them: at least one
    token each, inside the prompt, in prompt order, not overlapping."""
    end = 0
    for i, (offset, length) in enumerate(ranges):
        if offset < end:
            raise InputError(
                f"multimodal item #{i} starts at {offset}, before the end of item #{i - 1} "
                f"({end}): items must be in prompt order and must not overlap")
        end = offset + length
        if end > prompt_length:
            raise InputError(f"multimodal item #{i} ends at {end}, past the prompt "
                             f"({prompt_length} tokens)")
