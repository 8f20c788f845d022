"""The code of patch ``block_keys``, loaded when vLLM imports the connector's scheduler half or
EngineCore (the patch and why it exists: :mod:`pdpatch.patches.block_keys`)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from packaging.version import Version

from pdpatch import attached, config, metrics, vllm_sites
from pdpatch.installer import state_of
from pdpatch.log import logger
from pdpatch.patches.block_keys import NAME
from pdpatch.state import State, counter, counter_by

# The hashing core is imported where it is first used (the first request), not here: this
# module is imported by install() inside every `import vllm`, and the core costs ~8 ms.
if TYPE_CHECKING:
    from pdpatch.hashing.verdict import EngineKeys, RequestInputs, Verdict

PARAMS_KEY = "pdpatch_block_keys"
"""The entry P adds to ``kv_transfer_params`` (D's ``add_new_req_to_recv`` ignores extras)."""
VERDICT_KEY = "_pdpatch_block_keys"
"""D-side memo in the request's own params: ``get_num_new_matched_tokens`` runs again for a
request that could not be allocated this step; it is judged (and counted) once.  Kept in the
params dict, not on the request: the verdict is about those params and goes with them (never
sent on: D's connector returns no params for a request it received)."""
MAX_HEX_KEYS = 32
"""Keys sent verbatim (hex) for prompts of at most this many blocks; longer prompts send the
digest only.  Bounds the params at ~2.7 KiB."""
ON_MISMATCH_ENV = config.BLOCK_KEYS_ON_MISMATCH.var
WARN_INTERVAL_S = 60.0
MAX_REMEMBERED_PEERS = 256

CAUSE_HINTS: dict[str, str] = {
    "prompt": "D received a different prompt than P prefilled (proxy or tokenizer mismatch)",
    "lora": "the LoRA adapter differs (its name and path as registered: use the same "
            "--lora-modules name=path on P and D)",
    "cache_salt": "the cache_salt differs between P's and D's request",
    "mm": "the multimodal inputs (identifiers or placeholder ranges) differ",
    "prompt_embeds": "the prompt embeddings differ",
    "keys": "the block keys differ for no reason the input digests show",
    "malformed": "P sent malformed or oversized block-key params; they were rejected unread",
}
NAMING_NOTE = ("P and D name blocks differently in their own prefix caches ({causes}); "
               "harmless for P/D, whose keys are compared canonically; a KV-cache-aware "
               "router that matches both engines' keys needs the same --prefix-caching-hash-algo"
               ", block size and PYTHONHASHSEED on both")


# ------------------------------------------------------------------ counters and rate limits


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


@dataclass
class BlockKeysState(State):
    """Process-wide (the scheduler half lives in EngineCore: one per engine)."""

    sent: int = counter("P: block keys added to a finished request's kv_transfer_params")
    matched: int = counter("D: remote KV loaded after P's block keys matched D's")
    mismatched: int = counter("D: requests whose block keys differed from P's (computed "
                              "locally, or only warned under policy warn)")
    rejected: int = counter("D: malformed block-key params from P, rejected unread")
    unchecked: int = counter("D: remote loads from a P that sent no block keys")
    errors: int = counter("either side: the block-key check itself failed (vLLM left as is)")
    causes: dict[str, int] = counter_by(  # noqa: RUF009 (a dataclasses.field)
        "cause", "D: block-key mismatches and rejections by cause")
    warn: RateLimiter = field(default_factory=RateLimiter)
    once: set[tuple[str, str]] = field(default_factory=set)    # (kind, peer) logged once

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            return {"sent": self.sent, "matched": self.matched, "mismatched": self.mismatched,
                    "rejected": self.rejected, "unchecked": self.unchecked,
                    "errors": self.errors, "causes": dict(self.causes)}


@dataclass
class Fingerprint:
    """On the object computing block keys (the connector's scheduler half, or vLLM's
    Scheduler; :mod:`pdpatch.attached`): its engine's fingerprint, for the NONE_HASH it was
    computed with."""

    none_hash: Any = None
    keys: EngineKeys | None = None


def stats() -> dict[str, Any]:
    """Counters since process start (or ``pdpatch.installer.reset_state()``)."""
    return state_of(NAME).as_dict()


def _count(attr: str, causes: Sequence[str] = ()) -> None:
    state = state_of(NAME)
    state.bump(attr)
    for c in causes:
        state.bump("causes", label=c)


def _first_time(kind: str, peer: str) -> bool:
    state = state_of(NAME)
    with state.lock:
        if (kind, peer) in state.once:
            return False
        if len(state.once) < MAX_REMEMBERED_PEERS:
            state.once.add((kind, peer))
        return True


def _printable(text: str, limit: int = 64) -> str:
    """Untrusted text for a log line: bounded, escaped (no forged log lines)."""
    return text[:limit].encode("unicode_escape").decode("ascii")


def _peer_name(params: Mapping[str, Any]) -> str:
    """The remote engine id for logs (it came over the network)."""
    raw = params.get("remote_engine_id")
    return _printable(raw if isinstance(raw, str) else repr(type(raw).__name__))


def on_mismatch_policy(env: Mapping[str, str] | None = None) -> str:
    return config.BLOCK_KEYS_ON_MISMATCH.read(env)


def _warn_causes(verdict: Verdict, peer: str, request_id: str, recompute: bool) -> None:
    action = ("computing it locally instead of loading P's KV" if recompute
              else f"loading P's KV anyway ({ON_MISMATCH_ENV}=warn)")
    for cause in verdict.causes:
        held = state_of(NAME).warn.admit(cause)
        if held is None:
            continue
        more = f" [{held} more request(s) with this cause since the last warning]" if held else ""
        if cause == "malformed":
            logger.warning(
                "pdpatch: rejected the block-key params of request %s from P engine %s: %s; "
                "%s%s [block_keys]", request_id, peer, verdict.detail, action, more)
            continue
        logger.warning(
            "pdpatch: block keys of request %s from P engine %s do not match D's: %s -- %s; "
            "%s (%s)%s [block_keys]", request_id, peer, cause, CAUSE_HINTS.get(cause, cause),
            action, verdict.detail, more)


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
    held = attached.entry(holder, NAME, Fingerprint)
    if held.keys is not None and held.none_hash == none_hash:
        return held.keys
    vcfg = holder.vllm_config
    hbs = vllm_sites.hash_block_size(vcfg, holder.kv_cache_config, version)
    lookahead = getattr(vcfg, "num_hash_lookahead_tokens", 0)
    ek = engine_keys(algo=vcfg.cache_config.prefix_caching_hash_algo, hash_block_size=hbs,
                     vllm_version=str(version), none_hash=none_hash,
                     pythonhashseed=os.environ.get("PYTHONHASHSEED"),
                     lookahead=lookahead if isinstance(lookahead, int) else 0)
    held.none_hash, held.keys = none_hash, ek
    return ek


def _request_inputs(request: Any, upto: int | None = None) -> RequestInputs:
    """The request's inputs over its first ``upto`` prompt tokens (all of them: None)."""
    from pdpatch.hashing.request_adapter import prompt_tokens, request_inputs
    from pdpatch.hashing.verdict import RequestInputs

    return RequestInputs(prompt_tokens(request, upto),
                         request_inputs(request, embeds_bytes=_embeds_bytes, upto=upto))


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
            # the prompt P computed: vLLM has already cut the tokens D recomputes itself
            inputs = _request_inputs(request, upto=request.num_prompt_tokens)
            params[PARAMS_KEY] = build_p_params(engine, inputs, MAX_HEX_KEYS)
            _count("sent")
        except Exception as exc:  # never fail a finished request over its proof
            _count("errors")
            if state_of(NAME).warn.admit("p-error") is not None:
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
        if not params or not params.get("do_remote_prefill") \
                or vllm_sites.external_hit_discarded(request, version):
            return wrapped(*args, **kwargs)         # no remote load to check
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
    from pdpatch.hashing.key_params import PARAMS_VERSION, parse_params
    from pdpatch.hashing.verdict import Verdict, judge

    try:
        if not config.extra_config_allows(NAME, _extra_config(sched)):
            return "load"
        recompute = on_mismatch_policy() == "recompute"
    except config.ConfigError as exc:
        _count("errors")
        if state_of(NAME).warn.admit("config") is not None:
            logger.warning("pdpatch: block-key check off: %s [block_keys]", exc)
        return "load"
    try:
        # the prefix D loads: the prompt less the tokens P stopped short of (Mamba, MTP, ...)
        upto = vllm_sites.remote_prefill_tokens(sched, request, version)
    except Exception as exc:
        _count("errors")
        if state_of(NAME).warn.admit("d-error") is not None:
            logger.warning("pdpatch: could not read how much of request %s D loads (%s: %s); "
                           "loading unchecked [block_keys]", _printable(str(request.request_id)),
                           type(exc).__name__, exc)
        return "load"
    if upto is not None and upto <= 0:
        return "load"          # an embeddings prompt: vLLM loads nothing from P
    peer = _peer_name(params)
    raw = params.get(PARAMS_KEY)
    other = raw.get("v") if isinstance(raw, dict) else None
    if raw is None or (type(other) is int and other != PARAMS_VERSION):
        _count("unchecked")
        if _first_time("unchecked", peer):
            why = ("sends no block keys (no pdpatch there?)" if raw is None else
                   f"sends block-key params version {other}, this pdpatch reads version "
                   f"{PARAMS_VERSION} (upgrade pdpatch on both)")
            logger.info("pdpatch: P engine %s %s: its requests are loaded unchecked "
                        "[block_keys]", peer, why)
        return "load"
    request_id = _printable(str(request.request_id))
    try:
        peer_keys = parse_params(raw)
    except PeerParamsError as exc:
        verdict = Verdict("rejected", ("malformed",), str(exc))
        _count("rejected", verdict.causes)
        _warn_causes(verdict, peer, request_id, recompute)
        return _refused(sched, metrics.REFUSED_PARAMS) if recompute else "load"
    try:
        verdict = judge(_engine_keys_for(sched, version), _request_inputs(request, upto),
                        peer_keys)
    except Exception as exc:  # a bug here must not take the scheduler down
        _count("errors")
        if state_of(NAME).warn.admit("d-error") is not None:
            logger.warning("pdpatch: could not check the block keys of request %s (%s: %s); "
                           "loading unchecked [block_keys]", request_id, type(exc).__name__,
                           exc)
        return "load"
    if verdict.naming and _first_time("naming", peer):
        logger.info("pdpatch: P engine %s: %s [block_keys]", peer,
                    NAMING_NOTE.format(causes=", ".join(verdict.naming)))
    if verdict.status == "match":
        _count("matched")
        if _first_time("matched", peer):
            logger.info("pdpatch: block keys of P engine %s match D's; later matches are "
                        "counted, not logged [block_keys]", peer)
        return "load"
    _count("rejected" if verdict.status == "rejected" else "mismatched", verdict.causes)
    _warn_causes(verdict, peer, request_id, recompute)
    if not recompute:
        return "load"
    return _refused(sched, metrics.KEY_MISMATCH if verdict.status == "mismatch" else
                    metrics.REFUSED_PARAMS)


def _refused(sched: Any, outcome: tuple[str, str]) -> str:
    """Count a request whose remote KV the check refused; it is computed locally."""
    metrics.count(sched, metrics.REFUSALS, NAME)
    metrics.count(sched, metrics.KV_REQUESTS, *outcome)
    return "recompute"


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
