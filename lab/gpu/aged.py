"""An aged decode engine: D's free KV blocks made to lie apart by earlier traffic, before the
measured requests (scenarios ``ref-aged`` and ``coalesce-aged`` of :mod:`lab.gpu.pd`).

Why it matters: on vLLM 0.26+ a fresh D's READ is fast because NIXL merges a request's blocks
into one descriptor per layer where both sides' blocks are adjacent -- and a fresh engine hands
out adjacent blocks: vLLM's free-block queue starts as every block in order, a request takes
blocks from its head, and a finished request's blocks go back to its tail (last block first).
A D that has served for a while hands out what earlier requests freed, in the order they
finished, so a new request's blocks lie apart and stock's READ posts one descriptor per block
and layer again; ``PDPATCH_KV_COALESCE=1`` reads P's adjacent blocks into its staging buffer in
runs and copies them into D's blocks locally.  ``docs/coalescing.md`` says this case was never
measured on a GPU.

How D is aged (:func:`age`): local requests to D alone (no P, no NIXL), :data:`IN_FLIGHT` at a
time, of mixed prompt lengths and mixed output lengths drawn from a seeded generator
(:func:`plan_aging`), each under its own ``cache_salt`` so no prefix is shared, until they have
asked for :data:`CYCLES` times D's KV cache: every block of the fresh queue has been handed out
at least once, chunked prefills and decodes of the requests in flight took blocks in
interleaved steps, and the requests finished in an order unlike the one they were sent in
(``inversions`` records how unlike).  The evidence that D's blocks then lie apart is the
measured requests' own: stock's descriptors per READ (``vllm:nixl_num_descriptors``) before and
after, recorded per sample.
"""

from __future__ import annotations

import concurrent.futures
import random
import re
import time
from collections.abc import Callable
from typing import Any

IN_FLIGHT = 32
CYCLES = 1.5
"""How many times D's KV cache the aging requests' prompts and outputs add up to."""
PROMPT_RANGE = (64, 4000)
OUTPUT_RANGE = (1, 48)
BLOCK_SIZE = 16


def kv_bytes_per_token(cfg: dict[str, Any], tp: int = 1, dtype_bytes: int = 2) -> int:
    """KV cache bytes one token takes on one rank: K and V of the rank's KV heads per layer,
    or MLA's latent (every rank holds all of it)."""
    layers = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        return layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * dtype_bytes
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    heads = max(1, cfg["num_key_value_heads"] // tp)
    return 2 * layers * heads * head_dim * dtype_bytes


def cache_tokens(kv_cache_bytes: int, cfg: dict[str, Any], tp: int = 1) -> int:
    """Tokens a ``--kv-cache-memory-bytes`` cache holds, in whole blocks (what vLLM makes of it,
    less nothing: the engine's log says the exact figure, :func:`logged_cache_tokens`)."""
    per_block = BLOCK_SIZE * kv_bytes_per_token(cfg, tp)
    return kv_cache_bytes // per_block * BLOCK_SIZE


_LOGGED = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def logged_cache_tokens(log_text: str) -> int | None:
    """The KV cache size a vLLM engine logged at start-up (its first rank's), or None."""
    m = _LOGGED.search(log_text)
    return int(m[1].replace(",", "")) if m else None


def plan_aging(cache_tokens_: int, rng: random.Random, max_model_len: int,
               cycles: float = CYCLES) -> list[tuple[int, int]]:
    """(prompt length, output length) of each aging request, until their tokens reach
    ``cycles`` times the cache; every request fits ``max_model_len``."""
    lo, hi = PROMPT_RANGE
    hi = min(hi, max_model_len - OUTPUT_RANGE[1] - 1)
    want = cycles * cache_tokens_
    out: list[tuple[int, int]] = []
    total = 0
    while total < want:
        n, m = rng.randint(lo, hi), rng.randint(*OUTPUT_RANGE)
        out.append((n, m))
        total += n + m
    return out


def inversions(order: list[int]) -> float:
    """The share of request pairs that finished in the other order than they were sent:
    0 when they finished as sent, about 0.5 when the order is unrelated."""
    n = len(order)
    if n < 2:
        return 0.0
    inv = sum(1 for i in range(n) for j in range(i + 1, n) if order[i] > order[j])
    return inv / (n * (n - 1) / 2)


def age(complete: Callable[..., dict], cache_tokens_: int, max_model_len: int,
        seed: int = 29, in_flight: int = IN_FLIGHT) -> dict[str, Any]:
    """Age D: the requests :func:`plan_aging` draws, sent ``in_flight`` at a time through
    ``complete(prompt, max_tokens, salt=...)`` (D's :meth:`~lab.gpu.engines.Engine.complete`),
    each a fresh random prompt under its own salt.  Returns what was sent and how it went."""
    rng = random.Random(seed)
    plan = plan_aging(cache_tokens_, rng, max_model_len)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n, _ in plan]
    finished: list[int] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        futs = {pool.submit(complete, prompts[i], m, salt=f"age-{seed}-{i}"): i
                for i, (_, m) in enumerate(plan)}
        for f in concurrent.futures.as_completed(futs):
            i = futs[f]
            finished.append(i)
            if err := f.result().get("error"):
                errors.append(f"request {i}: {err}"[:160])
    return {"requests": len(plan), "prompt_tokens": sum(n for n, _ in plan),
            "output_tokens": sum(m for _, m in plan), "cache_tokens": cache_tokens_,
            "cycles": round(sum(n + m for n, m in plan) / max(1, cache_tokens_), 2),
            "in_flight": in_flight, "seed": seed,
            "seconds": round(time.perf_counter() - t0, 1),
            "inversions": round(inversions(finished), 3), "errors": errors[:10],
            "failed": len(errors)}
