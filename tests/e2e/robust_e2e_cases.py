"""Bad inputs for a real decode engine, and the probes that judge the outcome (issues 7, 25).

Two families, each case a function of the real P's answer so that everything except the one
malformed field is valid:

* ``kv_transfer_params`` sent with the decode request (what a buggy or hostile proxy sends),
  each case sent both ways a client can ask (:data:`MODES`): streaming (SSE) and
  non-streaming.  The two are different requests on D's socket (``"stream": true``) and take
  different paths in vLLM's front end (0.33's ``_with_kv_transfer_rejection_cleanup`` hands a
  rejected *non-streaming* request's parameters to the engine core), so every case runs in both;
* handshake metadata served by a fake prefill side channel (:class:`FakeSideChannel`): the real
  P's real handshake payload (same compatibility hash, a real NIXL agent blob), fetched over
  vLLM's own side-channel protocol, with one field corrupted; D is pointed at it through
  ``remote_host``/``remote_port``/``remote_engine_id``.

A case is judged by :func:`judge`: an error, or an answer equal to D's own greedy answer to the
same prompt without ``kv_transfer_params`` (its baseline); D alive, healthy and serving after.
An answer 200 from KV D did not verify is a failure even when D survives.

Imported by ``test_robustness_e2e.py`` and usable from a script (for recording what stock vLLM
does case by case, restarting the engine it kills).
"""

from __future__ import annotations

import copy
import socket
import threading
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from hypothesis import strategies as st

from lab.rig import proxy
from lab.rig.servers import Engine

GET_META_MSG = b"get_meta_msg"      # vllm ...nixl/metadata.py (0.33); checked in fetch_payload
BLOCK = 128                         # the CPU platform's KV block size (tokens)
PROMPT_LEN = 140                    # two blocks, the second partial
MAX_TOKENS = 4
BOUND_S = 90.0                      # a failing request must be answered within this
#: ``stream``: SSE (``proxy.stream``); ``complete``: one JSON answer (``proxy.complete``).
MODES = ("stream", "complete")
#: A prompt D holds entirely in its prefix cache once it has served it: vLLM reuses at most
#: ``len - 1`` tokens, in whole blocks, so two full blocks plus the one token it recomputes.
FULL_HIT_LEN = 2 * BLOCK + 1
#: ``block_ids_too_many`` appends this many real block ids of other requests on P, taken from
#: :data:`DONORS` prompts of :data:`DONOR_LEN` tokens (a prompt fits ``max_model_len`` 2048).
EXTRA_IDS = 20
DONORS = 2
DONOR_LEN = 10 * BLOCK
#: D's baseline requests carry this ``cache_salt``: they neither read nor fill the prefix-cache
#: entries of the unsalted prompt a case sent (which a wrong read may have filled).
BASELINE_SALT = "robust-e2e-baseline"


def prompt_for(case: str, length: int = PROMPT_LEN, vocab: int = 512) -> list[int]:
    """A prompt of its own per case: D must not answer from its prefix cache (which a case that
    was served earlier would have filled) instead of pulling KV."""
    import random
    import zlib

    rng = random.Random(zlib.crc32(case.encode()))
    return [rng.randrange(3, vocab) for _ in range(length)]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ kv_transfer_params cases

#: ``make(good, donor_ids)``: the bad parameters from P's real answer ``good`` for the case's
#: prompt and :data:`EXTRA_IDS` real block ids of other requests P holds.
ParamsCase = Callable[[dict[str, Any], list[int]], Any]


def _with(**changes: Any) -> ParamsCase:
    def make(good: dict[str, Any], donor_ids: list[int]) -> dict[str, Any]:
        bad = copy.deepcopy(good)
        for k, v in changes.items():
            if v is _DROP:
                bad.pop(k, None)
            else:
                bad[k] = v(good) if callable(v) else v
        return bad
    return make


def _too_many(good: dict[str, Any], donor_ids: list[int]) -> dict[str, Any]:
    """P's ids for the prompt, then other requests' real blocks: vLLM trims a longer list to
    its *last* ids (the prefix-cache trim), i.e. to the other requests' KV."""
    bad = copy.deepcopy(good)
    bad["remote_block_ids"] = [list(good["remote_block_ids"][0]) + list(donor_ids)]
    return bad


_DROP = object()

