"""Route requests the way a P/D proxy does, and measure them.

The flow is vLLM's own toy P/D proxy (``examples/.../disagg_proxy``), minus the HTTP server:

1. **Prefill on P**: the client's request with ``max_tokens=1`` and
   ``kv_transfer_params={"do_remote_decode": true, ...}``.  P computes the prompt's KV, keeps the
   blocks alive and answers with ``kv_transfer_params`` naming them (engine id, block ids,
   side-channel host/port).
2. **Decode on D**: the client's original request plus P's ``kv_transfer_params``.  D's
   NixlConnector pulls the blocks over NIXL (a READ from P's registered KV memory), then decodes.

D and the baseline are read as SSE streams so TTFT and decode throughput come from token
arrival times, not whole-request latency.  P/D TTFT = P's full prefill round trip + D's time to
its first streamed token (what a client of the proxy sees).  Prompts are token ids
(``--skip-tokenizer-init``); ``return_tokens_as_token_ids`` makes logprobs work without a
tokenizer.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .servers import SERVED_MODEL_NAME, Engine

REQUEST_TIMEOUT_S = 120.0

#: What a P/D proxy sends P: "decode remotely", nothing to pull yet.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Completion:
    """One completion as the client saw it."""

    token_ids: list[int]
    logprobs: list[float]
    wall_s: float
    ttft_s: float | None = None  # first streamed token, from request start
    token_times: list[float] = field(default_factory=list)  # arrival, from request start
    kv_transfer_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: str | None = None  # an error event in the stream (the HTTP status was already 200)

    @property
    def decode_tok_per_s(self) -> float | None:
        """Tokens after the first, per second of streaming (the decode phase)."""
        if len(self.token_times) < 2 or self.token_times[-1] <= self.token_times[0]:
            return None
        return (len(self.token_times) - 1) / (self.token_times[-1] - self.token_times[0])


def _body(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        **extra,
    }


def _post(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )


def complete(
    engine: Engine,
    prompt: list[int],
    max_tokens: int,
    *,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
    body: Mapping[str, Any] | None = None,
) -> Completion:
    """A non-streaming completion (used for P's prefill, whose answer is one JSON object).
    ``body``: more request fields, as for :func:`stream`."""
    extra: dict[str, Any] = dict(body or {})
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    req = _post(engine.url, _body(prompt, max_tokens, **extra))
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        data = json.loads(r.read())
    wall = time.perf_counter() - t0
    choice = data["choices"][0]
    lp = (choice.get("logprobs") or {}).get("token_logprobs") or []
    return Completion(
        token_ids=list(choice.get("token_ids") or []),
        logprobs=[float(x) for x in lp],
        wall_s=wall,
        kv_transfer_params=data.get("kv_transfer_params"),
        finish_reason=choice.get("finish_reason"),
    )


def stream(
    engine: Engine,
    prompt: list[int],
    max_tokens: int,
    *,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
    body: Mapping[str, Any] | None = None,
) -> Completion:
    """A streaming completion; records when each token arrived.  ``body``: more request
    fields (e.g. ``cache_salt``)."""
    extra: dict[str, Any] = {"stream": True, **(body or {})}
    if kv_transfer_params is not None:
        extra["kv_transfer_params"] = kv_transfer_params
    req = _post(engine.url, _body(prompt, max_tokens, **extra))
    tokens: list[int] = []
    logprobs: list[float] = []
    times: list[float] = []
    finish: str | None = None
    error: str | None = None
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for raw in r:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{engine.spec.name}: stream exceeded {timeout_s:.0f}s")
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                err = chunk["error"]
                error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids:
                    now = time.perf_counter() - t0
                    tokens.extend(ids)
                    times.extend([now] * len(ids))
                    lp = (choice.get("logprobs") or {}).get("token_logprobs") or []
                    logprobs.extend(float(x) for x in lp)
                finish = choice.get("finish_reason") or finish
    wall = time.perf_counter() - t0
    return Completion(
        token_ids=tokens,
        logprobs=logprobs,
        wall_s=wall,
        ttft_s=times[0] if times else None,
        token_times=times,
        finish_reason=finish,
        error=error,
    )


@dataclass
class TransferStats:
    """What D's ``/metrics`` counters moved by during one request."""

    transfers: int
    xfer_time_s: float
    bytes: float
    descriptors: int
    failed: int
    external_hit_tokens: int
    external_query_tokens: int
    local_hit_tokens: int

    @classmethod
    def delta(cls, before: dict[str, float], after: dict[str, float]) -> TransferStats:
        def d(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        return cls(
            transfers=int(d("vllm:nixl_xfer_time_seconds_count")),
            xfer_time_s=d("vllm:nixl_xfer_time_seconds_sum"),
            bytes=d("vllm:nixl_bytes_transferred_sum"),
            descriptors=int(d("vllm:nixl_num_descriptors_sum")),
            failed=int(d("vllm:nixl_num_failed_transfers_total")),
            external_hit_tokens=int(d("vllm:external_prefix_cache_hits_total")),
            external_query_tokens=int(d("vllm:external_prefix_cache_queries_total")),
            local_hit_tokens=int(d("vllm:prefix_cache_hits_total")),
        )


@dataclass
class PDResult:
    prefill: Completion
    decode: Completion
    ttft_s: float
    transfer: TransferStats | None


def _settled_metrics(
    engine: Engine, before: dict[str, float], wait_s: float = 3.0
) -> dict[str, float]:
    """D records connector stats with its next scheduler stats; poll until they moved."""
    deadline = time.monotonic() + wait_s
    keys = ("vllm:nixl_xfer_time_seconds_count", "vllm:nixl_num_failed_transfers_total")
    while True:
        after = engine.metrics()
        if any(after.get(k, 0.0) != before.get(k, 0.0) for k in keys):
            return after
        if time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def pd_request(
    p: Engine,
    d: Engine,
    prompt: list[int],
    max_tokens: int,
    *,
    measure_transfer: bool = True,
    timeout_s: float = REQUEST_TIMEOUT_S,
    decode_body: Mapping[str, Any] | None = None,
) -> PDResult:
    """Prefill on P, decode on D with P's ``kv_transfer_params`` (the proxy's job);
    ``decode_body`` adds request fields to D's request only."""
    before = d.metrics() if measure_transfer else {}
    pre = complete(
        p, prompt, 1, kv_transfer_params=dict(PREFILL_KV_PARAMS), timeout_s=timeout_s
    )
    if not pre.kv_transfer_params:
        raise RuntimeError(f"P returned no kv_transfer_params (is it a kv_producer?): {pre}")
    dec = stream(
        d, prompt, max_tokens, kv_transfer_params=pre.kv_transfer_params, timeout_s=timeout_s,
        body=decode_body,
    )
    ttft = pre.wall_s + (dec.ttft_s if dec.ttft_s is not None else dec.wall_s)
    stats = None
    if measure_transfer:
        stats = TransferStats.delta(before, _settled_metrics(d, before))
    return PDResult(prefill=pre, decode=dec, ttft_s=ttft, transfer=stats)


WARM_UP_BACKOFF_S = 3.0


def warm_up(
    p: Engine, d: Engine, attempts: int = 5, log: list[str] | None = None
) -> PDResult:
    """First P/D request of a pair: NIXL handshake, UCX connection, first forward passes.

    vLLM (0.33, 0.34) gives the first side-channel handshake a hard-coded 5 s ZMQ receive
    timeout (``base_worker._nixl_handshake``); on a starved 2-core machine P's listener thread
    can miss it, which fails that one request ("handshake_setup_failed") and the next request
    handshakes again.  Such stalls came in bursts (one CI run saw three handshakes in a row time
    out within 12 s, another stock D's ``/metrics`` give no answer for 10 s), from vLLM's
    spinning message-queue readers, which ``lab/rig/quiet_spin`` now parks.  The warm-up still
    retries, with a growing pause (3, 6, 9, 12 s), both a failed request and an HTTP error or
    timeout, so that a slow machine fails the test it slows, not the warm-up; each failed
    attempt is recorded in ``log``.
    """
    prompt = list(range(3, 19))
    last: PDResult | str | None = None
    for i in range(attempts):
        if i:
            time.sleep(WARM_UP_BACKOFF_S * i)
        try:
            last = pd_request(p, d, prompt, 2)
        except OSError as exc:  # urllib's HTTP and connection errors, socket timeouts
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last.decode.error is None and last.decode.token_ids:
                return last
        if log is not None:
            why = last if isinstance(last, str) else (last.decode.error or "no tokens")
            log.append(f"warm-up attempt {i + 1} failed: {why}")
    raise RuntimeError(f"P/D warm-up failed {attempts} times; last: {last}")
