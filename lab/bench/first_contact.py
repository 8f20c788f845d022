#!/usr/bin/env python
"""Benchmark a decode worker's first contact with a prefill peer, stock vLLM vs pdpatch (issue
24, item 3), on CPU.

First contact is vLLM's ``add_remote_agent`` for the peer (what the handshake thread runs) and
the first READ from it (``start_load_kv`` -> ``_read_blocks``): everything a decode engine's
first request to a new prefill peer waits for besides the wire.  pdpatch adds, on the same
path, per phase:

* ``planning`` -- ``kv_segments`` deciding whether the peer converts (``_plan``);
* ``staging setup`` -- handing the peer's READs to staging: its memory's read ranges
  (``PDPATCH_KV_COALESCE``) and the rows of vLLM's list of it (``mark_converted``; nothing is
  prepared for NIXL there: a READ prepares lists of its own runs);
* ``first READ planning`` -- the staging agent planning its first READ from the peer
  (``ReadPlanner.plan``: the staging buffer, its runs' lists; the local list's rows were read
  at start-up, since a worker that coalesces stages eagerly).

The workers are the release's real ``NixlConnectorWorker`` objects built the way
``tests/test_kv_segments_harness.py`` builds them (real attention-backend layouts, real
``register_kv_caches``), with a NIXL agent that only counts (:class:`LeanNixlWrapper`): the
descriptor lists vLLM and pdpatch build are real, nothing is transferred, and NIXL's own cost
of preparing a list is not in the numbers (vLLM's lists, the same for both; pdpatch's first
READ prepares two more, of its runs).  The KV tensors are allocated, never touched (Linux
maps untouched pages lazily), at a small head size: only the block and layer counts set the
descriptor counts.

Scenarios (``--scenario``):

* ``coalesce`` -- a same-layout pair (FlashAttention on both sides), ``PDPATCH_KV_COALESCE=1``;
* ``converted`` -- a fused-layout P (Triton, ``(N, 2, ...)``) and a split D (FlashAttention,
  ``(2, N, ...)``): converted, fused -> split, READs staged (vLLM 0.19-0.22 only).

vLLM 0.33 runs in process; older releases (``--release``) in a subprocess over their source
trees (``tests/versions_harness.py``).  Each measurement builds a fresh pair (first contact
happens once per worker), stock and pdpatch alternating, best of ``--rounds``.

Run: ``.venv/bin/python -m scripts.bench_first_contact [--release 0.25.1 --release 0.22.1]``
(``--record`` / ``--json PATH``: every round into a raw record, :mod:`lab.bench.record`)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

from lab import cpu_platform
from lab.bench import record
from pdpatch.versions import release_of, vllm_version

REPO = Path(__file__).resolve().parents[2]
# The workers are built with the tests' helpers (robust_worker, test_kv_segments_harness).
sys.path.insert(0, str(REPO / "tests"))

KV_HEADS = 2                  # the tests' model config: 2 KV heads of 64 (bf16)
BLOCK_SIZE = 16
POOL_GIB = 16                 # blocks per layer: a 16 GiB pool of Llama-3-8B's per-layer size
LLAMA_BLOCK_LAYER = 2 * 8 * 128 * 2 * BLOCK_SIZE      # K+V bytes of one block of one layer
REQUEST_BLOCKS = 64           # the first request: a 1024-token prompt, a run of P's blocks
# into D's every other block (a busy D's free blocks lie apart: what coalescing is for)
INSTALLED = str(release_of(vllm_version()))
COALESCE = {"PDPATCH_KV_COALESCE": "1"}
# (P, D) backends of the stock pair and of pdpatch's: stock vLLM refuses the converted pair, so
# its first contact is compared with the same-layout pair's (what a stock deployment runs)
SCENARIOS = {"coalesce": (("FLASH_ATTN", "FLASH_ATTN"), ("FLASH_ATTN", "FLASH_ATTN")),
             "converted": (("FLASH_ATTN", "FLASH_ATTN"), ("TRITON_ATTN", "FLASH_ATTN"))}


def pool_blocks(layers: int) -> int:
    """Blocks per layer of a ``POOL_GIB`` pool at Llama-3-8B's per-layer block size."""
    return (POOL_GIB << 30) // (layers * LLAMA_BLOCK_LAYER)


# --------------------------------------------------------------------------- the workers


