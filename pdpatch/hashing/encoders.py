"""A fast chain of block hashes that writes the serializers' bytes itself.

vLLM computes each block as ``F((parent, tuple(tokens), extra))``, one ``cbor2.dumps`` /
``pickle.dumps`` per block.  For the *token part* of the payload this module produces the same
bytes without calling the serializer per block:

* every token's encoding comes from a lookup table (CBOR: shortest-form unsigned int; pickle:
  ``BININT1``/``BININT2``/``BININT``), fetched for the whole sequence with one
  ``operator.itemgetter`` call and grouped into blocks by ``zip``/``bytes.join`` (all C loops);
* the fixed framing (CBOR array and byte-string headers; pickle PROTO 5, FRAME, SHORT_BINBYTES,
  MARK/TUPLE, MEMOIZE, TUPLE3, STOP) is written around it;
* ``extra`` is serialized by the real ``cbor2`` / ``pickle`` (once per distinct value), so
  strings, negative offsets and bytes keep their exact encoding.

Anything outside the tables (a token < 0 or >= 2**18, a non-int, a pickle payload near the
64 KiB frame size, an interpreter whose HIGHEST_PROTOCOL is not 5) takes the reference path,
``Algorithm.hash_object``, which calls the serializers exactly as vLLM does.  Tests compare both
paths byte for byte on random inputs covering every integer width.
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
import pickle
import threading
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

from pdpatch.hashing.algorithms import Algorithm, cbor_dumps, pickle_dumps

TABLE_CAP = 1 << 18  # covers every tokenizer vocabulary in use (Gemma's 262144 included)
_TABLE_MIN = 1 << 16

# pickle opcodes (Lib/pickle.py)
_PROTO5_FRAME = b"\x80\x05\x95"
_SHORT_BINBYTES = b"C"
_MEMOIZE = b"\x94"
_MARK = b"("
_TUPLE = b"t"
_TUPLE_N = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
_TUPLE3_MEMO_STOP = b"\x87\x94."
_PICKLE_FRAME_LIMIT = 64 * 1024 - 256  # C pickler splits frames at 64 KiB; stay well below
FAST_PICKLE = pickle.HIGHEST_PROTOCOL == 5


def cbor_uint(value: int) -> bytes:
    """Canonical (shortest) CBOR encoding of a non-negative int < 2**64."""
    if value < 24:
        return bytes((value,))
    if value < 0x100:
        return bytes((0x18, value))
    if value < 0x10000:
        return b"\x19" + value.to_bytes(2, "big")
    if value < 0x100000000:
        return b"\x1a" + value.to_bytes(4, "big")
    return b"\x1b" + value.to_bytes(8, "big")


def cbor_head(major: int, length: int) -> bytes:
    """CBOR initial byte(s) of an item of ``major`` type with argument ``length``."""
    return bytes((major << 5 | cbor_uint(length)[0] & 0x1F,)) + cbor_uint(length)[1:]


def pickle_int(value: int) -> bytes:
    """The C pickler's encoding of 0 <= value < 2**31 (BININT1, BININT2, BININT)."""
    if value < 0x100:
        return b"K" + bytes((value,))
    if value < 0x10000:
        return b"M" + value.to_bytes(2, "little")
    return b"J" + value.to_bytes(4, "little", signed=True)


