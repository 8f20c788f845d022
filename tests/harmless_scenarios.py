"""Do-no-harm scenarios on a release's real NIXL worker code: what vLLM does must not change
where it works (run stock, then with pdpatch installed, by ``robust_worker.release_report``;
the tests compare the two).

* ``stand_in``: every target of every patch declared for the release, called on a stand-in
  instance (no ``__init__``: no attributes at all) with ``None`` arguments.  Whatever the
  release raises there -- mostly ``AttributeError`` for its own missing state -- pdpatch's
  wrappers must raise too, unchanged; none may raise its own ``AttributeError``, ``KeyError``
  or ``StopIteration`` out of vLLM code.
* ``metadata``: a worker's registration and the handshake metadata it advertises, decoded with
  the release's own ``NixlAgentMetadata``: every field a peer reads, the memory registered
  with NIXL and the descriptor lists prepared.  pdpatch may add its optional geometry field
  to the wire bytes (stock decoders drop it); nothing a stock decoder reads may differ.
  ``metadata_padded``: the same with KV views over buffers that have a sub-block tail.
* ``hetero_tp``: a well-formed prefill peer with twice the decode TP (each decode rank reads a
  head slice from two peer ranks) is handshaken and read from as stock vLLM does.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import robust_worker as rw

from pdpatch.patches import all_patches
from pdpatch.registry import Target


def _stand_in_outcome(target: Target) -> str:
    module = importlib.import_module(target.module)
    *path, attr = target.qualname.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    fn = getattr(raw, "__wrapped__", raw)            # the release's function, for its arity
    fn = getattr(fn, "__func__", fn)
    required = [p for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD)]
    if isinstance(owner, type):
        if not isinstance(inspect.getattr_static(owner, attr), (classmethod, staticmethod)):
            required = required[1:]                  # self
            stand_in = type("StandIn", (owner,), {})
            stand_in.__abstractmethods__ = frozenset()
            call = getattr(object.__new__(stand_in), attr)
        else:
            required = required[1:] if isinstance(inspect.getattr_static(owner, attr),
                                                  classmethod) else required
            call = getattr(owner, attr)
    else:
        call = getattr(module, attr)
    try:
        result = call(*[None] * len(required))
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"[:400]
    return f"returned {type(result).__name__}"


def scenario_stand_in() -> dict[str, str]:
    version = rw.version_of()
    return {f"{p.name} {t.label}": _stand_in_outcome(t)
            for p in all_patches() if version in p.versions for t in p.targets(version)}


def scenario_metadata(padding: int = 0) -> dict[str, Any]:
    w = rw.build_worker("engine-m", num_blocks=32, padding=padding)
    fields = dataclasses.asdict(rw.own_metadata(w))
    for per_process in ("kv_caches_base_addr", "agent_metadata"):     # fresh tensors, agent
        fields.pop(per_process)
    agent = w.nixl_wrapper
    registered = [[(length, dev, mem) for _, length, dev, mem in descs]
                  for descs in agent.registered]
    dlists = sorted((name, len(descs), sorted({n for _, n in descs}))
                    for name, descs in agent.dlists.values())
    return {"fields": fields, "registered": registered, "dlists": dlists,
            "num_blocks": int(w.num_blocks), "block_len_per_layer": list(w.block_len_per_layer)}


def scenario_hetero_tp() -> dict[str, Any]:
    heads, peer_tp = 4, 2
    d = rw.build_worker("decode-engine", kv_heads=heads, num_blocks=32)
    ranks = {r: rw.remote_metadata(rw.build_worker("prefill-tp2", role="kv_producer",
                                                   kv_heads=heads, num_blocks=40, tp_rank=r,
                                                   tp_size=peer_tp), "prefill-tp2", f"TP{r}")
             for r in range(peer_tp)}
    errors = rw.connect_by_handshake(d, ranks, peer_tp)
    crash = rw.step(d, rw.recv_metadata([{"req_id": "r", "local_ids": [[1, 2]],
                                          "remote_ids": [[3, 4]], "engine": "prefill-tp2",
                                          "port": rw.PORT + 3, "tp_size": peer_tp}]))
    done, crash2 = rw.run_until(d, lambda a: "r" in set(a["done_recving"]) |
                                set(a["failed_recving"]))
    reads = rw._reads_by_req(d).get("r", [])
    return {"errors": errors, "crash": crash or crash2, "results": done,
            "reads": sorted((r["local_ids"], r["remote_ids"]) for r in reads),
            "read_lens": sorted({n for agent, descs in d.nixl_wrapper.dlists.values()
                                 if agent.startswith("TP") for _, n in descs})}


def scenario_metadata_padded() -> dict[str, Any]:
    """The same, each layer's tensor a view of a buffer with a tail shorter than a block (the
    releases that register whole storages, 0.29+, decide themselves what to make of it)."""
    try:
        return scenario_metadata(padding=rw.HEAD_DIM * rw.BLOCK_SIZE)
    except Exception as exc:  # the release's own refusal is the observation
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


SCENARIOS = {"stand_in": scenario_stand_in, "metadata": scenario_metadata,
             "metadata_padded": scenario_metadata_padded, "hetero_tp": scenario_hetero_tp}
