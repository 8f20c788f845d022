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

    def _dead(self, agent: str | bytes | None, exc: BaseException) -> None:
        if agent is not None and is_disconnect(exc):
            with self._book.lock:
                self._book.dead.add(agent)

    def _agent_of_xfer(self, handle: Any) -> Any:
        try:
            with self._lock:
                return self._xfer_agent.get(handle)
        except TypeError:           # an unhashable handle: not one this layer mapped
            return None

    def prep_xfer_dlist(self, agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self._agent.prep_xfer_dlist(agent_name, *args, **kwargs)
        if isinstance(agent_name, NAMES) and agent_name not in LOCAL_AGENTS:
            try:
                with self._lock:
                    self._list_agent[handle] = agent_name
            except TypeError:
                pass
        return handle

    def make_prepped_xfer(self, op: Any, local: Any, local_ids: Any, remote: Any,
                          *args: Any, **kwargs: Any) -> Any:
        try:
            with self._lock:
                agent = self._list_agent.get(remote)
        except TypeError:
            agent = None
        try:
            handle = self._agent.make_prepped_xfer(op, local, local_ids, remote, *args, **kwargs)
        except Exception as exc:
            self._dead(agent, exc)
            raise
        if agent is not None:
            try:
                with self._lock:
                    self._xfer_agent[handle] = agent
            except TypeError:
                pass
        return handle

    def initialize_xfer(self, op: Any, local: Any, remote: Any, agent: Any,
                        *args: Any, **kwargs: Any) -> Any:
        try:
            handle = self._agent.initialize_xfer(op, local, remote, agent, *args, **kwargs)
        except Exception as exc:
            self._dead(agent if isinstance(agent, NAMES) else None, exc)
            raise
        if isinstance(agent, NAMES):
            try:
                with self._lock:
                    self._xfer_agent[handle] = agent
            except TypeError:
                pass
        return handle

    def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._agent.transfer(handle, *args, **kwargs)
        except Exception as exc:
            self._dead(self._agent_of_xfer(handle), exc)
            raise

    def check_xfer_state(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._agent.check_xfer_state(handle, *args, **kwargs)
        except Exception as exc:
            self._dead(self._agent_of_xfer(handle), exc)
            raise

    def send_notif(self, agent_name: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._agent.send_notif(agent_name, *args, **kwargs)
        except Exception as exc:
            self._dead(agent_name if isinstance(agent_name, NAMES) else None, exc)
            raise

    def release_xfer_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._agent.release_xfer_handle(handle, *args, **kwargs)
        try:
            with self._lock:
                self._xfer_agent.pop(handle, None)
        except TypeError:
            pass
        return result

    def release_dlist_handle(self, handle: Any, *args: Any, **kwargs: Any) -> Any:
        result = self._agent.release_dlist_handle(handle, *args, **kwargs)
        try:
            with self._lock:
                self._list_agent.pop(handle, None)
        except TypeError:
            pass
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
