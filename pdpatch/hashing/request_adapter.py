"""Read a vLLM ``Request``'s hashing inputs by duck typing (no vLLM import).

For patches running inside vLLM: the attributes read here exist on ``vllm.v1.request.Request``
from 0.10.2 through 0.34 (``prompt_token_ids``, ``all_token_ids``, ``num_prompt_tokens``,
``lora_request``, ``cache_salt``, ``mm_features``, ``prompt_embeds``; 0.34.0 request.py L93,
L139-163, L192-201: ``prompt_token_ids`` and ``_all_token_ids`` are int32 ``TokenBuffer``s there,
whose slices are lists of ints).  The very string objects vLLM holds are passed through, so
pickle's identity memo sees what vLLM's hasher sees.

``upto`` (the functions' keyword) takes the prompt's first ``upto`` tokens only -- what a
prefill engine that stops short of the prompt's last tokens computed, or what a decode engine
loads of it (:mod:`pdpatch.patches.block_keys`): multimodal items are cut at it (an item
starting there or later dropped) and prompt embeddings to its rows.  Keys of the blocks before
it do not change (an item's key is its identifier and offset).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdpatch.hashing.config import KeyConfig
from pdpatch.hashing.errors import InputError
from pdpatch.hashing.extra_keys import LoraSpec, MMItem, PromptEmbeds
from pdpatch.hashing.keys import BlockKeyHasher


def prompt_tokens(request: Any, upto: int | None = None) -> list[int]:
    """The prompt part of ``all_token_ids`` (embedding positions already hold 0 there), its
    first ``upto`` tokens."""
    n = request.num_prompt_tokens if upto is None else min(upto, request.num_prompt_tokens)
    all_ids = getattr(request, "all_token_ids", None)
    if all_ids is not None and len(all_ids) >= n:
        return list(all_ids[:n])
    ids = request.prompt_token_ids
    return list(ids) if ids is not None else [0] * n


def request_inputs(request: Any, *, embeds_bytes: Callable[[Any], bytes] | None = None,
                   upto: int | None = None) -> dict[str, Any]:
    """``lora``, ``mm``, ``cache_salt`` and ``prompt_embeds`` of a vLLM request (of its first
    ``upto`` prompt tokens).

    ``embeds_bytes(tensor)`` must return the tensor's flattened contiguous CPU bytes (vLLM's
    ``bytes(vllm.v1.utils.tensor_data(t))``); without it an embeddings prompt raises.
    """
    lr = getattr(request, "lora_request", None)
    lora = LoraSpec(lr.lora_name, lr.lora_path, lr.lora_int_id) if lr else None
    mm = [MMItem(f.identifier, f.mm_position.offset, f.mm_position.length)
          for f in (getattr(request, "mm_features", None) or [])]
    if upto is not None:
        mm = [MMItem(i.identifier, i.offset, min(i.length, upto - i.offset))
              for i in mm if i.offset < upto]
    pe = getattr(request, "prompt_embeds", None)
    embeds = None
    if pe is not None:
        if embeds_bytes is None:
            raise InputError("an embeddings prompt needs embeds_bytes to read the tensor")
        data = embeds_bytes(pe)
        rows = len(pe)
        row = len(data) // rows if rows else 1
        if upto is not None and upto < rows:
            data = data[:upto * row]
        embeds = PromptEmbeds(data, row)
    return {"lora": lora, "mm": mm, "cache_salt": getattr(request, "cache_salt", None),
            "prompt_embeds": embeds}


def hasher_for_request(config: KeyConfig, request: Any, *,
                       embeds_bytes: Callable[[Any], bytes] | None = None) -> BlockKeyHasher:
    """Keys of the request's prompt blocks under ``config`` (what P and D both compute)."""
    return config.hasher(prompt_tokens(request),
                         **request_inputs(request, embeds_bytes=embeds_bytes))