PARAMS_CASES: dict[str, ParamsCase] = {
    # wrong types
    "block_ids_string": _with(remote_block_ids="abc"),
    "block_ids_strings": _with(remote_block_ids=[["x", "y"]]),
    "block_ids_dict": _with(remote_block_ids={"a": 1}),
    "block_ids_too_deep": _with(remote_block_ids=[[[1]]]),
    "block_ids_flat": _with(remote_block_ids=lambda g: [b for grp in g["remote_block_ids"]
                                                        for b in grp]),
    "block_ids_floats": _with(remote_block_ids=[[0.5, 1.5]]),
    "engine_id_int": _with(remote_engine_id=12345),
    "port_string": _with(remote_port="abc"),
    "host_int": _with(remote_host=7),
    "request_id_none": _with(remote_request_id=None),
    "tp_size_string": _with(tp_size="two"),
    "do_remote_prefill_string": _with(do_remote_prefill="yes"),
    "num_tokens_string": _with(remote_num_tokens="many"),
    "expiry_string": _with(remote_blocks_expiry_time="soon"),
    "params_string": lambda g, d: "not-an-object",
    "params_list": lambda g, d: [1, 2, 3],
    # huge lists / numbers
    "block_ids_huge": _with(remote_block_ids=[list(range(200_000))]),
    "block_ids_many_groups": _with(remote_block_ids=[[0]] * 10_000),
    "block_ids_out_of_range": _with(remote_block_ids=lambda g: [
        [10**9 + i for i, _ in enumerate(g["remote_block_ids"][0])]]),
    "block_ids_too_many": _too_many,
    "tp_size_huge": _with(tp_size=10**6),
    "port_out_of_range": _with(remote_port=70000),
    # negative / zero
    "block_ids_negative": _with(remote_block_ids=lambda g: [
        [-1 - i for i, _ in enumerate(g["remote_block_ids"][0])]]),
    "block_ids_too_few": _with(remote_block_ids=lambda g: [g["remote_block_ids"][0][:1]]),
    "block_ids_empty": _with(remote_block_ids=[[]]),
    "block_ids_none_at_all": _with(remote_block_ids=[]),
    "tp_size_zero": _with(tp_size=0),
    "tp_size_negative": _with(tp_size=-2),
    "port_negative": _with(remote_port=-1),
    "num_tokens_negative": _with(remote_num_tokens=-100),
    # the wrong role: what a proxy sends P, sent to D (a kv_consumer); P's answer with the
    # flags swapped (a KV readback, which D's default settings never start); both flags at once
    "do_remote_decode_to_consumer": lambda g, d: dict(proxy.PREFILL_KV_PARAMS),
    "do_remote_decode_readback": _with(do_remote_decode=True, do_remote_prefill=False),
    "do_remote_decode_and_prefill": _with(do_remote_decode=True),
    # unknown / missing
    "engine_unknown_dead_port": _with(remote_engine_id="no-such-engine",
                                      remote_port=lambda g: closed_port()),
    "engine_unknown_live_port": _with(remote_engine_id="no-such-engine"),
    "host_unresolvable": _with(remote_engine_id="no-such-engine-2",
                               remote_host="no-such-host.invalid"),
    "missing_block_ids": _with(remote_block_ids=_DROP),
    "missing_engine_id": _with(remote_engine_id=_DROP),
    "missing_everything": lambda g, d: {"do_remote_prefill": True},
}


# ------------------------------------------------------------------ handshake metadata cases


