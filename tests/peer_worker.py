"""Prefill engines that come and go, on the running release's real NIXL decode worker (any
release 0.19-0.34; in process under the installed one, in a subprocess under an older
release's source tree: ``tests/versions_harness.py``).

The worker, its handshake path (``_background_nixl_handshake`` -> ``add_remote_agent``), its
read path, its result collection and, where it has them, its own teardown are the release's
(:mod:`robust_worker`).  The NIXL agent is :class:`DyingNixlWrapper`: the robustness tests'
recording stand-in, which also plays what NIXL 1.5.1 does when a remote agent's process dies
(measured, see ``pdpatch.patches.peer_restart.watch``): every ``transfer`` on its prepared
lists and every notification to it raise NIXL's own ``nixlRemoteDisconnectError``; and what it
does while the agent's process is stopped: a posted READ stays ``PROC``.

A prefill engine's incarnation is an agent name: ``remote_metadata(p, engine, "P1-0")`` gives
``agent_metadata = b"P1-0"``, which the stand-in loads under that name, and whose digest is the
token a P with pdpatch puts in its params (``pdpatch.patches.peer_restart.book.token``).
Scenario functions return JSON-able observations; ``release_report`` runs them stock, then
with pdpatch installed.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any
from unittest.mock import patch

import robust_worker as rw

ENGINE = "prefill-engine"


def disconnect_error() -> BaseException:
    from nixl._bindings import nixlRemoteDisconnectError

    return nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")


class DyingNixlWrapper(rw.RecordingNixlWrapper):
    """The recording stand-in, plus agents that die (``dead``) or stall (``stalled``), and the
    record of what the worker loaded, released and removed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dead: set[str] = set()
        self.stalled: set[str] = set()
        self.loaded: list[str] = []
        self.removed: list[str] = []
        self.released_lists: list[int] = []
        self.released_xfers: list[int] = []
        self.read_agent: dict[int, str] = {}

    def add_remote_agent(self, metadata):
        name = super().add_remote_agent(metadata)
        self.loaded.append(name)
        return name

    def remove_remote_agent(self, agent):
        self.removed.append(agent)

    def check_remote_metadata(self, name, *args, **kwargs):
        return name in self.loaded and name not in self.removed

    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle, *args, **kwargs):
        handle = super().make_prepped_xfer(op, local_handle, local_ids, remote_handle, *args,
                                           **kwargs)
        self.read_agent[handle] = self.dlists.get(int(remote_handle), ("?",))[0]
        self.reads[-1]["agent"] = self.read_agent[handle]
        return handle

    def transfer(self, handle, *args, **kwargs):
        if self.read_agent.get(handle) in self.dead:
            raise disconnect_error()
        return "PROC"

    def check_xfer_state(self, handle):
        agent = self.read_agent.get(handle)
        if agent in self.dead:
            raise disconnect_error()
        return "PROC" if agent in self.stalled else "DONE"

    def send_notif(self, agent, notif_msg=None, *args, **kwargs):
        if agent in self.dead:
            raise disconnect_error()
        return super().send_notif(agent, notif_msg, *args, **kwargs)

    def release_xfer_handle(self, handle):
        self.released_xfers.append(handle)

    def release_dlist_handle(self, handle):
        self.released_lists.append(int(handle))


def agent_of(worker: Any) -> DyingNixlWrapper:
    """The stand-in under whatever proxies pdpatch stacked in front of it."""
    agent = worker.nixl_wrapper
    while not isinstance(agent, DyingNixlWrapper):
        agent = agent._agent
    return agent


def decode_worker(hma: bool = False) -> Any:
    """``hma``: the hybrid full-attention + sliding-window layout (two block-id groups)."""
    with patch.object(rw, "RecordingNixlWrapper", DyingNixlWrapper):
        return rw.build_worker("decode-engine", num_blocks=32, hma=hma, hybrid_manager=hma)


