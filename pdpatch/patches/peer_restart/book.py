"""What ``peer_restart`` keeps: on P's scheduler half, the tokens of its own incarnation; on a
receive's ``ReqMeta``, the incarnation and arrival its request names; on a decode worker, the
:class:`PeerBook` -- which incarnation of each prefill engine it holds, which it retired, and
its requests' clocks.

Why tokens: NIXL names every agent ``uuid4()`` at worker start, in every release, so the bytes
P's handshake hands D (``NixlAgentMetadata.agent_metadata``, NIXL's serialized agent) differ
for every incarnation of P, whatever engine id, host and port it keeps.  Both sides hash those
same bytes: P into the ``kv_transfer_params`` of each request it prefills for D, D when it loads
the agent.  Equal hashes: the request's blocks live in the agent D holds.  Different: the
request was prefilled by another incarnation -- a newer one (D holds a dead agent) or an older
one (its blocks are gone; reading them at the new incarnation's ids is someone else's KV).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

PARAMS_KEY = "pdpatch_p_incarnation"
"""The entry P adds to ``kv_transfer_params``: ``{"pp:tp": token}`` for every rank it serves."""
TOKEN_LEN = 16
MAX_RANKS = 256
RETIRED_PER_ENGINE = 16


def token(agent_metadata: bytes) -> str:
    """The incarnation token of one rank: a digest of NIXL's serialized agent."""
    return hashlib.sha256(bytes(agent_metadata)).hexdigest()[:TOKEN_LEN]


def tokens_in(params: Any) -> dict[str, str] | None:
    """The tokens a request's params carry, if well-formed (a client may put anything there:
    anything else is treated as no tokens, the way a P without pdpatch sends none)."""
    value = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(value, dict) or not value or len(value) > MAX_RANKS:
        return None
    if not all(isinstance(k, str) and isinstance(v, str) and len(v) == TOKEN_LEN
               for k, v in value.items()):
        return None
    return dict(value)


@dataclass
class PTokens:
    """P's scheduler half: the token of each rank it serves (``"pp:tp"`` -> token)."""

    tokens: dict[str, str] = field(default_factory=dict)


@dataclass
class Incarnation:
    """On a receive's ``ReqMeta`` (pickled with it to the workers): the tokens its params name
    (None: a P without pdpatch) and when the request reached D (``Request.arrival_time``, wall
    clock; None where unknown)."""

    tokens: dict[str, str] | None = None
    arrival: float | None = None


@dataclass
class Pending:
    """An engine D has stopped reading from and will forget once its READs and handshake are
    over: why, since when, and the requests that wait to read from its next incarnation."""

    why: str
    since: float
    deferred: list[tuple[str, Any]] = field(default_factory=list)
    reads_failed: bool = False


@dataclass
class PeerBook:
    """A decode worker's record of its prefill peers' incarnations.

    ``token_of`` and ``loaded`` are written by the handshake thread (``add_remote_agent``),
    ``dead`` by whichever thread saw a disconnect (the agent layer): under ``lock``.  The rest
    is the model-runner thread's own (``start_load_kv``, ``_read_blocks_for_req``, the step's
    result collection), as vLLM's own ``_recving_*`` tables are.
    """

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # agent names are NIXL's: bytes from NIXL 1.5.1's add_remote_agent, str in vLLM's tests
    token_of: dict[Any, str] = field(default_factory=dict)        # agent name -> token
    loaded: dict[str, set[Any]] = field(default_factory=dict)     # engine -> agent names loaded
    dead: set[Any] = field(default_factory=set)                   # agents seen disconnected
    retired: dict[str, deque] = field(default_factory=dict)       # engine -> tokens retired
    tried: dict[str, deque] = field(default_factory=dict)         # engine -> tokens handshaken for
    pending: dict[str, Pending] = field(default_factory=dict)     # engine -> being forgotten
    fence: dict[str, float] = field(default_factory=dict)         # engine -> wall clock
    address: dict[tuple[str, int], str] = field(default_factory=dict)  # (host, port) -> engine
    first_seen: dict[str, float] = field(default_factory=dict)    # req -> perf_counter
    posted: dict[str, float] = field(default_factory=dict)        # req -> perf_counter of READ
    doomed: set[str] = field(default_factory=set)                 # reqs failed, never to read
    forgotten: int = 0
    active: bool | None = None                                    # decided at first use
    # the engine whose handshake this thread is adding (so the agent layer can name the
    # agents NIXL loads for it, those of a handshake refused half-way included)
    adding: threading.local = field(default_factory=threading.local, repr=False)

    def retire(self, engine: str, tokens: Any) -> None:
        ring = self.retired.setdefault(engine, deque(maxlen=RETIRED_PER_ENGINE))
        for t in tokens:
            if t not in ring:
                ring.append(t)

    def was_tried(self, engine: str, tokens: Any) -> bool:
        return any(t in self.tried.get(engine, ()) for t in tokens)

    def try_tokens(self, engine: str, tokens: Any) -> None:
        ring = self.tried.setdefault(engine, deque(maxlen=RETIRED_PER_ENGINE))
        ring.extend(t for t in tokens if t not in ring)

    def is_retired(self, engine: str, tokens: Any) -> bool:
        return any(t in self.retired.get(engine, ()) for t in tokens)

    def now(self) -> float:
        return time.perf_counter()
