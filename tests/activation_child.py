"""Run as a child process by test_activation.py: reports whether pdpatch is active here.

Prints one JSON line: {"pid", "wrapped", "installed"} for this process, and for the
multiprocessing children it starts.  Kept importable so spawn/forkserver children can load it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys

PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"


def probe() -> dict:
    import importlib

    import wrapt

    cls = importlib.import_module(PULL).NixlPullConnectorWorker
    attr = cls.__dict__["_read_blocks_for_req"]
    installer = sys.modules.get("pdpatch.installer")
    return {"pid": os.getpid(), "wrapped": isinstance(attr, wrapt.FunctionWrapper),
            "installed": bool(installer and installer.status()["installed"])}


def _child(queue) -> None:
    queue.put(probe())


def main(mode: str) -> None:
    if mode == "late-env":
        import vllm  # the import hook fires while the switch is still off

        before = probe()
        os.environ["ENABLE_PDPATCH"] = "true"     # what Ray's env copy does, later
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        print(json.dumps({"before": before, "after": probe()}), flush=True)
        return
    if mode == "self":
        print(json.dumps(probe()), flush=True)
        return
    import vllm  # noqa: F401

    ctx = mp.get_context(mode)
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,), name="VllmWorker-7")
    proc.start()
    result = queue.get(timeout=120)
    proc.join(60)
    print(json.dumps({"parent": os.getpid(), "child": result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
