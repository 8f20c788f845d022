"""Handshake side of ``kv_segments``: hashes that differ only in the backend name, and the
geometry a pdpatch peer advertises, both seen while vLLM decodes the peer's payload.

``_nixl_handshake`` decodes the peer's ``NixlHandshakePayload`` and compares its compatibility
hash inline, with no seam between the two, and neither the hash function nor msgspec's
``__post_init__`` receives the worker.  So the decision about one peer crosses vLLM's code
through the only channels there are, each with one owner:

* the hash's alternates, recorded when vLLM computes the local hash (worker start), read at the
  payload decode: the process's :class:`~.state.KvSegmentsState` (``alternates``);
* what one handshake learns (hashes accepted, the geometry each peer rank advertised): its
  :class:`Handshake`, created only by :func:`handshake_scope` -- which also scopes the worker
  module's payload class to pdpatch's (:class:`ScopedPayloadClass`) -- and found only with
  :func:`current_handshake`, on the handshake's thread (payload decode, then
  ``add_remote_agent``);
* the worker's own geometry and the conversions its ``add_remote_agent`` calls have in flight
  (``add_remote_agent`` also runs outside a handshake, e.g. in vLLM's own tests): its
  :class:`~.state.WorkerState`;
* the proxies in front of the worker's NIXL agent (0.19/0.20 substitution, staging):
  :mod:`pdpatch.agent_layers`."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pdpatch import config
from pdpatch.installer import state_of
from pdpatch.log import logger
from pdpatch.patches.kv_segments.settings import FIELD, NAME, allowed, interchangeable
from pdpatch.patches.kv_segments.state import count
from pdpatch.registry import Wrapper

# ------------------------------------------------------------- hash: record the alternates


def hash_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Return vLLM's hash unchanged; remember what the same configuration hashes to with each
    other interchangeable backend name (same call, only the name differs)."""
    result = wrapped(*args, **kwargs)
    try:
        vllm_config = args[0] if args else kwargs["vllm_config"]
        in_args = len(args) > 1
        name = args[1] if in_args else kwargs.get("attn_backend_name")
        names = interchangeable(vllm_config)
        if name not in names or not allowed(vllm_config):
            return result
        alternates: dict[str, str] = {}
        for other in sorted(names - {name}):
            if in_args:
                alt = wrapped(args[0], other, *args[2:], **kwargs)
            else:
                alt = wrapped(*args, **{**kwargs, "attn_backend_name": other})
            alternates[alt] = other
        state = state_of(NAME)
        with state.lock:
            state.alternates[result] = alternates
    except config.ConfigError:
        raise
    except Exception as exc:  # never let the bookkeeping break vLLM's own hash
        logger.debug("pdpatch kv_segments: no hash alternates recorded: %s", exc)
    return result


def alternates_for(local_hash: str) -> dict[str, str]:
    state = state_of(NAME)
    with state.lock:
        return dict(state.alternates.get(local_hash, {}))


# ------------------------------------------------------------ the handshake this thread runs


@dataclass
class Handshake:
    """What one running handshake learnt from the peer's payload before vLLM checked it."""

    worker: Any
    accepted: dict[str, str] = field(default_factory=dict)   # remote hash -> its backend name
    # the peer rank's advertised geometry, by its NIXL agent metadata (one per rank)
    advertised: dict[bytes, Mapping] = field(default_factory=dict)

    def advertised_by(self, meta: Any) -> Mapping | None:
        """The geometry the peer rank behind ``meta`` advertised, if any."""
        agent = getattr(meta, "agent_metadata", None)
        return self.advertised.get(agent) if isinstance(agent, bytes) else None


_current = threading.local()


@contextmanager
def handshake_scope(worker: Any, module: Any = None) -> Iterator[Handshake]:
    """The one place a :class:`Handshake` is made: for ``worker``, the current thread's while
    the body runs, with ``module``'s payload class scoped to pdpatch's (None: a caller that
    decodes with :func:`payload_class` itself)."""
    prev = getattr(_current, "handshake", None)
    _current.handshake = Handshake(worker)
    try:
        if module is None:
            yield _current.handshake
        else:
            with scoped_payload.active(module):
                yield _current.handshake
    finally:
        _current.handshake = prev


def current_handshake() -> Handshake | None:
    return getattr(_current, "handshake", None)