def fetch_payload(engine: Engine) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """P's real handshake reply, over vLLM's side-channel protocol: (timestamp part, payload
    as a dict, agent metadata as a dict)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as nixl_metadata

    assert nixl_metadata.GET_META_MSG == GET_META_MSG
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{engine.side_channel_port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        payload_bytes, ts = sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()
    payload = msgspec.msgpack.decode(payload_bytes)
    agent = msgspec.msgpack.decode(payload["agent_metadata_bytes"])
    return ts, payload, agent


MetaCase = Callable[[dict[str, Any], dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


def _meta(**changes: Any) -> MetaCase:
    def make(payload: dict[str, Any], agent: dict[str, Any]):
        a = copy.deepcopy(agent)
        for k, v in changes.items():
            a[k] = v(agent) if callable(v) else v
        return payload, a
    return make


def _payload(**changes: Any) -> MetaCase:
    def make(payload: dict[str, Any], agent: dict[str, Any]):
        p = copy.deepcopy(payload)
        p.update(changes)
        return p, agent
    return make


META_CASES: dict[str, MetaCase] = {
    "meta_num_blocks_string": _meta(num_blocks="many"),
    "meta_num_blocks_negative": _meta(num_blocks=-5),
    "meta_num_blocks_zero": _meta(num_blocks=0),
    "meta_num_blocks_huge": _meta(num_blocks=10**12),
    "meta_block_lens_negative": _meta(block_lens=lambda a: [-x for x in a["block_lens"]]),
    "meta_block_lens_huge_list": _meta(block_lens=lambda a: a["block_lens"] * 50_000),
    "meta_base_addr_empty": _meta(kv_caches_base_addr=[]),
    "meta_base_addr_strings": _meta(kv_caches_base_addr=lambda a: ["x"] *
                                    len(a["kv_caches_base_addr"])),
    "meta_block_size_zero": _meta(block_size=0),
    "meta_block_size_negative": _meta(block_size=-16),
    "meta_block_size_odd": _meta(block_size=lambda a: a["block_size"] * 3),
    "meta_physical_per_logical_zero": _meta(physical_blocks_per_logical_kv_block=0),
    "meta_device_id_negative": _meta(device_id=-1),
    "meta_layout_unknown": _meta(kv_cache_layout="XYZZY"),
    "meta_engine_id_other": _meta(engine_id="someone-else"),
    "meta_agent_garbage": _meta(agent_metadata=b"garbage"),
    "meta_region_num_blocks_short": _meta(region_num_blocks=[1]),
    "meta_block_strides_zero": _meta(block_strides=lambda a: [0] * len(a["block_strides"])),
    "payload_hash_wrong": _payload(compatibility_hash="0" * 64),
    "payload_agent_bytes_garbage": _payload(agent_metadata_bytes=b"\x00\x01garbage"),
}


class FakeSideChannel:
    """A prefill side channel that answers every query with one fixed (corrupted) reply."""

    def __init__(self, payload_bytes: bytes, ts: bytes) -> None:
        self._reply = (payload_bytes, ts)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self.queries = 0
        self.error: str | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            while not self._stop.is_set():
                if poller.poll(100):
                    identity, _, _msg = self._sock.recv_multipart()
                    self.queries += 1
                    self._sock.send_multipart((identity, b"", *self._reply))
        except Exception as exc:         # surfaced by the test, never swallowed
            self.error = f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        self._ctx.term()


def serve_meta_case(case: MetaCase, ts: bytes, payload: dict[str, Any],
                    agent: dict[str, Any], engine_id: str) -> FakeSideChannel:
    p, a = case(payload, agent)
    if "engine_id" in a and a["engine_id"] == agent["engine_id"]:
        a = {**a, "engine_id": engine_id}
    p = dict(p)
    if p.get("agent_metadata_bytes") == payload["agent_metadata_bytes"]:
        p["agent_metadata_bytes"] = msgspec.msgpack.encode(a)
    return FakeSideChannel(msgspec.msgpack.encode(p), ts)


def handshake_timed_out(engine: Engine, remote_engine_id: str) -> bool:
    """vLLM's hard 5 s receive timeout on the handshake with ``remote_engine_id`` fired.

    On a loaded 2-core machine the engine's handshake thread sometimes does not see the fake
    side channel's reply within those 5 s; the request then fails before the reply under test
    was ever read, so such an attempt proves nothing and is repeated under a new engine id."""
    needle = f"'remote_engine_id': '{remote_engine_id}'"
    lines = engine.log_text().splitlines()
    for i, ln in enumerate(lines):
        if needle in ln and "handshake_setup_failed" in ln:
            # the traceback that vLLM logs right after names the cause
            for tb in lines[i + 1:i + 60]:
                if "zmq.error.Again" in tb:
                    return True
                if "NIXL transfer failure" in tb:
                    break
    return False


#: How often one fake-peer case is tried before it counts as "D never read the reply".  Stalls
#: of 5 s and more (vLLM's handshake timeout) come in bursts of 10-20 s on this 2-core VM, e.g.
#: while a killed engine's memory is freed, so the attempts back off.
HANDSHAKE_ATTEMPTS = 5
HANDSHAKE_BACKOFF_S = 3.0


def until_reply_read(engine: Engine, label: str, case: MetaCase,
                     captured: tuple[bytes, dict[str, Any], dict[str, Any]],
                     request: Callable[[str, int, int], Outcome]) -> tuple[Outcome, bool]:
    """Serve ``case``'s reply from a fake side channel and run ``request(engine_id, port,
    attempt)`` against ``engine`` until the engine has really read that reply.

    An attempt proves nothing when the query never reached the fake or vLLM's 5 s receive
    timeout fired (:func:`handshake_timed_out`); it is repeated under a new engine id.  Returns
    the last outcome (judged by the caller like any other) and whether the reply was read."""
    ts, payload, agent = captured
    for attempt in range(HANDSHAKE_ATTEMPTS):
        engine_id = f"{label}-{attempt}"
        fake = serve_meta_case(case, ts, payload, agent, engine_id)
        try:
            outcome = request(engine_id, fake.port, attempt)
            outcome.detail += f" [side channel queried {fake.queries}x, attempt {attempt + 1}]"
            assert fake.error is None, fake.error
        finally:
            fake.close()
        if fake.queries and not handshake_timed_out(engine, engine_id):
            return outcome, True
        if attempt + 1 < HANDSHAKE_ATTEMPTS:
            time.sleep(HANDSHAKE_BACKOFF_S * (attempt + 1))
    return outcome, False


# ------------------------------------------------------------------ outcome of one request


@dataclass
class Sent:
    """What the client got for one decode request."""

    kind: str            # "http_error" | "stream_error" | "served" | "timeout" | "conn_error"
    detail: str
    token_ids: list[int]
    seconds: float


@dataclass
class Outcome:
    case: str
    kind: str
    detail: str
    token_ids: list[int]
    seconds: float
    engine_alive: bool
    engine_healthy: bool
    local_ok: bool       # a plain request right after the case is served in full
    #: For a served case: D's own greedy answer to the case's prompt without
    #: ``kv_transfer_params``, asked right after (salted, :data:`BASELINE_SALT`); else None.
    baseline: list[int] | None = None

    @property
    def clean_error(self) -> bool:
        return self.kind in ("http_error", "stream_error")

    @property
    def correct(self) -> bool:
        """Served, and exactly what D computes itself: an answer 200 is only clean when the
        tokens are the baseline's (a read of the wrong blocks is a 200 with other tokens)."""
        return (self.kind == "served" and self.baseline is not None
                and self.token_ids == self.baseline)

    @property
    def clean(self) -> bool:
        return ((self.clean_error or self.correct) and self.engine_alive and self.engine_healthy
                and self.local_ok and self.seconds < BOUND_S)


