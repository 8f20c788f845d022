"""The per-block "extra keys" of vLLM, release by release, as a port of its own scan.

``E_i`` is the third element of each hashed 3-tuple.  vLLM builds it in
``generate_block_hash_extra_keys``: LoRA keys, then multimodal keys, then the cache salt (block
0, non-empty salt only), then prompt-embeds keys; ``None`` when all four are empty.  The shapes
changed in 0.12, 0.17, 0.19 and 0.31 (see :mod:`pdpatch.hashing.formats`).

The multimodal part is a line-by-line port of vLLM's stateful scan (``_gen_mm_extra_hash_keys``)
rather than the simpler "overlap" rule, so that odd inputs (zero-length or touching items) and
the decode-time quirks of releases <= 0.30 come out exactly as vLLM computes them.

Pickle (algorithms ``sha256`` and ``xxhash``) memoizes objects by identity: an identifier object
that appears twice in one block pickles differently from two equal strings.  The tags
(``"lora"``, ``"mm"``, ...) are code constants here as in vLLM; every other object is used as
given, so pass the very objects vLLM holds (``request.lora_request.lora_name``, ...) when
identity could matter.
"""

from __future__ import annotations

import bisect
import hashlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdpatch.hashing.errors import HashingError
from pdpatch.hashing.formats import HashFormat


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter as the *prefill server registered it*.

    ``path`` is hashed verbatim by vLLM >= 0.31 (the string given to ``--lora-modules
    name=path`` or ``load_lora_adapter``, not normalised); ``int_id`` only by <= 0.11, where it
    depends on registration order.
    """

    name: str
    path: str = ""
    int_id: int = 1


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

    vLLM hashes ``prompt_embeds[s:e]`` per block: the raw bytes (0.12-0.16) or their sha256
    (0.17+); a block past the prompt hashes the empty slice.  Positions given as embeddings
    hold token id 0 in the token sequence.
    """

    data: bytes | bytearray | memoryview
    row_bytes: int
    _digests: dict[tuple[int, int], bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.row_bytes <= 0 or len(self.data) % self.row_bytes:
            raise HashingError("PromptEmbeds: data must be a whole number of rows of row_bytes")

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


def _check_mm(items: Sequence[MMItem]) -> tuple[MMItem, ...]:
    out = []
    for it in items:
        if not isinstance(it, MMItem):
            raise HashingError(f"multimodal items must be MMItem, got {type(it).__name__}")
        if it.identifier is None:
            raise HashingError("a multimodal item needs an identifier (vLLM asserts it)")
        # plain ints (offsets end up in the keys), the identifier object itself kept as given
        out.append(MMItem(it.identifier, operator.index(it.offset), operator.index(it.length)))
    return tuple(out)


class ExtraKeys:
    """``generate_block_hash_extra_keys`` of one release, for one request's fixed inputs."""

    def __init__(self, fmt: HashFormat, *, lora: LoraSpec | None = None,
                 mm: Sequence[MMItem] = (), cache_salt: str | None = None,
                 prompt_embeds: PromptEmbeds | None = None) -> None:
        self.fmt = fmt
        self.mm = _check_mm(mm)
        self.cache_salt = cache_salt
        # <= 0.11 hashed an embeddings prompt as its placeholder token ids (0) alone, so two
        # different embeddings prompts collide there; reproduce that rather than refuse.
        self.prompt_embeds = prompt_embeds if fmt.embeds_key != "none" else None
        self.lora_keys: list[Any]
        if not lora:
            self.lora_keys = []
        elif fmt.lora_key == "tagged":
            self.lora_keys = [("lora", lora.name, lora.path)]
        elif fmt.lora_key == "name":
            self.lora_keys = [lora.name]
        else:
            self.lora_keys = [operator.index(lora.int_id)]

    @property
    def constant(self) -> bool:
        """True when only LoRA and the salt contribute (no per-block scan needed)."""
        return not self.mm and self.prompt_embeds is None

    def mm_keys(self, start: int, end: int, start_mm_idx: int) -> tuple[list[Any], int]:
        """Port of ``_gen_mm_extra_hash_keys`` (0.10.2 .. 0.33)."""
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
        """``generate_lookahead_block_hash_extra_keys`` (0.33): keys of ``[start, hash_end)``,
        then rewind the MM index to items that still overlap the next block."""
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