def advertised_geometry(meta: Any) -> Mapping | None:
    """The geometry the peer rank behind ``meta`` advertised in this thread's handshake."""
    ctx = current_handshake()
    return None if ctx is None else ctx.advertised_by(meta)


def _on_payload(payload: Any) -> None:
    """Runs in the decoded ``NixlHandshakePayload``'s ``__post_init__`` (msgspec calls it)."""
    ctx = current_handshake()
    if ctx is None:
        return
    _note_advertised(ctx, getattr(payload, "agent_metadata_bytes", None))
    local = getattr(ctx.worker, "compat_hash", None)
    remote = getattr(payload, "compatibility_hash", None)
    if not local or not remote or remote == local:
        return
    name = alternates_for(local).get(remote)
    if name is None:
        return
    ctx.accepted[remote] = name
    payload.compatibility_hash = local
    count("hash_alternates_accepted")
    logger.info(
        "pdpatch kv_segments: peer's NIXL compatibility hash differs from ours only in the "
        "attention backend (peer %s, local %s); its K/V geometry is checked before any "
        "descriptor is built", name, getattr(ctx.worker, "backend_name", "?"))


def _note_advertised(ctx: Handshake, raw: Any) -> None:
    """Keep the geometry a pdpatch peer added to its agent metadata.  vLLM decodes the same
    bytes into its own ``NixlAgentMetadata``, which drops the unknown field, so the object
    vLLM's code sees is exactly what a stock peer would produce."""
    import msgspec

    if not isinstance(raw, bytes):
        return
    try:
        meta = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return              # vLLM's own decode reports it
    if isinstance(meta, dict) and isinstance(meta.get(FIELD), Mapping) and \
            isinstance(meta.get("agent_metadata"), bytes):
        ctx.advertised[meta["agent_metadata"]] = meta[FIELD]


# ------------------------------------------- scoped subclass of the payload wire class

_class_cache: dict[type, type] = {}
_class_lock = threading.Lock()


def payload_class(base: type) -> type:
    """``NixlHandshakePayload`` whose decode lets :func:`_on_payload` see the peer's hash and
    raw agent metadata, before vLLM compares the hash."""
    with _class_lock:
        if base not in _class_cache:
            parent_post = getattr(base, "__post_init__", None)

            def __post_init__(self: Any) -> None:
                if parent_post is not None:
                    parent_post(self)
                _on_payload(self)

            _class_cache[base] = dataclasses.make_dataclass(
                base.__name__, [], bases=(base,),
                namespace={"__module__": __name__, "_pdpatch_base": base,
                           "__post_init__": __post_init__})
        return _class_cache[base]


class ScopedPayloadClass:
    """Replace the worker module's ``NixlHandshakePayload`` while at least one handshake runs;
    restore it after the last one.

    Why a module global: the decode is the only place a hash that differs only in the backend
    name can be recognised (see the module docstring).  Any thread that meets the replacement
    meanwhile gets a subclass with no extra field, which decodes every payload exactly as
    vLLM's class does.
    """

    NAME = "NixlHandshakePayload"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, list[Any]] = {}   # module name -> [depth, original, mine]

    @contextmanager
    def active(self, module: Any) -> Iterator[None]:
        name = module.__name__
        with self._lock:
            entry = self._active.get(name)
            if entry is None:
                original = _stock(module.__dict__[self.NAME])
                mine = payload_class(original)
                setattr(module, self.NAME, mine)
                entry = self._active[name] = [0, original, mine]
            entry[0] += 1
        try:
            yield
        finally:
            with self._lock:
                entry[0] -= 1
                if entry[0] == 0:
                    if module.__dict__.get(self.NAME) is entry[2]:
                        setattr(module, self.NAME, entry[1])
                    del self._active[name]

    def depth(self, module_name: str) -> int:
        with self._lock:
            entry = self._active.get(module_name)
            return entry[0] if entry else 0


def _stock(cls: type) -> type:
    return getattr(cls, "__dict__", {}).get("_pdpatch_base", cls)


scoped_payload = ScopedPayloadClass()


def make_handshake_wrapper(module_name: str) -> Wrapper:
    """``_nixl_handshake`` of ``module_name``, run with this thread's :class:`Handshake` and
    the module's payload class scoped to pdpatch's."""
    def handshake(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not allowed(instance):
            return wrapped(*args, **kwargs)
        with handshake_scope(instance, sys.modules[module_name]):
            return wrapped(*args, **kwargs)

    return handshake
