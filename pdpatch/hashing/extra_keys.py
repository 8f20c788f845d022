"""The per-block "extra keys" of vLLM, release by release, as a port of its own scan.

``E_i`` is the third element of each hashed 3-tuple.  vLLM builds it in
``generate_block_hash_extra_keys``: LoRA keys, then multimodal keys, then the cache salt (block
0, non-empty salt only), then prompt-embeds keys; ``None`` when all four are empty.  The shapes
changed in 0.11.1, 0.17, 0.19 and 0.31 (see :mod:`pdpatch.hashing.formats`).

The multimodal part is a line-by-line port of vLLM's stateful scan (``_gen_mm_extra_hash_keys``)
rather than the simpler "overlap" rule, so that touching items (two images back to back) and the
decode-time quirks of releases <= 0.30 come out exactly as vLLM computes them.

Pickle (algorithms ``sha256`` and ``xxhash``) memoizes objects by identity: inside one block's
extra keys, an object that appears twice is written once and then referenced, so such a key
depends on whether two equal strings are one object or two.  A vLLM server holds a separate
string object for every string field of a request (its JSON decoder makes one per occurrence;
multimodal hashes are computed per item): the LoRA name and path, each multimodal identifier,
the salt -- except the empty string and one-character Latin-1 strings, which CPython shares in
every process.  To match it, give every field its own object (a JSON decoder's output, or
strings built one by one, as ``pdpatch hash`` does), never one cached or interned object for
two fields (e.g. the identifier of an image that occurs twice in a prompt).  The tags
(``"lora"``, ``"mm"``, ...) are code constants, one object each, here as in vLLM.  The CBOR
algorithms (``sha256_cbor``, ``xxhash_cbor``) do not depend on identity.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdpatch.hashing import inputs
from pdpatch.hashing.errors import HashingError, InputError
from pdpatch.hashing.formats import HashFormat


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter as the *prefill server registered it*.

    Which fields count depends on the release, and the one it hashes is required:

    * ``name`` (every release): the adapter name a request selects (the ``model`` field);
    * ``path`` (hashed by 0.31+): the string given to ``--lora-modules name=path`` or
      ``load_lora_adapter``, verbatim (not normalised); every vLLM since 0.14 asserts it is
      non-empty, so no server ever hashes an empty one;
    * ``int_id`` (hashed by <= 0.11.0 instead of the name): ``lora_int_id``, which depends on the
      order in which the server registered its adapters (the first is 1).
    """

    name: str
    path: str | None = None
    int_id: int | None = None


@dataclass(frozen=True)
class MMItem:
    """One multimodal item: its identifier (vLLM's ``MultiModalFeatureSpec.identifier``, the
    mm hash or the client's uuid, ``"{lora}:{hash}"`` with tower-connector LoRA) and its
    placeholder range in the prompt."""

    identifier: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class PromptEmbeds:
    """A prompt given as embeddings: the tensor's flattened, contiguous CPU bytes (what
    vLLM's ``tensor_data`` views as uint8) and the bytes of one position (hidden * itemsize).

    vLLM hashes ``prompt_embeds[s:e]`` per block: the raw bytes (0.11.1-0.16) or their sha256
    (0.17+); a block past the prompt hashes the empty slice.  Positions given as embeddings
    hold token id 0 in the token sequence.
    """

    data: bytes | bytearray | memoryview
    row_bytes: int
    _digests: dict[tuple[int, int], bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, bytearray, memoryview)):
            raise InputError("PromptEmbeds: data must be the tensor's bytes, got "
                             f"{type(self.data).__name__}")
        if isinstance(self.data, memoryview) and self.data.format != "B":
            try:  # lengths and slices below count bytes
                self.data = self.data.cast("B")
            except TypeError:
                raise InputError("PromptEmbeds: data must be contiguous") from None
        inputs.positive_int(self.row_bytes, "PromptEmbeds: row_bytes")
        if not self.data or len(self.data) % self.row_bytes:
            raise InputError("PromptEmbeds: data must be a whole number (at least one) of rows "
                             f"of row_bytes={self.row_bytes}, got {len(self.data)} bytes")

    @property
    def num_rows(self) -> int:
        return len(self.data) // self.row_bytes

    def block_bytes(self, start: int, end: int) -> bytes:
        rows = self.num_rows
        s, e = min(start, rows), min(end, rows)
        return bytes(self.data[s * self.row_bytes:e * self.row_bytes])

    def block_digest(self, start: int, end: int) -> bytes:
        # vLLM caches the digest per (start, end) on the request; so do we (same object reused).
        d = self._digests.get((start, end))
        if d is None:
            d = self._digests[(start, end)] = hashlib.sha256(self.block_bytes(start, end)).digest()
        return d


