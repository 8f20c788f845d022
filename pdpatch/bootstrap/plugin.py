"""vLLM ``vllm.general_plugins`` entry point.

vLLM calls general plugins in the API server, in EngineCore and in every worker (on Ray after
it copied the driver's environment into the actor), before any NIXL object is built.  vLLM does
not catch a plugin's exception, so an invalid pdpatch setting stops ``vllm serve`` at startup
with the message naming the variable, instead of leaving pdpatch silently inactive.
"""

from __future__ import annotations


def load() -> None:
    from pdpatch.bootstrap.entry import activate

    activate(source="vllm.general_plugins", raise_errors=True)
