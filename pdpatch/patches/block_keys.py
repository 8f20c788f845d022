"""Patch ``block_keys``: P and D prove they mean the same blocks before D loads P's KV.

vLLM's NIXL connector moves KV blocks by block id only.  Nothing checks that the prefill engine
(P) and the decode engine (D) hashed the prompt the same way -- same ``--prefix-caching-hash-algo``,
same NONE_HASH seed (``PYTHONHASHSEED``; random for xxhash and for every algorithm <= 0.28 when
unset), same hash block size, same prompt, LoRA adapter, cache salt, multimodal inputs.  When
they differ, D caches P's blocks under keys that mean something else on D (silent prefix-cache
poisoning), or loads KV computed for a different prompt or adapter.

With this patch:

* **P** (``request_finished`` on the connector facade, for a request that came with
  ``do_remote_decode``) adds ``kv_transfer_params["pdpatch_block_keys"]``: its fingerprint
  (:mod:`pdpatch.hashing.fingerprint`), the number of prompt blocks, a digest of the block keys
  vLLM computed (``request.block_hashes``), the first keys in hex (at most
  :data:`MAX_HEX_KEYS`) and digests of each hashing input (:mod:`pdpatch.hashing.peer_check`).
  O(1) in the prompt length; JSON; the proxy forwards it to D unchanged.
* **D** (``get_num_new_matched_tokens`` on the connector's scheduler half), before a remote
  load: parses those params with a bounded, validating parser (never ``eval``, never
  ``pickle``), compares them with its own ``request.block_hashes`` and fingerprint, and on any
  difference answers "no external tokens" -- the request is computed locally and P is told to
  free its blocks, as stock vLLM does for a full local prefix hit.  One warning per cause
  (rate-limited: a misconfigured pair would otherwise log per request) and a counter
  (:func:`stats`).  A match, or a P without pdpatch (no such params), leaves vLLM's answer
  untouched.  ``PDPATCH_BLOCK_KEYS_ON_MISMATCH=warn`` only warns and still loads.
* **Every engine** logs its fingerprint at start (``EngineCore.__init__``) on the ``pdpatch``
  logger, so operators can diff P's line against D's.

The keys compared are vLLM's own (D's engine hashed the prompt it received); the library
recomputes nothing on the hot path.  Cost per remote request: one sha256 over the keys
(32 bytes per block) and one over the prompt token ids.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from pdpatch import config, vllm_sites
from pdpatch.log import logger
from pdpatch.registry import Patch, Target

# The hashing core is imported where it is first used (the first request), not here: this
# module is imported by install() inside every `import vllm`, and the core costs ~8 ms.
if TYPE_CHECKING:
    from pdpatch.hashing.verdict import EngineKeys, RequestKeys, Verdict

NAME = "block_keys"
PARAMS_KEY = "pdpatch_block_keys"
"""The entry P adds to ``kv_transfer_params`` (D's ``add_new_req_to_recv`` ignores extras)."""
VERDICT_KEY = "_pdpatch_block_keys"
"""D-side memo in the request's own params: ``get_num_new_matched_tokens`` runs again for a
request that could not be allocated this step; it is judged (and counted) once."""
MAX_HEX_KEYS = 32
"""Keys sent verbatim (hex) for prompts of at most this many blocks; longer prompts send the
digest only.  Bounds the params at ~2.5 KiB for sha256."""
ON_MISMATCH_ENV = "PDPATCH_BLOCK_KEYS_ON_MISMATCH"
ON_MISMATCH_CHOICES = ("recompute", "warn")
WARN_INTERVAL_S = 60.0
MAX_REMEMBERED_PEERS = 256

CAUSE_HINTS: dict[str, str] = {
    "algo": "P and D hash with different --prefix-caching-hash-algo; set the same on both",
    "seed": "NONE_HASH differs: set the same PYTHONHASHSEED in the environment of both "
            "engines (required for xxhash/xxhash_cbor and for every algorithm up to vLLM "
            "0.28; with 0.29+ sha256/sha256_cbor it may instead be unset on both)",
    "key_format": "P and D run vLLM releases that build LoRA/multimodal/salt keys differently",
    "pickle_protocol": "P and D run Pythons with different pickle protocols (sha256/xxhash "
                       "pickle their input); use the same Python or a *_cbor algorithm",
    "lookahead": "one side hashes with EAGLE lookahead tokens (no KV connector configured?)",
    "prompt": "D received a different prompt than P prefilled (proxy or tokenizer mismatch)",
    "lora": "the LoRA adapter differs (vLLM 0.31+ hashes its name AND path as registered: "
            "use the same --lora-modules name=path on P and D)",
    "cache_salt": "the cache_salt differs between P's and D's request",
    "mm": "the multimodal inputs (identifiers or placeholder ranges) differ",
    "prompt_embeds": "the prompt embeddings differ",
    "keys": "the block keys differ for no reason the fingerprints show",
    "malformed": "P sent malformed or oversized block-key params; they were rejected unread",
}


# ------------------------------------------------------------------ counters and rate limits


@dataclass
class Stats:
    """Process-wide counters (the scheduler half lives in EngineCore: one per engine)."""

    sent: int = 0              # P: params added to a finished request
    matched: int = 0           # D: remote load allowed after a successful check
    mismatched: int = 0        # D: computed locally (or only warned, policy "warn")
    rejected: int = 0          # D: malformed params from the network
    unchecked: int = 0         # D: P sent no block keys (stock P)
    errors: int = 0            # either side: the check itself failed (vLLM left as is)
    causes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"sent": self.sent, "matched": self.matched, "mismatched": self.mismatched,
                "rejected": self.rejected, "unchecked": self.unchecked, "errors": self.errors,
                "causes": dict(self.causes)}


