"""Peers that come and go, on the CPU rig's real engines: a prefill engine killed and started
again (same or new engine id), paused past its lease, restarted under traffic; what the decode
engines answer.  Used by ``tests/e2e/test_peer_restart_e2e.py`` (short, in CI) and
``scripts/peer_restart.py`` (the table, the dead-peer count, the stall bound and the soak of
docs/peers.md).

Every answer is judged against P's own answer to the same prompt (P serves it alone, greedy,
seed 0: the tokens D must produce from P's KV): ``ok`` (equal tokens), ``wrong`` (an answer with
other tokens: the failure that must never happen), ``error`` (an HTTP error, an error event in
the stream, a timeout, no tokens).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.error
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab.rig import proxy
from lab.rig.servers import Engine

MAX_TOKENS = 6
PROMPT_LEN = 40
REQUEST_TIMEOUT_S = 120.0
PREFILL_BACKOFF_S = 1.0


def prompt(tag: str, length: int = PROMPT_LEN) -> list[int]:
    """A prompt no other tag shares (ids in the tiny model's vocabulary of 512)."""
    seed = sum((i + 1) * ord(c) for i, c in enumerate(tag))
    return [3 + (seed * 7919 + i * 104729) % 500 for i in range(length)]


@dataclass
class Answer:
    """One decode request as a client saw it."""

    engine: str
    tag: str
    stream: bool
    outcome: str                 # ok / wrong / error
    status: int | None = None    # HTTP status (200 for a stream that carried an error event)
    detail: str = ""
    wall_s: float = 0.0
    started: float = 0.0         # time.time() when sent

    def row(self) -> dict[str, Any]:
        return dict(vars(self))


def reference(p: Engine, tag: str) -> list[int]:
    """P's own answer to the tag's prompt (no KV transfer)."""
    return proxy.complete(p, prompt(tag), MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S).token_ids


def prefill(p: Engine, tag: str) -> dict[str, Any]:
    """P's ``kv_transfer_params`` for the tag's prompt, asked as a P/D proxy asks."""
    pre = proxy.complete(p, prompt(tag), 1, kv_transfer_params=dict(proxy.PREFILL_KV_PARAMS),
                         timeout_s=REQUEST_TIMEOUT_S)
    if not pre.kv_transfer_params:
        raise RuntimeError(f"P gave no kv_transfer_params for {tag}")
    return pre.kv_transfer_params


def decode(d: Engine, tag: str, params: dict[str, Any], want: list[int], *, stream: bool,
           timeout_s: float = REQUEST_TIMEOUT_S) -> Answer:
    """D's answer to the tag's prompt with P's params, judged against ``want``."""
    t0, started = time.perf_counter(), time.time()
    call = proxy.stream if stream else proxy.complete
    try:
        got = call(d, prompt(tag), MAX_TOKENS, kv_transfer_params=params, timeout_s=timeout_s)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:300]
        return Answer(d.spec.name, tag, stream, "error", exc.code, body,
                      time.perf_counter() - t0, started)
    except (OSError, TimeoutError) as exc:
        return Answer(d.spec.name, tag, stream, "error", None, f"{type(exc).__name__}: {exc}",
                      time.perf_counter() - t0, started)
    wall = time.perf_counter() - t0
    if got.error or not got.token_ids:
        return Answer(d.spec.name, tag, stream, "error", 200, got.error or "no tokens", wall,
                      started)
    outcome = "ok" if got.token_ids == want else "wrong"
    detail = "" if outcome == "ok" else f"got {got.token_ids}, P alone {want}"
    return Answer(d.spec.name, tag, stream, outcome, 200, detail, wall, started)


def pd(p: Engine, d: Engine, tag: str, want: list[int], *, stream: bool) -> Answer:
    """One P/D request through the proxy's flow; P's failure to prefill is an ``error``."""
    try:
        params = prefill(p, tag)
    except (OSError, RuntimeError) as exc:
        return Answer(d.spec.name, tag, stream, "error", None, f"prefill: {exc}")
    return decode(d, tag, params, want, stream=stream)


def census(census_dir: Path, engine: Engine) -> dict[str, Any] | None:
    """The newest peer census (lab/rig/peer_census) of the engine's NIXL worker process."""
    best = None
    for pid in engine.pids():
        path = census_dir / f"census-{pid}.json"
        if path.exists():
            data = json.loads(path.read_text())
            if data.get("tables", {}).get("_remote_agents") is not None and \
                    (best is None or data["time"] > best["time"]):
                best = data
    return best


def held_engines(c: dict[str, Any] | None) -> dict[str, int]:
    """Per table of a census: how many remote engines the worker holds there."""
    if c is None:
        return {}
    out = {name: len(keys) for name, keys in c["tables"].items()}
    out["agents_held"] = c["agents_held"]
    out["agents_nixl_knows"] = c["agents_nixl_knows"]
    out["agents_loaded_ever"] = c["agents_loaded_ever"]
    out["sockets"] = c["sockets"]
    return out


@dataclass
class Traffic:
    """Concurrent P/D requests against decode engines until stopped: each answer with when it
    was sent, for the soak (failures counted against the restarts they overlapped)."""

    p: Engine
    decoders: list[Engine]
    refs: dict[str, list[int]]
    workers: int = 2
    answers: list[Answer] = field(default_factory=list)
    _stop: bool = False

    def run(self, until: Callable[[], bool]) -> None:
        tags = list(self.refs)
        n = 0

        def one(i: int) -> list[Answer]:
            tag = tags[i % len(tags)]
            out = []
            try:
                params = prefill(self.p, tag)
            except (OSError, RuntimeError) as exc:
                # P is down or starting: a client backs off instead of spinning
                at = time.time()
                time.sleep(PREFILL_BACKOFF_S)
                return [Answer(d.spec.name, tag, bool(i % 2), "error", None,
                               f"prefill: {exc}", 0.0, at) for d in self.decoders]
            for d in self.decoders:
                out.append(decode(d, tag, params, self.refs[tag], stream=bool(i % 2)))
            return out

        with cf.ThreadPoolExecutor(self.workers) as pool:
            running: set[cf.Future] = set()
            while not until() or running:
                while not until() and len(running) < self.workers:
                    running.add(pool.submit(one, n))
                    n += 1
                done, running = cf.wait(running, timeout=0.5,
                                        return_when=cf.FIRST_COMPLETED)
                for fut in done:
                    self.answers.extend(fut.result())


def summarize(answers: Iterable[Answer]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for a in answers:
        row = out.setdefault(a.engine, {"ok": 0, "wrong": 0, "error": 0})
        row[a.outcome] += 1
    return out
