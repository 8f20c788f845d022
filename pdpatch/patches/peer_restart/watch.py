"""The agent layer that notices a dead prefill agent: ``peer_watch``.

NIXL tells a decode worker that a remote agent's process is gone only by raising
``nixlRemoteDisconnectError`` (``NIXL_ERR_REMOTE_DISCONNECT``) from the calls that reach it:
``transfer`` and ``check_xfer_state`` of a READ, ``send_notif`` (NIXL 1.5.1, measured: after P
is SIGKILLed every ``transfer`` on its prepared lists raises, a READ in flight fails ~0.05 s
later, a notification raises; ``check_remote_metadata`` stays True, so vLLM 0.32+'s own probe
never marks the peer invalid).  vLLM catches the error and logs it (one request failed), and
keeps the agent.  This layer sees those calls on their way to the agent, remembers which
remote agent each prepared list and transfer belongs to, and on that error records the agent
as dead in the worker's :class:`~.book.PeerBook` before re-raising: vLLM's own handling is
unchanged, and the next step of the worker forgets the engine (:mod:`.receive`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pdpatch.agent_proxy import AgentProxy
from pdpatch.patches.peer_restart.book import PeerBook

DISCONNECT = "nixlRemoteDisconnectError"
LOCAL_AGENTS = ("", "NIXL_INIT_AGENT", b"", b"NIXL_INIT_AGENT")
NAMES = (str, bytes)
"""NIXL 1.5.1's ``add_remote_agent`` returns the agent's name as ``bytes`` (vLLM passes it on
as it is); the local list's agent is named with a ``str``."""


def is_disconnect(exc: BaseException) -> bool:
    """Whether NIXL raised its remote-disconnect status (by class name: no NIXL import)."""
    return any(cls.__name__ == DISCONNECT for cls in type(exc).__mro__)


class PeerWatch(AgentProxy):
    """A proxy in front of a decode worker's agent that maps prepared remote lists and
    transfers to their remote agent and records disconnected agents in ``book``."""

    kind = "peer_watch"

    def __init__(self, agent: Any, book: PeerBook) -> None:
        AgentProxy.__init__(self, agent)
        self._book = book
        self._lock = threading.Lock()
        self._list_agent: dict[Any, Any] = {}     # remote dlist handle -> agent name
        self._xfer_agent: dict[Any, Any] = {}     # transfer handle -> agent name

    def _dead(self, agent: Any, exc: BaseException) -> None:
        """Record ``agent`` dead on NIXL's disconnect error (``agent``: a name, or anything else
        where no remote agent is known: ``None``, an unmapped handle's)."""
        if isinstance(agent, NAMES) and is_disconnect(exc):
            with self._book.lock:
                self._book.dead.add(agent)

    def _call(self, method: str, agent_of: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        """The agent's ``method``; on NIXL's disconnect error the agent named by ``agent_of()``
        (asked only then) is recorded dead before the error goes on."""
        try:
            return getattr(self._agent, method)(*args, **kwargs)
        except Exception as exc:
            self._dead(agent_of(), exc)
            raise

    def _get(self, table: dict[Any, Any], handle: Any) -> Any:
        try:
            with self._lock:
                return table.get(handle)
        except TypeError:           # an unhashable handle: not one this layer mapped
            return None

    def _put(self, table: dict[Any, Any], handle: Any, agent: Any) -> None:
        try:
            with self._lock:
                table[handle] = agent
        except TypeError:
            pass

    def _drop(self, table: dict[Any, Any], handle: Any) -> None:
        try:
            with self._lock:
                table.pop(handle, None)
        except TypeError:
            pass

    def prep_xfer_dlist(self, agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._agent.prep_xfer_dlist(agent_name, *args, **kwargs)
        if isinstance(agent_name, NAMES) and agent_name not in LOCAL_AGENTS:
            self._put(self._list_agent, handle, agent_name)
        return handle

    def make_prepped_xfer(self, op: Any, local: Any, local_ids: Any, remote: Any,
                          *args: Any, **kwargs: Any) -> Any:
        agent = self._get(self._list_agent, remote)
        handle = self._call("make_prepped_xfer", lambda: agent,
                            op, local, local_ids, remote, *args, **kwargs)
        if agent is not None:
            self._put(self._xfer_agent, handle, agent)
        return handle

    def initialize_xfer(self, op: Any, local: Any, remote: Any, agent: Any,
                        *args: Any, **kwargs: Any) -> Any:
        handle = self._call("initialize_xfer", lambda: agent,
                            op, local, remote, agent, *args, **kwargs)
        if isinstance(agent, NAMES):
            self._put(self._xfer_agent, handle, agent)
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call("transfer", lambda: self._get(self._xfer_agent, handle),
                          handle, *args, **kwargs)

    def check_xfer_state(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call("check_xfer_state", lambda: self._get(self._xfer_agent, handle),
                          handle, *args, **kwargs)

    def send_notif(self, agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        return self._call("send_notif", lambda: agent_name, agent_name, *args, **kwargs)

    def release_xfer_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._agent.release_xfer_handle(handle, *args, **kwargs)
        self._drop(self._xfer_agent, handle)
        return result

    def release_dlist_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._agent.release_dlist_handle(handle, *args, **kwargs)
        self._drop(self._list_agent, handle)
        return result

    def add_remote_agent(self, metadata: Any, *args: Any, **kwargs: Any) -> Any:
        name = self._agent.add_remote_agent(metadata, *args, **kwargs)
        engine = getattr(self._book.adding, "engine", None)
        if engine is not None:
            with self._book.lock:
                self._book.loaded.setdefault(engine, set()).add(name)
        return name

    def remove_remote_agent(self, agent: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._agent.remove_remote_agent(agent, *args, **kwargs)
        with self._book.lock:
            self._book.dead.discard(agent)
        return result

    def mapped(self) -> tuple[int, int]:
        """(remote lists, transfers) this layer still maps: what a test of forgetting reads."""
        with self._lock:
            return len(self._list_agent), len(self._xfer_agent)