def producer(hma: bool = False) -> Any:
    with patch.object(rw, "RecordingNixlWrapper", DyingNixlWrapper):
        return rw.build_worker(ENGINE, role="kv_producer", num_blocks=40, hma=hma,
                               hybrid_manager=hma)


def incarnation(agent: str, engine: str = ENGINE, **changes: Any) -> dict[int, Any]:
    """Rank 0 of ``engine`` as the agent ``agent`` (its handshake metadata)."""
    return {0: rw.remote_metadata(_P[0], engine, agent, **changes)}


_P: list[Any] = []


def tokens_of(agent: str) -> dict[str, str]:
    """What a P with pdpatch puts in its params for incarnation ``agent``."""
    from pdpatch.patches.peer_restart.book import token

    return {"0:0": token(agent.encode())}


def request(worker: Any, req_id: str, engine: str, blocks: tuple[int, int],
            tokens: dict[str, str] | None, arrival: float | None = None) -> Any:
    """One receive as D's scheduler half hands it to the workers (the release's own
    ``NixlConnectorMetadata``), carrying what pdpatch's scheduler half attaches."""
    from pdpatch import attached
    from pdpatch.patches.peer_restart.book import Incarnation

    groups = len(worker.kv_cache_config.kv_cache_groups)
    meta = rw.recv_metadata([{"req_id": req_id, "engine": engine,
                              "local_ids": [list(blocks)] * groups,
                              "remote_ids": [list(blocks)] * groups,
                              # what P's params carry from 0.33 (its registrations)
                              "params": {"remote_registration_generation": 1}}])
    attached.put(meta.reqs_to_recv[req_id], "peer_restart",
                 Incarnation(tokens, time.time() if arrival is None else arrival))
    return meta


def serve(worker: Any, req_id: str, engine: str, blocks: tuple[int, int],
          tokens: dict[str, str] | None, arrival: float | None = None,
          timeout: float = 10.0) -> dict[str, Any]:
    """Send one request and pump steps until it is reported: ``ok`` (received), ``failed``
    (failed, received with its blocks marked invalid, or -- an HMA model before 0.30 --
    named failed in the step's worker meta) or ``pending``; and the agents its READs went
    to."""
    agent = agent_of(worker)
    before = len(agent.reads)
    crash = rw.step(worker, request(worker, req_id, engine, blocks, tokens, arrival))
    acc, crash2 = rw.run_until(
        worker, lambda a: req_id in set(a["done_recving"]) | set(a["failed_recving"]),
        timeout=timeout)
    invalid = set(acc["invalid_blocks"]) & set(blocks)
    named = req_id in (rw.worker_meta(worker) or ())
    if req_id in acc["failed_recving"] or (req_id in acc["done_recving"] and (invalid or named)):
        outcome = "failed"
    elif req_id in acc["done_recving"]:
        outcome = "ok"
    else:
        outcome = "pending"
    return {"outcome": outcome, "crash": crash or crash2,
            "read_from": sorted({r.get("agent", "?") for r in agent.reads[before:]})}


def held(worker: Any) -> dict[str, Any]:
    """What the worker holds of its prefill peers (the dead-peer count)."""
    from pdpatch import vllm_sites

    own = worker.engine_id
    agents = {e: dict(a) for e, a in worker._remote_agents.items() if a}
    out: dict[str, Any] = {"engines": sorted(agents),
                           "agents": sorted(n for a in agents.values() for n in a.values())}
    for table in ("dst_xfer_side_handles", "kv_caches_base_addr", "dst_num_blocks",
                  "tp_mappings", "_engine_last_active", "_engine_clock_offset",
                  "_engine_by_address", "_tp_size", "_block_size",
                  "_physical_blocks_per_logical", "_remote_registration_generations"):
        found = getattr(worker, table, None)
        if isinstance(found, dict):
            out[table] = len([k for k, v in found.items() if k != own and
                              (v or table not in ("dst_xfer_side_handles",
                                                  "kv_caches_base_addr"))])
    topo = vllm_sites.any_topology(worker)
    engines = getattr(topo, "_engines", None)
    if isinstance(engines, dict):
        out["topology"] = len({k[0] if isinstance(k, tuple) else k for k in engines})
    nixl = agent_of(worker)
    out["nixl_knows"] = sorted(n for n in set(nixl.loaded) if nixl.check_remote_metadata(n))
    out["futures"] = len(worker._handshake_futures)
    return out


