"""NIXL agents as the bench uses them: made as vLLM 0.33 makes them, memory registration, a
transfer posted and polled to its end, and :class:`Clock`, the agent as the staging agent sees
it, which notes when NIXL returned from ``transfer`` and first answered DONE."""

from __future__ import annotations

import time


def new_agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    # as vLLM 0.33 builds it: UCX, num_threads=4, telemetry on
    return nixl_agent(name, nixl_agent_config(num_threads=4, capture_telemetry=True))


def register(agent, ranges, mem: str):
    return agent.register_memory([(int(s), int(e - s), 0, "") for s, e in ranges], mem)


def wait(agent, handle, timeout: float = 120.0) -> str:
    """Post ``handle`` and poll it to the end."""
    return poll(agent, handle, agent.transfer(handle), timeout)


def poll(agent, handle, state: str, timeout: float = 120.0) -> str:
    """Poll a posted transfer from its ``state`` at posting to the end."""
    deadline = time.monotonic() + timeout
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        if time.monotonic() > deadline:
            return "TIMEOUT"
    return state


class Clock:
    """The NIXL agent as the staging agent sees it, noting when NIXL itself returned from
    ``transfer`` and first answered DONE: the bench's view inside one staged READ."""

    def __init__(self, agent) -> None:
        self._agent = agent
        self.posted: dict = {}
        self.landed: dict = {}

    def __getattr__(self, name: str):
        return getattr(self._agent, name)

    def transfer(self, handle, *args, **kwargs):
        state = self._agent.transfer(handle, *args, **kwargs)
        self.posted[handle] = time.perf_counter()
        return state

    def check_xfer_state(self, handle):
        state = self._agent.check_xfer_state(handle)
        if state == "DONE" and handle not in self.landed:
            self.landed[handle] = time.perf_counter()
        return state
