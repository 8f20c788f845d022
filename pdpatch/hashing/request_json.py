"""A request's hashing inputs from JSON: the input format of ``pdpatch hash``.

A router or KV store holds a request as JSON, so this is the format it can hand over as it is:
the token ids, or an object with vLLM's own field names.  Every value is checked here for its
JSON type and shape, and by the library for its range, so that a malformed document is one
:class:`~pdpatch.hashing.errors.InputError` naming the field -- never a key computed from a
document no server would accept (an unknown field is an error too: a misspelt ``cache_salt``
would otherwise leave the salt out silently)::

    {"prompt_token_ids": [1, 2, ...],
     "lora": {"name": "adapter", "path": "/adapters/adapter", "id": 1},
     "cache_salt": "tenant-a",
     "mm": [{"identifier": "<mm hash or uuid>", "offset": 5, "length": 576}],
     "prompt_embeds": {"base64": "<the tensor's bytes>", "hidden_size": 4096,
                       "dtype": "bfloat16"}}

Every string is a separate object as ``json`` decodes it, which is what a vLLM server holds
(see :mod:`pdpatch.hashing.extra_keys` on pickle's identity memo).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdpatch.hashing.errors import InputError, shown
from pdpatch.hashing.extra_keys import LoraSpec, MMItem, PromptEmbeds

MAX_INPUT_BYTES = 64 << 20
"""About 9 million token ids as JSON: more than any model's context."""
FIELDS = ("prompt_token_ids", "prompt_embeds", "lora", "cache_salt", "mm")
EMBEDS_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
_LORA_FIELDS = ("name", "path", "id")
_MM_FIELDS = ("identifier", "offset", "length")
_EMBEDS_FIELDS = ("base64", "hidden_size", "dtype")
_ID_TEXT = re.compile(r"[0-9]{1,20}")


@dataclass
class RequestSpec:
    """Token ids and the extra-key inputs of one request (keywords of ``KeyConfig.hasher``)."""

    tokens: list[Any]
    inputs: dict[str, Any] = field(default_factory=dict)


def _object(value: Any, what: str, fields: tuple[str, ...], required: tuple[str, ...]
            ) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise InputError(f"{what} must be an object with {', '.join(fields)}, got "
                         f"{shown(value)}")
    unknown = [k for k in value if k not in fields]
    if unknown:
        raise InputError(f"{what} has unknown field {shown(unknown[0])}; its fields are "
                         f"{', '.join(fields)}")
    missing = [k for k in required if k not in value]
    if missing:
        raise InputError(f"{what} has no {missing[0]!r}")
    return value


def _int(value: Any, what: str) -> int:
    """A JSON integer (not a bool or a float; ranges are the library's to check)."""
    if type(value) is not int:
        raise InputError(f"{what} must be an integer, got {shown(value)}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"{what} must be a string, got {shown(value)}")
    return value


def lora_from(value: Any) -> LoraSpec:
    """``{"name", "path", "id"}``; the fields the release hashes are checked by the library."""
    d = _object(value, "lora", _LORA_FIELDS, ("name",))
    path = d.get("path")
    lora_id = d.get("id")
    return LoraSpec(_str(d["name"], "lora.name"),
                    None if path is None else _str(path, "lora.path"),
                    None if lora_id is None else _int(lora_id, "lora.id"))


def mm_from(value: Any) -> list[MMItem]:
    """``[{"identifier", "offset", "length"}, ...]`` in prompt order."""
    if not isinstance(value, list):
        raise InputError(f"mm must be a list of items, got {shown(value)}")
    items = []
    for i, item in enumerate(value):
        d = _object(item, f"mm[{i}]", _MM_FIELDS, _MM_FIELDS)
        items.append(MMItem(_str(d["identifier"], f"mm[{i}].identifier"),
                            _int(d["offset"], f"mm[{i}].offset"),
                            _int(d["length"], f"mm[{i}].length")))
    return items


def embeds_from(data: bytes, hidden_size: Any, dtype: Any) -> PromptEmbeds:
    """The tensor's raw bytes, row-major, in ``dtype`` (one of :data:`EMBEDS_DTYPES`)."""
    if dtype not in EMBEDS_DTYPES:
        raise InputError(f"prompt_embeds dtype must be one of {', '.join(EMBEDS_DTYPES)}, got "
                         f"{shown(dtype)}")
    hidden = _int(hidden_size, "prompt_embeds hidden_size")
    if hidden < 1:
        raise InputError(f"prompt_embeds hidden_size must be >= 1, got {hidden}")
    return PromptEmbeds(data, hidden * EMBEDS_DTYPES[dtype])


def _embeds_json(value: Any) -> PromptEmbeds:
    d = _object(value, "prompt_embeds", _EMBEDS_FIELDS, _EMBEDS_FIELDS)
    try:
        data = base64.b64decode(_str(d["base64"], "prompt_embeds.base64"), validate=True)
    except (binascii.Error, ValueError):
        raise InputError("prompt_embeds.base64 is not base64") from None
    return embeds_from(data, d["hidden_size"], d["dtype"])


def parse_document(doc: Any) -> RequestSpec:
    """A decoded JSON document: a list of token ids, or an object of :data:`FIELDS`."""
    if isinstance(doc, list):
        return RequestSpec(doc)
    d = _object(doc, "the request", FIELDS, ())
    spec = RequestSpec([])
    if "prompt_token_ids" in d:
        if not isinstance(d["prompt_token_ids"], list):
            raise InputError(f"prompt_token_ids must be a list of token ids, got "
                             f"{shown(d['prompt_token_ids'])}")
        spec.tokens = d["prompt_token_ids"]
    if d.get("lora") is not None:
        spec.inputs["lora"] = lora_from(d["lora"])
    if d.get("cache_salt") is not None:
        spec.inputs["cache_salt"] = _str(d["cache_salt"], "cache_salt")
    if d.get("mm") is not None:
        spec.inputs["mm"] = mm_from(d["mm"])
    if d.get("prompt_embeds") is not None:
        spec.inputs["prompt_embeds"] = _embeds_json(d["prompt_embeds"])
    return spec


def parse_text(text: str) -> RequestSpec:
    """JSON (a list or an object), or token ids separated by spaces or commas."""
    text = text.strip()
    if text[:1] in ("[", "{"):
        try:
            doc = json.loads(text)
        except RecursionError:
            raise InputError("the JSON input is nested too deeply") from None
        except ValueError as e:
            raise InputError(f"the input is not valid JSON: {e}") from None
        return parse_document(doc)
    pieces = [p for p in re.split(r"[\s,]+", text) if p]
    for p in pieces:
        if not _ID_TEXT.fullmatch(p):
            raise InputError(f"not a token id: {p[:40]!r} (ids are non-negative integers)")
    return RequestSpec([int(p) for p in pieces])


def decode_input(raw: bytes) -> RequestSpec:
    """:func:`parse_text` of raw input bytes, bounded by :data:`MAX_INPUT_BYTES`."""
    if len(raw) > MAX_INPUT_BYTES:
        raise InputError(f"the input is larger than {MAX_INPUT_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError("the input is not UTF-8 text") from None
    return parse_text(text)