def _check_mm(items: Sequence[MMItem] | None, prompt_length: int) -> tuple[MMItem, ...]:
    if items is None:  # vLLM's own "no items" (mm_features=None)
        return ()
    if isinstance(items, (str, bytes, MMItem)) or not isinstance(items, Sequence):
        raise InputError(f"multimodal items must be a sequence of MMItem, got "
                         f"{type(items).__name__}")
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, MMItem):
            raise InputError(f"multimodal items must be MMItem, got {type(it).__name__}")
        # plain ints (offsets end up in the keys), the identifier object itself kept as given
        out.append(MMItem(inputs.text(it.identifier, f"multimodal item #{i}: identifier",
                                      empty=False),
                          inputs.positive_int(it.offset, f"multimodal item #{i}: offset",
                                              minimum=0),
                          inputs.positive_int(it.length, f"multimodal item #{i}: length")))
    inputs.mm_ranges([(it.offset, it.length) for it in out], prompt_length)
    return tuple(out)


def _lora_keys(fmt: HashFormat, lora: LoraSpec | None) -> list[Any]:
    if lora is None:
        return []
    if not isinstance(lora, LoraSpec):
        raise InputError(f"lora must be a LoraSpec, got {type(lora).__name__}")
    name = inputs.text(lora.name, "LoRA name", empty=False)
    path = None if lora.path is None else inputs.text(lora.path, "LoRA path")
    int_id = None if lora.int_id is None else inputs.positive_int(lora.int_id, "LoRA int_id")
    if fmt.lora_key == "tagged":
        if not path:
            raise InputError(
                f"vLLM {fmt.release} hashes the LoRA adapter's path: give the path the server "
                "registered it with (--lora-modules NAME=PATH), verbatim; every vLLM since "
                "0.14 refuses an empty path, so keys without it never match")
        return [("lora", name, path)]
    if fmt.lora_key == "name":
        return [name]
    if int_id is None:
        raise InputError(
            f"vLLM {fmt.release} hashes the LoRA adapter's lora_int_id, not its name: give "
            "the id the server assigned (its registration order, the first adapter is 1)")
    return [int_id]