def send(engine: Engine, params: Any, prompt: list[int], mode: str = "stream",
         body: dict[str, Any] | None = None) -> Sent:
    """One decode request with ``params``, streaming or not (:data:`MODES`); ``body``: more
    request fields."""
    t0 = time.monotonic()
    ask = proxy.stream if mode == "stream" else proxy.complete
    try:
        got = ask(engine, prompt, MAX_TOKENS, kv_transfer_params=params, timeout_s=BOUND_S,
                  body=body)
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:400]
        return Sent("http_error", f"HTTP {exc.code}: {body}", [], time.monotonic() - t0)
    except TimeoutError as exc:
        return Sent("timeout", str(exc) or "timed out", [], time.monotonic() - t0)
    except OSError as exc:
        return Sent("conn_error", f"{type(exc).__name__}: {exc}", [], time.monotonic() - t0)
    dt = time.monotonic() - t0
    if got.error is not None:
        return Sent("stream_error", got.error[:400], got.token_ids, dt)
    return Sent("served", f"finish={got.finish_reason}", got.token_ids, dt)


def healthy(engine: Engine, patience_s: float = 30.0) -> bool:
    """``/health`` answers 200 within ``patience_s`` (one probe has a 2 s timeout, too short on
    a loaded 2-core machine); False at once if the server process is gone."""
    deadline = time.monotonic() + patience_s
    while engine.alive():
        if engine.healthy():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)
    return False


def logged(engine: Engine, needle: str, within_s: float) -> bool:
    """``needle`` is in the engine's log, or shows up within ``within_s``."""
    deadline = time.monotonic() + within_s
    while needle not in engine.log_text():
        if time.monotonic() > deadline or not engine.alive():
            return False
        time.sleep(0.5)
    return True


def baseline(engine: Engine, prompt: list[int]) -> list[int] | None:
    """D's own greedy tokens for ``prompt`` without ``kv_transfer_params``; None if not served."""
    try:
        got = proxy.stream(engine, prompt, MAX_TOKENS, timeout_s=BOUND_S,
                           body={"cache_salt": BASELINE_SALT})
    except OSError:
        return None
    return got.token_ids if got.error is None else None


#: The plain request that shows D serves after an error: always the same prompt, so after the
#: first time it is answered from D's prefix cache (cheap, and the cache holds D's own KV).
LOCAL_PROBE = list(range(200, 230))


