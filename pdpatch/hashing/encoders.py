"""A fast chain of block hashes that writes the serializers' bytes itself.

vLLM computes each block as ``F((parent, tuple(tokens), extra))``: per block a tuple, a
``cbor2.dumps`` / ``pickle.dumps`` call and a digest.  Here the per-block serializer calls go:

* the token ids of *all* blocks are serialized in **one** call of the same serializer (CBOR:
  ``cbor2`` encodes ints shortest-form, as inside the payload; pickle: protocol 2, unframed, whose
  ``BININT1``/``BININT2``/``BININT`` opcodes are the ones protocol 5 writes), and a regex that
  consumes exactly ``block_size`` integer items per match cuts that stream into the blocks'
  token encodings (an item's length is fixed by its first byte, so the cut is unambiguous);
* the fixed framing is written around each block (CBOR: array(3), byte-string header, array
  header; pickle: PROTO 5, FRAME <length>, SHORT_BINBYTES, MEMOIZE, MARK ... TUPLE, TUPLE3, STOP);
* ``extra`` is serialized by the real ``cbor2`` / ``pickle`` (once per distinct object), so
  strings, negative offsets and bytes keep their exact encoding and pickle memo references.

What the stream does not cover (negative or >= 2**64 ids under CBOR, ids outside int32 under
pickle, bools, numpy scalars, a pickle payload near the 64 KiB frame size, an interpreter whose
``pickle.HIGHEST_PROTOCOL`` is not 5) fails a length check and takes the reference path,
:func:`reference_chain`, which calls the serializers per block exactly as vLLM does.  Tests
compare the two byte for byte on random inputs of every integer width.

Where pdpatch was installed with its compiled encoder (``_block_items.c``, built by the wheel's
build hook), the token items of every block come from one C call instead of the stream
(:data:`C_ENCODER`); it answers only for lists/tuples of exact ints (CBOR: [0, 2**63), pickle:
int32) and leaves everything else to the paths above.

Why a stream and not a per-token lookup table: a table of every token's encoding is faster while
it sits in the CPU cache, but one request's worth of random lookups into ~14 MB is not cached
when a request arrives; measured interleaved with vLLM's own work it was no faster than vLLM
(``scripts/bench_block_keys.py``), the stream stays ~2x faster.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import operator
import pickle
import re
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Any

from pdpatch.hashing.algorithms import Algorithm, cbor_dumps, pickle_dumps

try:
    from pdpatch.hashing import _block_items as _compiled
except ImportError:  # built without a C compiler: the pure-Python stream below
    _compiled = None

C_ENCODER = _compiled is not None
"""Whether the compiled block encoder is present (``pdpatch doctor`` reports it)."""

# pickle opcodes (Lib/pickle.py)
_PROTO5_FRAME = b"\x80\x05\x95"
_SHORT_BINBYTES = b"C"
_MEMOIZE = b"\x94"
_MARK = b"("
_TUPLE = b"t"
_TUPLE_N = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
_TUPLE3_MEMO_STOP = b"\x87\x94."
_PICKLE_FRAME_LIMIT = 64 * 1024 - 256  # the C pickler splits frames at 64 KiB: stay below
FAST_PICKLE = pickle.HIGHEST_PROTOCOL == 5

# one integer item, alternatives in the order of how often token ids need them
_CBOR_UINT = rb"(?:\x19..|\x1a....|\x18.|[\x00-\x17]|\x1b.{8})"
_PICKLE_INT = rb"(?:M..|J....|K.)"
_UNROLL = 64  # up to this block size the item pattern is repeated literally (faster than {n})


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
    arg = cbor_uint(length)
    return bytes((major << 5 | arg[0] & 0x1F,)) + arg[1:]


@functools.lru_cache(maxsize=64)
def _block_pattern(item: bytes, block_size: int) -> re.Pattern[bytes]:
    body = item * block_size if block_size <= _UNROLL else item + b"{%d}" % block_size
    return re.compile(body, re.DOTALL)


def block_token_encodings(tokens: Sequence[int], count: int, block_size: int, cbor: bool
                          ) -> list[bytes] | None:
    """The serialized token ids of each of the first ``count`` blocks (without the array /
    tuple framing), or None where the stream is not plain ints of the fast widths."""
    if _compiled is not None and type(tokens) in (list, tuple):
        items = _compiled.cbor_items if cbor else _compiled.pickle_items
        blocks = items(tokens, count, block_size)
        if blocks is not None:
            return blocks
    total = count * block_size
    toks = tokens[:total] if len(tokens) != total or not isinstance(tokens, list) else tokens
    try:
        if cbor:
            stream = cbor_dumps(list(toks) if not isinstance(toks, list) else toks)
            start, end = len(cbor_head(4, total)), len(stream)
        else:
            if total < 4:  # TUPLE1..3 framing; not worth a special case
                return None
            stream = pickle.dumps(tuple(toks), protocol=2)
            start, end = 3, len(stream) - 4  # PROTO 2, MARK | items | TUPLE, BINPUT 0, STOP
    except Exception:  # e.g. numpy scalars under cbor2: the reference path decides
        return None
    blocks = _block_pattern(_CBOR_UINT if cbor else _PICKLE_INT, block_size).findall(
        stream, start, end)
    # matches are disjoint and in order: covering every byte means they tile the stream
    if len(blocks) != count or sum(map(len, blocks)) != end - start:
        return None
    return blocks


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
            with contextlib.suppress(TypeError):  # unhashable: identity cache only
                enc = self._values.get(extra)
        if enc is None:
            enc = self._encode(extra)
            if self._by_value:
                with contextlib.suppress(TypeError):
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
    """The same chain as :func:`reference_chain`, or None when the fast path does not apply.

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
    blocks = block_token_encodings(tokens, n, block_size, cbor)
    if blocks is None:
        return None
    tails: Iterable[bytes]
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
    bodies = list(map(b"".join, zip(repeat(head, n), blocks, tails, strict=False)))
    size = algorithm.digest_size
    rest = bodies[1:]
    if cbor:  # array(3), byte string <parent>, then the body
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