def lean_wrapper() -> type:
    """The tests' recording NIXL stand-in, without the per-descriptor copy it keeps of every
    prepared list (which would cost more than vLLM's own code here)."""
    import robust_worker as rw

    class LeanNixlWrapper(rw.RecordingNixlWrapper):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.prepared = 0
            self.posted = 0

        def prep_xfer_dlist(self, agent: Any, descs: Any, *args: Any, **kwargs: Any) -> int:
            self.prepared += 1
            return self._new_handle()

        def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> int:
            self.posted += 1
            return self._new_handle()

        def transfer(self, handle: Any, *args: Any, **kwargs: Any) -> str:
            return "DONE"

    return LeanNixlWrapper


def allocate(backend: type, layers: list[str], blocks: int) -> dict[str, Any]:
    """KV tensors in the backend's physical order (as ``test_kv_segments_harness.allocate``),
    uninitialised."""
    import test_kv_segments_harness as h
    import torch

    physical, inverse = h.physical_order(backend, h.logical_shape(backend, blocks, BLOCK_SIZE,
                                                                  KV_HEADS))
    return {name: torch.empty(physical, dtype=h.DTYPE).permute(*inverse) for name in layers}


def build(engine_id: str, role: str, backend_name: str, layers: int, blocks: int) -> Any:
    """A real worker of the running release, its KV caches registered."""
    import robust_worker as rw
    import test_kv_segments_harness as h
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    cfg = rw.vllm_config("llama", KV_HEADS, role, 1, None)
    cfg.cache_config.block_size = BLOCK_SIZE
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS,
                             head_size=h.HEAD_DIM, dtype=h.DTYPE)
    kvc = rw.kv_cache_config(blocks, names, spec)
    backend = h.backend_class(backend_name)
    with h.runtime(0, 1, backend), set_current_vllm_config(cfg), \
            patch.object(rw.worker_module(), "NixlWrapper", lean_wrapper()), \
            patch("threading.Thread"):
        worker = rw.worker_class()(cfg, engine_id, kvc)
        worker.register_kv_caches(allocate(backend, names, blocks))
    return worker


# ------------------------------------------------------------------------------- timing