def serves(engine: Engine) -> bool:
    try:
        got = proxy.stream(engine, LOCAL_PROBE, 2, timeout_s=BOUND_S)
    except OSError:
        return False
    return got.error is None and len(got.token_ids) == 2


def judge(engine: Engine, case: str, prompt: list[int], sent: Sent) -> Outcome:
    """An error is judged by whether D serves a plain request after it; an answer also by
    whether it equals D's own answer to the same prompt (which is that plain request)."""
    alive = engine.alive()
    healthy_now = healthy(engine)
    base = None
    if not healthy_now:
        local_ok = False
    elif sent.kind == "served":
        base = baseline(engine, prompt)
        local_ok = base is not None and len(base) == MAX_TOKENS
    else:
        local_ok = serves(engine)
    return Outcome(case, sent.kind, sent.detail, sent.token_ids, sent.seconds, alive,
                   healthy_now, local_ok, base)


# ------------------------------------------------------------------ fuzz of kv_transfer_params

#: Fields of P's answer the fuzz may drop, retype or replace, and one P never sends.
FUZZ_FIELDS = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
               "remote_request_id", "remote_host", "remote_port", "tp_size",
               "remote_num_tokens", "remote_blocks_expiry_time", "pdpatch_block_keys",
               "pdpatch_kv_lease_expiry", "unknown_field")
#: What a JSON client can send (integers within msgpack's 64 bits).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=2),
    max_leaves=5,
)

FuzzOp = tuple[Any, ...]

#: One mutation of P's real parameters.  Block ids are never *replaced* by other valid ids of
#: the right count: no engine can tell those from the truth (a lying proxy with well-formed ids
#: is out of reach); every other change to them is malformed and must be refused.
fuzz_ops: st.SearchStrategy[FuzzOp] = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(FUZZ_FIELDS)),
    st.tuples(st.just("retype"), st.sampled_from(FUZZ_FIELDS)),
    st.tuples(st.just("set"), st.sampled_from([f for f in FUZZ_FIELDS
                                               if f != "remote_block_ids"]), json_values),
    st.tuples(st.just("blocks_len"), st.integers(0, 40)),
    st.tuples(st.just("blocks_nest"), st.integers(-1, 2)),
    st.tuples(st.just("blocks_groups"), st.integers(0, 4)),
    st.tuples(st.just("block_retype"), st.integers(0, 1)),
)


def _retyped(v: Any) -> Any:
    """The same information in another JSON type (what a sloppy proxy does)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, str):
        return len(v)
    if isinstance(v, list):
        return {str(i): x for i, x in enumerate(v)}
    if isinstance(v, dict):
        return list(v.values())
    return 0


def mutate(good: dict[str, Any], ops: list[FuzzOp]) -> Any:
    """P's parameters ``good`` with ``ops`` applied in order."""
    bad: Any = copy.deepcopy(good)
    for op, *args in ops:
        if not isinstance(bad, dict):
            break
        ids = bad.get("remote_block_ids")
        first = ids[0] if isinstance(ids, list) and ids and isinstance(ids[0], list) else None
        if first is not None and not all(_is_id(b) for b in first):
            first = None               # the block-id ops below mutate well-formed lists only
        if op == "drop":
            bad.pop(args[0], None)
        elif op == "retype":
            bad[args[0]] = _retyped(bad.get(args[0]))
        elif op == "set":
            bad[args[0]] = args[1]
        elif first is None:
            continue
        elif op == "blocks_len":       # fewer or more ids than the prompt has blocks
            n = args[0] if args[0] != len(first) else len(first) + 1
            top = max(first, default=0)
            bad["remote_block_ids"] = [(first + list(range(top + 1, top + 1 + n)))[:n]]
        elif op == "blocks_nest":      # -1: flat; 1, 2: each id wrapped that deep; 0: no groups
            bad["remote_block_ids"] = (first if args[0] < 0 else [] if args[0] == 0 else
                                       [[_wrap(b, args[0]) for b in first]])
        elif op == "blocks_groups":    # the model has one KV-cache group
            bad["remote_block_ids"] = [first] * (args[0] if args[0] != 1 else 2)
        elif op == "block_retype" and first:
            bad["remote_block_ids"] = ([[_retyped(first[0]), *first[1:]]] if args[0] else
                                       [[float(b) + 0.5 for b in first]])
    return bad


def _is_id(b: Any) -> bool:
    return isinstance(b, int) and not isinstance(b, bool)


def _wrap(b: int, depth: int) -> Any:
    for _ in range(depth):
        b = [b]
    return b