def _start(worker: Any, agent: str, engine: str = ENGINE, **changes: Any) -> list:
    return rw.connect_by_handshake(worker, incarnation(agent, engine, **changes), 1)


def scenario_restart(tokens: bool = True, hma: bool = False) -> dict[str, Any]:
    """P serves r1 as incarnation P1; P1 dies and P2 answers under the same engine id and
    address; r2-r4 carry P2's params (with P2's tokens when ``tokens``, i.e. P has pdpatch),
    then r5 carries P1's (a request prefilled before the restart that reached D late).
    Without tokens, r3 reaches D within P's lease of the restart D noticed (at r2), r4 and r4b
    after it (their arrival times say so).  ``hma``: a hybrid model's workers."""
    from pdpatch import vllm_sites

    _P[:] = [producer(hma)]
    d = decode_worker(hma)
    tok = tokens_of if tokens else (lambda _: None)
    later = time.time() + vllm_sites.lease_seconds(d, rw.version_of()) + 1.0
    _start(d, "P1-0")
    out: dict[str, Any] = {"r1": serve(d, "r1", ENGINE, (1, 2), tok("P1-0"))}
    agent_of(d).dead.add("P1-0")
    errors = _start(d, "P2-0")
    with rw.pdpatch_warnings() as warnings:
        for i, req in enumerate(("r2", "r3", "r4", "r4b")):
            arrival = later if req in ("r4", "r4b") and not tokens else None
            out[req] = serve(d, req, ENGINE, (3 + 2 * i, 4 + 2 * i), tok("P2-0"), arrival)
        out["r5_stale"] = serve(d, "r5", ENGINE, (13, 14), tokens_of("P1-0"))
    out.update({"handshake_errors": errors, "held": held(d), "warnings": warnings,
                "removed": list(agent_of(d).removed)})
    return out


def scenario_restart_no_tokens() -> dict[str, Any]:
    return scenario_restart(tokens=False)


def scenario_restart_hma() -> dict[str, Any]:
    return scenario_restart(hma=True)


def scenario_restarts(same_id: bool = True, count: int = 20) -> dict[str, Any]:
    """``count`` incarnations of P at one address, each killed before the next answers (under
    one engine id, or a new one each time: vLLM's default); one request with tokens each, a
    second try where the first failed.  What the worker holds at the end."""
    _P[:] = [producer()]
    d = decode_worker()
    outcomes = []
    for i in range(count):
        engine = ENGINE if same_id else f"{ENGINE}-{i}"
        if i:
            agent_of(d).dead.add(f"P{i - 1}-0")
        _start(d, f"P{i}-0", engine)
        first = serve(d, f"r{i}", engine, (1 + 2 * (i % 8), 2 + 2 * (i % 8)),
                      tokens_of(f"P{i}-0"))
        tries = [first["outcome"]]
        if first["outcome"] != "ok":
            tries.append(serve(d, f"r{i}-again", engine, (17, 18),
                               tokens_of(f"P{i}-0"))["outcome"])
        outcomes.append("/".join(tries))
    return {"outcomes": outcomes, "held": held(d), "loaded": len(agent_of(d).loaded),
            "removed": len(agent_of(d).removed),
            "lists_released": len(agent_of(d).released_lists)}


def scenario_restarts_new_id() -> dict[str, Any]:
    return scenario_restarts(same_id=False)


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    old = os.environ.get("PDPATCH_PEER_DEADLINE_S")
    os.environ["PDPATCH_PEER_DEADLINE_S"] = str(seconds)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PDPATCH_PEER_DEADLINE_S", None)
        else:
            os.environ["PDPATCH_PEER_DEADLINE_S"] = old