class Phases:
    """Wall time spent inside named functions (outermost call only), per first contact."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    @contextlib.contextmanager
    def timing(self, owner: Any, attr: str, phase: str) -> Iterator[None]:
        real = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self.ms[phase] = self.ms.get(phase, 0.0) + (time.perf_counter() - t0) * 1e3

        with patch.object(owner, attr, timed):
            yield


def first_contact(scenario: str, layers: int, blocks: int, patched: bool,
                  profiles: list | None = None) -> dict[str, Any]:
    """One fresh P/D pair: D's ``add_remote_agent`` for P, then D's first READ from P
    (``profiles``: gets a cProfile of each, the handshake's thread and the READ's)."""
    import msgspec
    import robust_worker as rw

    from pdpatch import installer
    from pdpatch.kv.staging.agent import StagingAgent
    from pdpatch.kv.staging.reads import ReadPlanner
    from pdpatch.patches.kv_segments import substitution
    from pdpatch.patches.kv_segments.settings import FIELD

    p_backend, d_backend = SCENARIOS[scenario][patched]
    env = dict(COALESCE) if scenario == "coalesce" and patched else {}
    installer.reset_state()
    with patch.dict(os.environ, env):
        if patched:
            installer.install()
        else:
            installer.uninstall()
        try:
            p = build("prefill", "kv_producer", p_backend, layers, blocks)
            d = build("decode", "kv_consumer", d_backend, layers, blocks)
            meta = rw.own_metadata(p)
            advertised = msgspec.msgpack.decode(
                p.xfer_handshake_metadata.agent_metadata_bytes).get(FIELD)
            phases = Phases()
            with contextlib.ExitStack() as stack:
                for owner, attr, phase in (
                        (substitution, "_plan", "planning"),
                        (substitution, "_coalesce_peer", "staging setup"),
                        (StagingAgent, "mark_converted", "marking"),
                        (ReadPlanner, "plan", "first READ planning")):
                    stack.enter_context(phases.timing(owner, attr, phase))
                timings: dict[str, float] = {}
                connect(d, meta, advertised, timings, profiles)
                time_read(d, timings, profiles)
                req = rw.recv_metadata([{
                    "req_id": "first", "engine": meta.engine_id, "tp_size": 1,
                    "local_ids": [list(range(0, 2 * REQUEST_BLOCKS, 2))],
                    "remote_ids": [list(range(100, 100 + REQUEST_BLOCKS))]}])
                gc.collect()
                with rw.fake_runtime(0, 1):
                    crash = rw.step(d, req)
                    deadline = time.monotonic() + 120
                    while not crash and not posted(d) and time.monotonic() < deadline:
                        time.sleep(0.01)
                        crash = rw.step(d, rw.worker_module_metadata_cls()())
        finally:
            installer.uninstall()
    nixl = d.nixl_wrapper
    agent = nixl if isinstance(nixl, StagingAgent) else None
    if crash or not posted(d):
        raise RuntimeError(f"the first READ was not posted ({crash})")
    ms = phases.ms
    if "marking" in ms and "staging setup" not in ms:   # converted: staging is set up inline
        ms["staging setup"] = ms["marking"]
    ms.pop("marking", None)
    return {"add_remote_agent": timings["add_remote_agent"],
            "first READ": timings["first READ"],
            "phases": ms, "staged": bool(agent and agent.stats.staged_reads),
            "descriptors": descriptor_count(d)}


def profiled(fn: Callable[..., Any], profiles: list | None) -> Callable[..., Any]:
    """``fn``, cProfiled into a new entry of ``profiles`` at each call (None: as it is)."""
    if profiles is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        import cProfile

        prof = cProfile.Profile()
        profiles.append(prof)
        return prof.runcall(fn, *args, **kwargs)

    return run


def connect(d: Any, meta: Any, advertised: Any, timings: dict[str, float],
            profiles: list | None = None) -> None:
    """D's handshake with P resolves to ``add_remote_agent`` (timed) as the real one does once
    it has decoded P's payload (with P's advertised geometry, as pdpatch's handshake reads it),
    without ZMQ -- as ``robust_worker.connect_by_handshake``."""
    import robust_worker as rw
    from packaging.version import Version

    from pdpatch.patches.kv_segments.handshake import handshake_scope

    tuple_keys = rw.version_of() >= Version("0.26")

    def handshake(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        with handshake_scope(d) as hs:
            if advertised is not None:
                hs.advertised[meta.agent_metadata] = advertised
            name = d.add_remote_agent(meta, 0, 1)
        timings["add_remote_agent"] = (time.perf_counter() - t0) * 1e3
        return ({(0, 0): name}, 0.0) if tuple_keys else {0: name}

    d._nixl_handshake = profiled(handshake, profiles)


def time_read(d: Any, timings: dict[str, float], profiles: list | None = None) -> None:
    """Time spent in D's ``_read_blocks_for_req`` (the first READ's, once the handshake is
    done: the call before it only starts the handshake)."""
    real = profiled(d._read_blocks_for_req, profiles)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            timings["first READ"] = (time.perf_counter() - t0) * 1e3

    d._read_blocks_for_req = timed


def posted(d: Any) -> int:
    """READs D posted to NIXL (below any staging agent)."""
    from pdpatch.kv.staging.agent import StagingAgent

    nixl = d.nixl_wrapper
    return (nixl.agent if isinstance(nixl, StagingAgent) else nixl).posted


def descriptor_count(worker: Any) -> int:
    """Descriptors in D's local list (one per block and region, expanded)."""
    return int(worker.num_blocks) * int(worker.num_regions)


def measure(scenario: str, layers: int, blocks: int, rounds: int,
            profile: int = 0) -> dict[str, Any]:
    """Best of ``rounds`` first contacts each way, stock and pdpatch alternating; with
    ``profile``, also a cProfile of one more pdpatch first contact (its ``profile`` top
    functions by own time)."""
    import robust_worker as rw

    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "pdpatch": []}
    for _ in range(rounds):
        for name, patched in (("stock", False), ("pdpatch", True)):
            runs[name].append(first_contact(scenario, layers, blocks, patched))
            gc.collect()
    best = {k: min(v, key=lambda r: r["add_remote_agent"] + r["first READ"])
            for k, v in runs.items()}
    out = {"release": str(rw.version_of()), "scenario": scenario, "layers": layers,
           "blocks": blocks, **best, "rounds": runs}
    if profile:
        import io
        import pstats

        profiles: list = []
        first_contact(scenario, layers, blocks, True, profiles)
        text = io.StringIO()
        pstats.Stats(*profiles, stream=text).sort_stats("tottime").print_stats(profile)
        out["profile"] = text.getvalue()
    return out


# ------------------------------------------------------------------------------- output


