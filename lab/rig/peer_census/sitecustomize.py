"""Lab only: what a NIXL decode worker holds of its prefill peers, for stock and pdpatch engines
alike (the dead-peer count of docs/peers.md).

On when the engine's environment has ``PDLAB_PEER_CENSUS=<dir>`` (the rig then puts this
directory on the engine's ``PYTHONPATH``).  After each per-step result collection of a NIXL
worker (``get_transfer_results`` / ``get_finished``, whichever the release's class defines;
at most twice a second) it writes ``<dir>/census-<pid>.json``: the remote engines in each
per-engine table of the worker (``_remote_agents``, ``dst_xfer_side_handles``, ...; the
worker's own engine id left out), every remote agent name it ever loaded and how many of them
NIXL still knows (``check_remote_metadata``), its pending handshakes, and the process's open
sockets and resident memory.  It reads; it changes nothing.
"""

import contextlib
import os
import runpy
import sys

TABLES = ("_remote_agents", "dst_xfer_side_handles", "kv_caches_base_addr", "dst_num_blocks",
          "tp_mappings", "_engine_last_active", "_engine_clock_offset", "_engine_by_address",
          "_handshake_futures", "_remote_registration_generations", "_tp_size", "_block_size",
          "_physical_blocks_per_logical", "dst_region_num_blocks", "_dst_pairs")
MODULES = ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
           "vllm.distributed.kv_transfer.kv_connector.v1.nixl.worker",
           "vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector")


def _census(out_dir: str) -> None:
    import json
    import threading
    import time

    import wrapt

    lock = threading.Lock()
    loaded: list[str] = []
    last = [0.0]
    path = os.path.join(out_dir, f"census-{os.getpid()}.json")

    def sockets() -> int:
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        return n

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def write(worker) -> None:
        own = getattr(worker, "engine_id", None)
        tables = {}
        for name in TABLES:
            found = getattr(worker, name, None)
            if isinstance(found, dict):
                keys = [k for k in list(found) if k != own and
                        (name != "_remote_agents" or found.get(k))]
                tables[name] = sorted(str(k) for k in keys)
        topo = getattr(worker, "transfer_topo", None) or getattr(worker, "kv_topo", None)
        engines = getattr(topo, "_engines", None)
        if isinstance(engines, dict):
            tables["transfer_topo._engines"] = sorted(str(k) for k in engines)
        with lock:
            names = list(loaded)
        known = []
        for name in names:
            try:
                if worker.nixl_wrapper.check_remote_metadata(name):
                    known.append(name)
            except Exception:
                pass
        held = [n for agents in getattr(worker, "_remote_agents", {}).values()
                for n in (agents or {}).values()]
        data = {"pid": os.getpid(), "time": time.time(), "engine_id": own, "tables": tables,
                "agents_loaded_ever": len(names), "agents_nixl_knows": len(known),
                "agents_held": len(held), "sockets": sockets(), "rss_mib": round(rss_mib(), 1)}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def after_step(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            try:
                write(instance)
            except Exception as exc:      # never disturb the engine
                print(f"peer census failed: {exc!r}", file=sys.stderr)
        return result

    def note_agent(wrapped, instance, args, kwargs):
        name = wrapped(*args, **kwargs)
        if isinstance(name, (str, bytes)):      # NIXL 1.5.1 names agents with bytes
            with lock:
                if name not in loaded:
                    loaded.append(name)
        return name

    def hook(module) -> None:
        for cls_name in ("NixlBaseConnectorWorker", "NixlConnectorWorker"):
            cls = getattr(module, cls_name, None)
            if cls is None:
                continue
            step = "get_transfer_results" if "get_transfer_results" in vars(cls) else \
                "get_finished" if "get_finished" in vars(cls) else None
            if step:
                wrapt.wrap_function_wrapper(module, f"{cls_name}.{step}", after_step)
            if "add_remote_agent" in vars(cls):
                wrapt.wrap_function_wrapper(module, f"{cls_name}.add_remote_agent", note_agent)

    for name in MODULES:
        wrapt.register_post_import_hook(hook, name)


if os.environ.get("PDLAB_PEER_CENSUS"):
    os.makedirs(os.environ["PDLAB_PEER_CENSUS"], exist_ok=True)
    _census(os.environ["PDLAB_PEER_CENSUS"])

_here = os.path.dirname(os.path.abspath(__file__))
runpy.run_path(os.path.join(os.path.dirname(_here), "site_chain.py"))[
    "chain_next_sitecustomize"](_here)