class ExtraKeys:
    """``generate_block_hash_extra_keys`` of one release, for one request's fixed inputs."""

    def __init__(self, fmt: HashFormat, *, prompt_length: int, lora: LoraSpec | None = None,
                 mm: Sequence[MMItem] | None = (), cache_salt: str | None = None,
                 prompt_embeds: PromptEmbeds | None = None) -> None:
        self.fmt = fmt
        self.mm = _check_mm(mm, prompt_length)
        self.cache_salt = None if cache_salt is None else inputs.text(cache_salt, "cache_salt")
        if prompt_embeds is not None:
            if not isinstance(prompt_embeds, PromptEmbeds):
                raise InputError(f"prompt_embeds must be PromptEmbeds, got "
                                 f"{type(prompt_embeds).__name__}")
            if prompt_embeds.num_rows != prompt_length:
                raise InputError(
                    f"prompt_embeds has {prompt_embeds.num_rows} rows for a prompt of "
                    f"{prompt_length} tokens: vLLM's prompt is one position per row (give "
                    "token id 0 for each)")
        # <= 0.11.0 hashed an embeddings prompt as its placeholder token ids (0) alone, so two
        # different embeddings prompts collide there; reproduce that rather than refuse.
        self.prompt_embeds = prompt_embeds if fmt.embeds_key != "none" else None
        self.lora_keys: list[Any] = _lora_keys(fmt, lora)

    @property
    def constant(self) -> bool:
        """True when only LoRA and the salt contribute (no per-block scan needed)."""
        return not self.mm and self.prompt_embeds is None

    def mm_keys(self, start: int, end: int, start_mm_idx: int) -> tuple[list[Any], int]:
        """Port of ``_gen_mm_extra_hash_keys`` (0.10.2 .. 0.34; 0.34.0 kv_cache_utils.py L518,
        unchanged from 0.33)."""
        keys: list[Any] = []
        items = self.mm
        if not items:
            return keys, start_mm_idx
        strict = self.fmt.mm_strict_bounds
        last_end = items[-1].end
        if (last_end <= start) if strict else (last_end < start):
            return keys, start_mm_idx
        if start_mm_idx < 0:
            if -start_mm_idx > len(items):  # vLLM asserts
                raise HashingError("multimodal scan index out of range")
            start_mm_idx = len(items) + start_mm_idx
        shape = self.fmt.mm_key
        idx = start_mm_idx
        while idx < len(items):
            item = items[idx]
            offset, item_end = item.offset, item.end
            if end > offset:
                if (start >= item_end) if strict else (start > item_end):
                    idx += 1
                    continue
                if shape == "tagged":
                    keys.append(("mm", item.identifier, offset - start))
                elif shape == "pair":
                    keys.append((item.identifier, offset - start))
                else:
                    keys.append(item.identifier)
                if end >= item_end:
                    idx += 1
                else:
                    break
            else:
                break
        return keys, idx

    def _embeds_keys(self, start: int, end: int) -> list[Any]:
        pe = self.prompt_embeds
        if pe is None:
            return []
        kind = self.fmt.embeds_key
        if kind == "raw":
            return [pe.block_bytes(start, end)]
        digest = pe.block_digest(start, end)
        return [("prompt_embeds", digest)] if kind == "tagged" else [digest]

    def salt_keys(self, start: int) -> list[Any]:
        if start == 0 and self.cache_salt:
            return [("cache_salt", self.cache_salt)] if self.fmt.salt_key == "tagged" \
                else [self.cache_salt]
        return []

    def block(self, start: int, end: int, mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
        """``generate_block_hash_extra_keys(request, start, end, mm_idx)``."""
        mm_keys, mm_idx = self.mm_keys(start, end, mm_idx)
        keys = self.lora_keys + mm_keys + self.salt_keys(start) + self._embeds_keys(start, end)
        return (tuple(keys) if keys else None), mm_idx

    def lookahead_block(self, start: int, end: int, hash_end: int, mm_idx: int
                        ) -> tuple[tuple[Any, ...] | None, int]:
        """``generate_lookahead_block_hash_extra_keys`` (0.33+; 0.34.0 kv_cache_utils.py L1060,
        unchanged from 0.33): keys of ``[start, hash_end)``, then rewind the MM index to items
        that still overlap the next block."""
        keys, mm_idx = self.block(start, hash_end, mm_idx)
        while mm_idx > 0:
            if self.mm[mm_idx - 1].end <= end:
                break
            mm_idx -= 1
        return keys, mm_idx

    def resume_index(self, start: int) -> int:
        """The MM index a hasher call starting at token ``start`` begins with."""
        if start == 0 or not self.mm:
            return 0
        if self.fmt.mm_resume == "last_item":
            # <= 0.30: "we only need to consider the last mm input" (not true for a block that
            # also overlaps an earlier item; vLLM's keys then miss it, and so do ours).
            return -1
        if self.mm[-1].end > start:
            return bisect.bisect_left(self.mm, start + 1, key=lambda it: it.end)
        return 0


def to_event_extra_keys(extra_keys: Sequence[tuple[Any, ...] | None] | None
                        ) -> list[tuple[Any, ...] | None] | None:
    """vLLM 0.31+'s untagged projection of per-block extra keys for KV events
    (``to_event_extra_keys``): LoRA -> name (the path is dropped), MM -> (identifier, offset),
    salt and prompt-embeds digest -> the bare value."""
    if not extra_keys:
        return None
    out = [None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
           for keys in extra_keys]
    return out or None