def report(res: dict[str, Any]) -> None:
    stock, ours = res["stock"], res["pdpatch"]
    s_total = stock["add_remote_agent"] + stock["first READ"]
    o_total = ours["add_remote_agent"] + ours["first READ"]
    phases = ours["phases"]
    extra = sum(phases.values())
    vllm_add = ours["add_remote_agent"] - phases.get("planning", 0) - \
        phases.get("staging setup", 0)
    print(f"vLLM {res['release']} {res['scenario']}: {res['layers']} layers x {res['blocks']} "
          f"blocks, {stock['descriptors']} local descriptors; best of the rounds, ms")
    print(f"  stock   : add_remote_agent {stock['add_remote_agent']:7.1f} | first READ "
          f"{stock['first READ']:6.1f} | total {s_total:7.1f}")
    print(f"  pdpatch : add_remote_agent {ours['add_remote_agent']:7.1f} (vLLM's own "
          f"{vllm_add:.1f}) | first READ {ours['first READ']:6.1f} | total {o_total:7.1f}"
          f"{'' if ours['staged'] else '  (READ NOT STAGED)'}")
    print("  pdpatch's phases: " + " | ".join(
        f"{k} {phases.get(k, 0):.1f}" for k in ("planning", "staging setup",
                                                "first READ planning"))
          + f" | sum {extra:.1f}")
    print(f"  ratio (stock + pdpatch) / stock: {o_total / s_total:.2f}   pdpatch's phases / "
          f"vLLM's add_remote_agent: {extra / max(vllm_add, 1e-9):.2f}")
    if "profile" in res:
        print(res["profile"])


def run_release(release: str, scenario: str, layers: int, blocks: int,
                rounds: int, profile: int) -> dict[str, Any]:
    if release == INSTALLED:
        return measure(scenario, layers, blocks, rounds, profile)
    from versions_harness import run_in_release

    run = run_in_release(release, f"""
        from lab.bench.first_contact import measure
        emit(measure({scenario!r}, {layers}, {blocks}, {rounds}, {profile}))
    """, timeout=1800)
    return run.check()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--release", action="append",
                    help=f"vLLM release (default {INSTALLED}, in process); repeatable")
    ap.add_argument("--scenario", action="append", choices=sorted(SCENARIOS),
                    help="default: coalesce, and converted on releases before 0.23")
    ap.add_argument("--layers", type=int, action="append", help="default: 32 and 80")
    ap.add_argument("--blocks", type=int, help=f"blocks per layer (default: a {POOL_GIB} GiB "
                    "pool at Llama-3-8B's per-layer block size)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also cProfile one pdpatch first contact; print its top N functions")
    record.add_arguments(ap)
    args = ap.parse_args(argv)
    from packaging.version import Version

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    cpu_platform.apply(os.environ, INSTALLED)   # the installed release's unit code on this CPU
    rec = record.Recorder("first_contact", args, argv)
    results = rec.samples["results"] = []
    for release in args.release or [INSTALLED]:
        scenarios = args.scenario or (["coalesce", "converted"]
                                      if Version(release) < Version("0.23") else ["coalesce"])
        for scenario in scenarios:
            for layers in args.layers or [32, 80]:
                res = run_release(release, scenario, layers, args.blocks or pool_blocks(layers),
                                  args.rounds, args.profile)
                report(res)
                results.append(res)
                rec.derived.update(derived(res))
    rec.finish()
    return 0


def derived(res: dict[str, Any]) -> dict[str, float]:
    """The figures :func:`report` prints of one result, named by its release, scenario and
    layers."""
    stock, ours = res["stock"], res["pdpatch"]
    s_total = stock["add_remote_agent"] + stock["first READ"]
    o_total = ours["add_remote_agent"] + ours["first READ"]
    phases = ours["phases"]
    vllm_add = ours["add_remote_agent"] - phases.get("planning", 0) - \
        phases.get("staging setup", 0)
    case = f"{res['release']} {res['scenario']}, {res['layers']} layers"
    out = {f"{case}: stock ms": s_total, f"{case}: pdpatch ms": o_total,
           f"{case}: pdpatch / stock": o_total / s_total,
           f"{case}: pdpatch's phases ms": sum(phases.values()),
           f"{case}: pdpatch's phases / vLLM's add_remote_agent":
               sum(phases.values()) / max(vllm_add, 1e-9),
           f"{case}: READ staged": float(ours["staged"])}
    out.update({f"{case}: {k} ms": v for k, v in phases.items()})
    return out


if __name__ == "__main__":
    sys.exit(main())