class TokenTable:
    """Per-token encodings for token ids in ``[0, size)``, grown on demand up to TABLE_CAP.

    The list holds ``size`` encodings followed by ``size`` ``None``s: a negative id (``-k`` for
    ``k <= size``) or one in ``[size, 2*size)`` hits a ``None`` and ``bytes.join`` fails,
    anything further out raises IndexError; both send the call to the reference path.
    """

    def __init__(self, encode: Callable[[int], bytes]) -> None:
        self._encode = encode
        self._table: list[bytes | None] = []
        self._size = 0
        self._lock = threading.Lock()

    def _grow(self, needed: int) -> bool:
        if needed > TABLE_CAP:
            return False
        with self._lock:
            if needed <= self._size:
                return True
            size = max(_TABLE_MIN, 1 << (needed - 1).bit_length())
            enc = self._encode
            table: list[bytes | None] = [enc(i) for i in range(size)]
            table.extend(repeat(None, size))
            self._table, self._size = table, size
        return True

    def lookup(self, tokens: Sequence[int]) -> tuple[bytes | None, ...] | None:
        """The encodings of ``tokens``; a ``None`` entry (or a None result) marks a token
        outside the table, which ``bytes.join`` then rejects."""
        if not self._size:
            self._grow(_TABLE_MIN)
        try:
            if len(tokens) == 1:
                return (self._table[tokens[0]],)
            return operator.itemgetter(*tokens)(self._table)
        except (IndexError, TypeError):
            return None

    def grow_for(self, tokens: Sequence[int]) -> bool:
        """Grow to cover ``tokens`` if that can help; False if it cannot (negative ids,
        ids >= TABLE_CAP, non-integers) or the table already covers them."""
        try:
            lo, hi = operator.index(min(tokens)), operator.index(max(tokens))
        except (TypeError, ValueError):
            return False
        if lo < 0 or hi < self._size:
            return False
        return self._grow(hi + 1)


CBOR_TABLE = TokenTable(cbor_uint)
PICKLE_TABLE = TokenTable(pickle_int)


class _TailCache:
    """Serialized ``extra`` per block, computed once per distinct object.

    Keyed by identity with the object kept alive: two *equal* extras may pickle differently
    (pickle memoizes by identity), so equality is never used for pickle.  CBOR also looks up
    by value.
    """

    def __init__(self, encode: Callable[[Any], bytes], by_value: bool) -> None:
        self._encode = encode
        self._by_value = by_value
        self._by_id: dict[int, tuple[Any, bytes]] = {}
        self._values: dict[Any, bytes] = {}

    def __call__(self, extra: Any) -> bytes:
        hit = self._by_id.get(id(extra))
        if hit is not None and hit[0] is extra:
            return hit[1]
        enc = None
        if self._by_value:
            try:
                enc = self._values.get(extra)
            except TypeError:
                enc = None
        if enc is None:
            enc = self._encode(extra)
            if self._by_value:
                with contextlib.suppress(TypeError):  # unhashable: identity cache only
                    self._values[extra] = enc
        self._by_id[id(extra)] = (extra, enc)
        return enc


def _pickle_extra(extra: Any) -> bytes:
    """The bytes ``extra`` takes inside ``pickle.dumps((parent, tokens, extra))``.

    Memo slots 0 and 1 are the parent and the token tuple in both payloads, so references
    inside ``extra`` (BINGET) get the same indices.  The placeholders are fresh objects: a
    cached singleton (``b"\\x00"``) could be *the same object* as one inside ``extra`` and turn
    it into a memo reference that the real payload does not have.
    """
    if extra is None:
        return b"N"
    parent, tokens = bytes(bytearray(2)), tuple([0])
    prefix = len(pickle_dumps((parent, tokens, None))) - 4  # up to the 'N'
    return pickle_dumps((parent, tokens, extra))[prefix:-3]


def reference_chain(algorithm: Algorithm, parent: bytes, tokens: Sequence[int], block_size: int,
                    extras: Sequence[Any]) -> list[bytes]:
    """vLLM's ``hash_block_tokens`` chain, calling the real serializers per block."""
    out: list[bytes] = []
    hash_object = algorithm.hash_object
    index = operator.index
    for i, extra in enumerate(extras):
        block = tuple(map(index, tokens[i * block_size:(i + 1) * block_size]))
        parent = hash_object((parent, block, extra))
        out.append(parent)
    return out


