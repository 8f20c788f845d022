"""A proxy in front of a NIXL agent: the one seam pdpatch has into a NIXL worker's transfers.

vLLM's NIXL worker reaches its agent only through ``worker.nixl_wrapper``, so code that must
see some of those calls stands an :class:`AgentProxy` there: it handles the calls it defines
and passes everything else to the agent below it.  The core's
:class:`pdpatch.kv.staging.StagingAgent` is one; how the patches stack several in front of one
worker's agent is :mod:`pdpatch.agent_layers`' business, which imports this module, never the
reverse.
"""

from __future__ import annotations

from typing import Any, ClassVar


class AgentProxy:
    """A proxy in front of a NIXL agent.  Subclasses name their place in a stack in ``kind``
    (:data:`pdpatch.agent_layers.ORDER`), define the calls they change and reach the agent
    below as ``self._agent``."""

    kind: ClassVar[str]
    _agent: Any

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def __getattr__(self, name: str) -> Any:
        if name == "_agent":        # not set yet: no delegation (and no recursion)
            raise AttributeError(name)
        return getattr(self._agent, name)