class RateLimiter:
    """At most one log line per key per ``interval`` seconds, reporting what it held back."""

    def __init__(self, interval: float = WARN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def admit(self, key: str) -> int | None:
        """None: stay quiet.  Otherwise log now; the value is how many were held back."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._last[key] = now
            return self._held.pop(key, 0)


_lock = threading.Lock()
_stats = Stats()
_warn = RateLimiter()
_once: set[tuple[str, str]] = set()


def stats() -> dict[str, Any]:
    """Counters since process start (or :func:`reset`)."""
    with _lock:
        return _stats.as_dict()


def reset(clock: Callable[[], float] = time.monotonic) -> None:
    """Forget counters, rate limits and once-only notes (tests)."""
    global _stats, _warn
    with _lock:
        _stats = Stats()
        _warn = RateLimiter(clock=clock)
        _once.clear()


def _count(attr: str, causes: Sequence[str] = ()) -> None:
    with _lock:
        setattr(_stats, attr, getattr(_stats, attr) + 1)
        for c in causes:
            _stats.causes[c] = _stats.causes.get(c, 0) + 1


def _first_time(kind: str, peer: str) -> bool:
    with _lock:
        if (kind, peer) in _once:
            return False
        if len(_once) < MAX_REMEMBERED_PEERS:
            _once.add((kind, peer))
        return True


def _printable(text: str, limit: int = 64) -> str:
    """Untrusted text for a log line: bounded, escaped (no forged log lines)."""
    return text[:limit].encode("unicode_escape").decode("ascii")


def _peer_name(params: Mapping[str, Any]) -> str:
    """The remote engine id for logs (it came over the network)."""
    raw = params.get("remote_engine_id")
    return _printable(raw if isinstance(raw, str) else repr(type(raw).__name__))


def on_mismatch_policy(env: Mapping[str, str] | None = None) -> str:
    raw = (os.environ if env is None else env).get(ON_MISMATCH_ENV, "recompute")
    value = raw.strip().lower() or "recompute"
    if value not in ON_MISMATCH_CHOICES:
        raise config.ConfigError(f"{ON_MISMATCH_ENV}={raw!r} is not a valid value; accepted: "
                                 f"{', '.join(ON_MISMATCH_CHOICES)}")
    return value


def _warn_causes(verdict: Verdict, peer: str, request_id: str, recompute: bool,
                 engine: EngineKeys | None, peer_fp: Mapping[str, Any] | None) -> None:
    action = ("computing it locally instead of loading P's KV" if recompute
              else f"loading P's KV anyway ({ON_MISMATCH_ENV}=warn)")
    for cause in verdict.causes:
        held = _warn.admit(cause)
        if held is None:
            continue
        more = f" [{held} more request(s) with this cause since the last warning]" if held else ""
        if cause == "malformed":
            logger.warning(
                "pdpatch: rejected the block-key params of request %s from P engine %s: %s; "
                "%s%s [block_keys]", request_id, peer, verdict.detail, action, more)
            continue
        sides = ""
        if engine is not None and peer_fp is not None and cause in (
                "algo", "seed", "key_format", "pickle_protocol", "lookahead"):
            sides = (f" (P: {_fp_brief(peer_fp)}; "
                     f"D: {_fp_brief(engine.compact, engine.seed_label)})")
        logger.warning(
            "pdpatch: block keys of request %s from P engine %s do not match D's: %s -- %s%s; "
            "%s (%s)%s [block_keys]", request_id, peer, cause, CAUSE_HINTS.get(cause, cause),
            sides, action, verdict.detail, more)


def _fp_brief(fp: Mapping[str, Any], seed: str | None = None) -> str:
    return (f"algo={fp.get('algo')} seed={seed or fp.get('seed')} "
            f"none_hash_id={fp.get('nh')} hbs={fp.get('hbs')} kf={fp.get('kf')} "
            f"vllm={fp.get('vllm')}")


# ------------------------------------------------------------------ vLLM glue


def _extra_config(sched: Any) -> Mapping | None:
    ktc = getattr(getattr(sched, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(ktc, "kv_connector_extra_config", None)
    return extra if isinstance(extra, Mapping) else None


def _embeds_bytes(tensor: Any) -> bytes:
    from vllm.v1.utils import tensor_data

    return bytes(tensor_data(tensor))


def _engine_keys_for(holder: Any, version: Version) -> EngineKeys | None:
    """The engine's fingerprint from an object holding ``vllm_config`` and ``kv_cache_config``
    (the connector's scheduler half, or vLLM's Scheduler), cached per live NONE_HASH."""
    from pdpatch.hashing.verdict import engine_keys

    none_hash = vllm_sites.live_none_hash()
    if none_hash is None:
        return None
    cached = getattr(holder, "_pdpatch_engine_keys", None)
    if cached is not None and cached[0] == none_hash:
        return cached[1]
    vcfg = holder.vllm_config
    hbs = vllm_sites.hash_block_size(vcfg, holder.kv_cache_config, version)
    lookahead = getattr(vcfg, "num_hash_lookahead_tokens", 0)
    ek = engine_keys(algo=vcfg.cache_config.prefix_caching_hash_algo, hash_block_size=hbs,
                     vllm_version=str(version), none_hash=none_hash,
                     pythonhashseed=os.environ.get("PYTHONHASHSEED"),
                     lookahead=lookahead if isinstance(lookahead, int) else 0)
    holder._pdpatch_engine_keys = (none_hash, ek)
    return ek


def _request_keys(request: Any, engine: EngineKeys) -> RequestKeys:
    from pdpatch.hashing.extra_keys import ExtraKeys
    from pdpatch.hashing.request_adapter import prompt_tokens, request_inputs
    from pdpatch.hashing.verdict import RequestKeys, prompt_block_count

    hashes = request.block_hashes
    n = prompt_block_count(len(hashes), request.num_prompt_tokens, engine.hash_block_size)
    inputs = request_inputs(request, embeds_bytes=_embeds_bytes)
    return RequestKeys(hashes[:n], prompt_tokens(request), ExtraKeys(engine.fmt, **inputs))


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def make_p_hook(version: Version) -> Callable[..., Any]:
    """Post-hook on the facade's ``request_finished[_all_groups]``: P enriches the params."""

    def p_request_finished(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            from pdpatch.hashing.verdict import build_p_params

            request = _arg(args, kwargs, 0, "request")
            incoming = request.kv_transfer_params
            if not incoming or not incoming.get("do_remote_decode"):
                return result
            _, params = result
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                return result
            sched = instance.connector_scheduler
            if not config.extra_config_allows(NAME, _extra_config(sched)):
                return result
            engine = _engine_keys_for(sched, version)
            if engine is None:
                return result
            params[PARAMS_KEY] = build_p_params(engine, _request_keys(request, engine),
                                                 MAX_HEX_KEYS)
            _count("sent")
        except Exception as exc:  # never fail a finished request over its proof
            _count("errors")
            if _warn.admit("p-error") is not None:
                logger.warning("pdpatch: could not add block keys to a finished request "
                               "(%s: %s); D will not check it [block_keys]",
                               type(exc).__name__, exc)
        return result

    return p_request_finished


def make_d_hook(version: Version) -> Callable[..., Any]:
    """Pre-hook on the scheduler half's ``get_num_new_matched_tokens``: D checks first."""

    def d_get_num_new_matched_tokens(wrapped: Any, instance: Any, args: tuple,
                                     kwargs: dict) -> Any:
        request = _arg(args, kwargs, 0, "request")
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return wrapped(*args, **kwargs)
        memo = params.get(VERDICT_KEY)
        if memo is None:
            memo = _check(instance, request, params, version)
            params[VERDICT_KEY] = memo
        if memo == "recompute":
            return vllm_sites.NO_EXTERNAL_TOKENS
        return wrapped(*args, **kwargs)

    return d_get_num_new_matched_tokens


def _check(sched: Any, request: Any, params: dict, version: Version) -> str:
    """``"load"`` (vLLM decides as usual) or ``"recompute"`` (no remote KV)."""
    from pdpatch.hashing.errors import PeerParamsError
    from pdpatch.hashing.peer_check import parse_params
    from pdpatch.hashing.verdict import Verdict, judge

    try:
        if not config.extra_config_allows(NAME, _extra_config(sched)):
            return "load"
        recompute = on_mismatch_policy() == "recompute"
    except config.ConfigError as exc:
        _count("errors")
        if _warn.admit("config") is not None:
            logger.warning("pdpatch: block-key check off: %s [block_keys]", exc)
        return "load"
    peer = _peer_name(params)
    raw = params.get(PARAMS_KEY)
    if raw is None:
        _count("unchecked")
        if _first_time("unchecked", peer):
            logger.info("pdpatch: P engine %s sends no block keys (no pdpatch there?): its "
                        "requests are loaded unchecked [block_keys]", peer)
        return "load"
    try:
        peer_keys = parse_params(raw)
    except PeerParamsError as exc:
        verdict = Verdict("rejected", ("malformed",), str(exc))
        _count("rejected", verdict.causes)
        _warn_causes(verdict, peer, _printable(str(request.request_id)), recompute, None, None)
        return "recompute" if recompute else "load"
    try:
        engine = _engine_keys_for(sched, version)
        if engine is None:
            raise RuntimeError("NONE_HASH is not initialised in this process")
        verdict = judge(engine, _request_keys(request, engine), peer_keys)
    except Exception as exc:  # a bug here must not take the scheduler down
        _count("errors")
        if _warn.admit("d-error") is not None:
            logger.warning("pdpatch: could not check the block keys of request %s (%s: %s); "
                           "loading unchecked [block_keys]", _printable(str(request.request_id)),
                           type(exc).__name__, exc)
        return "load"
    if verdict.status == "match":
        _count("matched")
        if _first_time("matched", peer):
            logger.info("pdpatch: block keys of P engine %s match D's (%s%s); later matches "
                        "are counted, not logged [block_keys]", peer, engine.describe(),
                        f"; {verdict.detail}" if verdict.detail else "")
        return "load"
    _count("mismatched", verdict.causes)
    _warn_causes(verdict, peer, _printable(str(request.request_id)), recompute, engine,
                 peer_keys.fingerprint)
    return "recompute" if recompute else "load"


def make_engine_hook(version: Version) -> Callable[..., Any]:
    """Post-hook on ``EngineCore.__init__``: log this engine's fingerprint once."""

    def engine_started(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            if getattr(instance, "request_block_hasher", None) is None:
                return result           # no prefix caching and no connector: no keys
            sched = instance.scheduler
            engine = _engine_keys_for(sched, version)
            if engine is None:
                return result
            mine = getattr(sched, "hash_block_size", None)
            if isinstance(mine, int) and mine != engine.hash_block_size:
                logger.warning("pdpatch: scheduler hashes every %d tokens but pdpatch derived "
                               "%d for vLLM %s [block_keys]", mine, engine.hash_block_size,
                               version)
            role = getattr(getattr(sched.vllm_config, "kv_transfer_config", None),
                           "kv_role", None)
            logger.info("pdpatch: block-key fingerprint of this engine (kv_role=%s): %s "
                        "[block_keys; diff this line between P and D]", role,
                        engine.describe())
        except Exception as exc:
            logger.warning("pdpatch: could not compute this engine's block-key fingerprint "
                           "(%s: %s) [block_keys]", type(exc).__name__, exc)
        return result

    return engine_started


def _targets(version: Version) -> list[Target]:
    out: list[Target] = []
    p_hook, d_hook = make_p_hook(version), make_d_hook(version)
    for table in (vllm_sites.REQUEST_FINISHED, vllm_sites.REQUEST_FINISHED_ALL_GROUPS):
        out += [Target(s.module, s.qualname, p_hook) for s in vllm_sites.lookup_all(table,
                                                                                  version)]
    out += [Target(s.module, s.qualname, d_hook)
            for s in vllm_sites.lookup_all(vllm_sites.GET_NUM_NEW_MATCHED_TOKENS, version)]
    out += [Target(s.module, s.qualname, make_engine_hook(version))
            for s in vllm_sites.lookup_all(vllm_sites.ENGINE_CORE_INIT, version)]
    return out


PATCH = Patch(
    name=NAME,
    summary="P sends its block keys + fingerprint; D loads remote KV only when they match",
    versions=">=0.19,<0.34",
    why_version="the connector hooks and hashing rules were checked against 0.19-0.33 only",
    targets=_targets,
    options=(ON_MISMATCH_ENV,),
)