def _run(algorithm: Algorithm, prefixes: Iterable[bytes], parent: bytes,
         bodies: Sequence[bytes]) -> list[bytes]:
    """``p = F(prefix_i + p + body_i)`` along the chain: the hot loop, one digest per block,
    written out per digest so that no Python-level function call is added per block."""
    p = parent
    pairs = zip(prefixes, bodies, strict=False)  # prefixes may repeat forever
    if algorithm.name.startswith("sha256"):
        sha = hashlib.sha256
        return [p := sha(pre + p + body).digest() for pre, body in pairs]
    digest = algorithm.digest
    return [p := digest(pre + p + body) for pre, body in pairs]


def fast_chain(algorithm: Algorithm, parent: bytes, tokens: Sequence[int], block_size: int,
               extras: Sequence[Any]) -> list[bytes] | None:
    """The same chain as :func:`reference_chain` or None when the fast path does not apply.

    ``tokens`` starts with the ``len(extras) * block_size`` tokens to hash; any further tokens
    (a partial block) are ignored.
    """
    n = len(extras)
    if n == 0:
        return []
    if len(parent) >= 256 or block_size < 1:
        return None
    cbor = algorithm.serializer == "cbor"
    if not cbor and not FAST_PICKLE:
        return None
    table = CBOR_TABLE if cbor else PICKLE_TABLE
    join = b"".join
    if cbor:
        tail_of = _TailCache(cbor_dumps, by_value=True)
        head = cbor_head(4, block_size)
        tails = repeat(b"\xf6", n) if extras.count(None) == n else [tail_of(e) for e in extras]
    else:
        enc = _TailCache(_pickle_extra, by_value=False)
        if block_size <= 3:
            head, close = _MEMOIZE, _TUPLE_N[block_size] + _MEMOIZE
        else:
            head, close = _MEMOIZE + _MARK, _TUPLE + _MEMOIZE
        close_none = close + b"N" + _TUPLE3_MEMO_STOP
        tails = [close + enc(e) + _TUPLE3_MEMO_STOP if e is not None else close_none
                 for e in extras]
    tails = tails if isinstance(tails, list) else list(tails)
    bodies: list[bytes] | None = None
    for attempt in range(2):
        encs = table.lookup(tokens)
        if encs is not None:
            it = iter(encs)
            try:
                # repeat(head, n) ends first: exactly n bodies, a partial tail is left unread
                bodies = list(map(join, zip(repeat(head, n), *[it] * block_size, tails,
                                            strict=False)))
                break
            except TypeError:  # a None from the table: a token outside it
                pass
        if attempt or not table.grow_for(tokens):
            return None
    assert bodies is not None
    size = algorithm.digest_size
    rest = bodies[1:]
    if cbor:
        out = _run(algorithm, (b"\x83" + cbor_head(2, len(parent)),), parent, bodies[:1])
        return out + _run(algorithm, repeat(b"\x83" + cbor_head(2, size)), out[0], rest)
    # pickle: PROTO 5, FRAME <length of the rest>, SHORT_BINBYTES <parent>, then the body
    lengths = set(map(len, bodies))
    if max(lengths) > _PICKLE_FRAME_LIMIT:
        return None

    def header(plen: int, blen: int) -> bytes:
        return (_PROTO5_FRAME + (2 + plen + blen).to_bytes(8, "little") + _SHORT_BINBYTES
                + bytes((plen,)))

    out = _run(algorithm, (header(len(parent), len(bodies[0])),), parent, bodies[:1])
    headers = {blen: header(size, blen) for blen in lengths}
    return out + _run(algorithm, map(headers.__getitem__, map(len, rest)), out[0], rest)


def chain(algorithm: Algorithm, parent: bytes, tokens: Sequence[int], block_size: int,
          extras: Sequence[Any]) -> list[bytes]:
    """Block keys for the first ``len(extras)`` full blocks of ``tokens``, chained from
    ``parent``."""
    fast = fast_chain(algorithm, parent, tokens, block_size, extras)
    if fast is not None:
        return fast
    return reference_chain(algorithm, parent, tokens, block_size, extras)