def scenario_stall() -> dict[str, Any]:
    """P's process is stopped with r1's READ posted (it stays ``PROC``), for longer than the
    peer deadline (1 s here); then it runs again and r2 is sent."""
    _P[:] = [producer()]
    d = decode_worker()
    _start(d, "P1-0")
    warm = serve(d, "r0", ENGINE, (1, 2), tokens_of("P1-0"))
    agent_of(d).stalled.add("P1-0")
    with deadline(1), rw.pdpatch_warnings() as warnings:
        t0 = time.monotonic()
        during = serve(d, "r1", ENGINE, (3, 4), tokens_of("P1-0"), timeout=4.0)
        during["ended_after_s"] = round(time.monotonic() - t0, 2)
        released = list(agent_of(d).released_xfers)
        agent_of(d).stalled.clear()
        after = serve(d, "r2", ENGINE, (5, 6), tokens_of("P1-0"))
    return {"warm": warm, "during": during, "released": released, "after": after,
            "warnings": warnings, "held": held(d)}


def scenario_handshake_stall() -> dict[str, Any]:
    """P's side channel answers r1's handshake only after 3 s (a stopped or partitioned P; NIXL's
    ``loadRemoteMD`` has no timeout of its own), longer than the peer deadline (1 s here):
    whether r1 ends before the handshake does, and whether it is READ once it completes."""
    _P[:] = [producer()]
    d = decode_worker()
    _start(d, "P1-0")
    scripted = d._nixl_handshake

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(3.0)
        return scripted(*args, **kwargs)

    d._nixl_handshake = slow
    with deadline(1), rw.pdpatch_warnings() as warnings:
        t0 = time.monotonic()
        r1 = serve(d, "r1", ENGINE, (1, 2), tokens_of("P1-0"), timeout=6.0)
        r1["ended_after_s"] = round(time.monotonic() - t0, 2)
        rw.run_until(d, lambda a: False, timeout=3.0)        # the handshake completes
        r1["read_from_after"] = sorted({r.get("agent", "?") for r in agent_of(d).reads})
        r2 = serve(d, "r2", ENGINE, (3, 4), tokens_of("P1-0"))
    return {"r1": r1, "r2": r2, "warnings": warnings}


def scenario_geometry() -> dict[str, Any]:
    """P comes back under the same engine id with another KV layout (token-major where the
    decode worker is head-major), which the release's own handshake validation refuses: no
    READ may use the old incarnation's geometry, nor the new one's."""
    from pdpatch import vllm_sites

    _P[:] = [producer()]
    d = decode_worker()
    _start(d, "P1-0")
    r1 = serve(d, "r1", ENGINE, (1, 2), tokens_of("P1-0"))
    agent_of(d).dead.add("P1-0")
    token_major, _ = vllm_sites.layout_names(rw.version_of())
    errors = _start(d, "P2-0", kv_cache_layout=token_major)
    with rw.pdpatch_warnings() as warnings:
        r2 = serve(d, "r2", ENGINE, (3, 4), tokens_of("P2-0"))
        r3 = serve(d, "r3", ENGINE, (5, 6), tokens_of("P2-0"))
    return {"r1": r1, "r2": r2, "r3": r3, "handshake_errors": errors, "warnings": warnings,
            "held": held(d)}


SCENARIOS = {
    "restart": scenario_restart,
    "restart_no_tokens": scenario_restart_no_tokens,
    "restart_hma": scenario_restart_hma,
    "restarts": scenario_restarts,
    "restarts_new_id": scenario_restarts_new_id,
    "stall": scenario_stall,
    "handshake_stall": scenario_handshake_stall,
    "geometry": scenario_geometry,
}


def release_report(names: list[str]) -> dict[str, Any]:
    """``names`` on stock vLLM, then with pdpatch installed; a scenario that cannot run is
    ``{"error": ...}``."""
    return rw.stock_then_patched(SCENARIOS, names)
