"""Version matrix for the kvcached-compatibility patches: the same checks against the real source
of each vLLM release.

``run(version)`` starts ``python tests/kvc_matrix.py VERSION`` with ``PYTHONPATH`` pointing at the
release's source tree (``scripts/fetch_vllm_sources.sh`` puts them under
``~/.cache/pdpatch/vllm-src/<ver>``; it shadows the installed package, whose compiled parts
are not needed on CPU).  The child reports ``pdpatch.versions.vllm_version()`` as that release (the
metadata would say the venv's), builds real NIXL workers of that release with
:mod:`kvc_harness`, and prints one JSON object: check name -> "ok" | "skip: why" | "FAIL: why".

What each release cannot import with today's dependencies is said in the result, never hidden:
0.19-0.22 need the ``gguf`` package (found in ``PDLAB_OLD_VLLM_DEPS``, default
``~/.cache/pdpatch/old-vllm-deps``, if the test environment lacks it).

``--kvcached ORDER`` additionally applies kvcached 0.1.6's *real* NixlConnector patch
(``kvcached/integration/vllm/nixl_compat.py``, pure Python; ``PDLAB_KVCACHED_SRC`` or
``~/.cache/pdpatch/kvcached-src/0.1.6``) before (``kvcached-first``) or after (``pdpatch-first``)
pdpatch, in its own process because kvcached patches classes for good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from pdpatch.versions import release_of, vllm_version

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("PDLAB_CACHE_DIR", Path.home() / ".cache" / "pdpatch"))
SOURCES = Path(os.environ.get("PDLAB_VLLM_SOURCES", CACHE / "vllm-src"))
OLD_DEPS = Path(os.environ.get("PDLAB_OLD_VLLM_DEPS", CACHE / "old-vllm-deps"))
KVCACHED_SRC = Path(os.environ.get("PDLAB_KVCACHED_SRC", CACHE / "kvcached-src" / "0.1.6"))
INSTALLED = str(release_of(vllm_version()))
NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PLANNED, VIRTUAL = 12, 29


def source_tree(version: str) -> Path | None:
    if version == INSTALLED:
        return None
    tree = SOURCES / version
    return tree if (tree / "vllm").is_dir() else None


def kvcached_available() -> bool:
    return (KVCACHED_SRC / "kvcached" / "integration" / "vllm" / "nixl_compat.py").is_file()


def run(version: str, kvcached_order: str | None = None, timeout: int = 600) -> dict[str, str]:
    """The checks for one release, in a child interpreter; raises if the child died."""
    path = [str(HERE)]
    tree = source_tree(version)
    if version != INSTALLED:
        if tree is None:
            return {"source": f"skip: no source tree for vLLM {version} under {SOURCES} "
                              f"(scripts/fetch_vllm_sources.sh)"}
        path.insert(0, str(tree))
        if OLD_DEPS.is_dir():
            path.append(str(OLD_DEPS))
    if kvcached_order:
        path.append(str(KVCACHED_SRC))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PDPATCH_") and k not in ("ENABLE_PDPATCH", "PYTHONPATH")}
    env.update(PYTHONPATH=os.pathsep.join(path), VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               ENABLE_KVCACHED="true", KVCACHED_CONTIGUOUS_LAYOUT="false")
    from lab import cpu_platform  # here, not at the top: the child has no checkout root

    cpu_platform.apply(env, version)
    if version != INSTALLED:
        # the release's own vLLM cache: a model-info entry another release wrote is stale
        # here and costs a model-inspecting subprocess (~9 s of CPU)
        from versions_harness import vllm_cache_root

        env["VLLM_CACHE_ROOT"] = str(vllm_cache_root(version))
    cmd = [sys.executable, str(Path(__file__).resolve()), version]
    if kvcached_order:
        cmd += ["--kvcached", kvcached_order]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"matrix child for vLLM {version} exited {out.returncode}:\n"
                           f"{out.stderr[-4000:]}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------------- in the child


def _main(version: str, kvcached_order: str | None) -> dict[str, str]:
    from packaging.version import Version

    from pdpatch import versions

    v = Version(version)
    versions.vllm_version = lambda: v          # metadata says the venv's; the code is `version`
    import kvc_harness as h

    h.ensure_cpu_platform()
    import vllm

    results: dict[str, str] = {}
    assert vllm.__file__ and (source_tree(version) is None or
                              str(source_tree(version)) in vllm.__file__), vllm.__file__

    def check(name: str, fn: Callable[[], str | None]) -> None:
        try:
            note = fn()
            results[name] = "ok" + (f": {note}" if note else "")
        except _Skip as skip:
            results[name] = f"skip: {skip}"
        except Exception as exc:
            results[name] = f"FAIL: {type(exc).__name__}: {exc}"[:600]
            traceback.print_exc()

    from pdpatch import block_counts, installer, vllm_sites
    from pdpatch.patches.num_blocks import wrappers as num_blocks

    token_major, head_major = vllm_sites.layout_names(v)
    variants = h.variants_for(v)

    if kvcached_order == "kvcached-first":
        _apply_kvcached()
        check("kvcached_layout_patch_alone", lambda: _kvcached_layout(h, pdpatch=False))

        def alone():
            try:
                h.register(h.kvcached_views(NAMES, VIRTUAL, variants[0]), PLANNED, v)
            except AssertionError as exc:
                return f"kvcached's own patch alone: {str(exc)[:100]}"
            raise AssertionError("kvcached's patch alone registered the views")

        check("kvcached_patch_alone_refused", alone)
    # ---------------------------------------------------------------- stock behaviour
    stock_under = None if kvcached_order else _under_outcome(h, v, variants[0])
    if not kvcached_order:
        for variant in variants:
            def stock(variant=variant):
                try:
                    h.register(h.kvcached_views(NAMES, VIRTUAL, variant), PLANNED, v)
                except AssertionError as exc:       # every release's block-count check
                    return f"stock vLLM refuses: {str(exc)[:100]}"
                raise AssertionError("stock vLLM registered over-allocated views")
            check(f"stock_rejects_over_allocation[{variant}]", stock)

    if not kvcached_order and versions.release_of(v) < Version("0.20"):
        def stock_hetero():
            try:
                _hetero_tp(v, h)
            except AssertionError as exc:
                if "was accepted" in str(exc):
                    return "stock 0.19 accepts the head split on NHD (silent corruption)"
                raise
            raise AssertionError("stock 0.19 already refuses it")

        check("stock_accepts_hetero_tp_token_major", stock_hetero)

    installer.install()
    if kvcached_order == "pdpatch-first":
        _apply_kvcached()
    state = installer.status()["patches"]
    check("installed", lambda: _installed(state))

    # ------------------------------------------------------------------- num_blocks
    for variant in variants:
        regs: dict[str, h.Registered] = {}

        def sliced(variant=variant, regs=regs):
            alloc = h.kvcached_views(NAMES, VIRTUAL, variant)
            with h.kvcached_running(VIRTUAL):
                reg = h.register(alloc, PLANNED, v)
            regs["reg"] = reg
            adv = num_blocks.advertised(reg.worker)
            assert adv["num_blocks"] == PLANNED, adv
            assert set(adv["region_num_blocks"]) <= {PLANNED}, adv
            registered = h.registered_bytes(reg.nixl)
            assert registered == h.planned_bytes(alloc, PLANNED), "registered bytes != plan"
            h.check_descs_resolve(h.local_descs(reg), h.region_counts(reg.worker), alloc,
                                  PLANNED, registered)
            return num_blocks.status_line(installer.state_of(num_blocks.NAME))

        check(f"over_allocated_registers_the_plan[{variant}]", sliced)

        def peer(variant=variant, regs=regs):
            if "reg" not in regs:
                raise _Skip("registration failed")
            reg = regs["reg"]
            with h.kvcached_running(10):            # the peer: kvcached memory, exactly planned
                other = h.register(h.kvcached_views(NAMES, 10, variant), 10, v,
                                   engine_id="peer")
            meta = h.decoded_metadata(reg.worker)
            remote = h.peer_remote_descs(other, meta, v)
            # <= 0.29 advertise one count; blocks-first releases split each region into a K
            # pass and a V pass ("virtual" regions), so count regions from the descriptors.
            counts = list(getattr(meta, "region_num_blocks", None) or []) or \
                [meta.num_blocks] * (len(remote) // meta.num_blocks)
            h.check_descs_resolve(remote, counts, reg.alloc, PLANNED,
                                  h.registered_bytes(reg.nixl))

        check(f"peer_descriptors_resolve[{variant}]", peer)

    def under():
        try:
            with h.kvcached_running(PLANNED - 4):
                h.register(h.kvcached_views(NAMES, PLANNED - 4, variants[0]), PLANNED, v)
        except block_counts.UnderAllocatedError as exc:
            assert "fewer blocks than the engine planned" in str(exc)
            return None
        raise AssertionError("under-allocated views were registered")

    check("under_allocated_fails_clearly", under)
    if not kvcached_order:
        def under_without_kvcached():
            got = _under_outcome(h, v, variants[0])
            assert got == stock_under, {"stock": stock_under, "pdpatch": got}
            return got

        check("under_allocated_without_kvcached_is_the_releases_own", under_without_kvcached)
    if kvcached_order:
        check("layout_with_kvcached_patch", lambda: _kvcached_layout(h, pdpatch=True))

        def in_charge():
            line = num_blocks.status_line(installer.state_of(num_blocks.NAME))
            assert line == "num_blocks=pdpatch+kvcached-patch-neutralized", line
            return line

        check("pdpatch_in_charge", in_charge)
        return results

    # ----------------------------------------------------------------------- layout
    check("layout_classmethod", lambda: _layout_classmethod(v, h, token_major, head_major))
    check("layout_in_force", lambda: _layout_in_force(v, h, token_major, head_major))
    check("layout_forced_failure_names_component",
          lambda: _layout_failure(v, h, token_major, head_major))
    if versions.release_of(v) < Version("0.20"):
        check("hetero_tp_token_major_rejected", lambda: _hetero_tp(v, h))
    installer.reset_state()
    return results


class _Skip(Exception):
    pass


def _installed(state: dict) -> str:
    for name in ("layout", "num_blocks"):
        ps = state[name]
        assert ps["status"] == "active", (name, ps)
    return "; ".join(f"{n}: {', '.join(t.split(':')[-1] for t in state[n]['targets'])}"
                     for n in ("layout", "num_blocks"))


def _apply_kvcached() -> None:
    os.environ["ENABLE_KVCACHED"] = "true"
    from kvcached.integration.vllm.nixl_compat import NixlConnectorPatch

    assert NixlConnectorPatch().patch_connector()


def _kvcached_layout(h, pdpatch: bool) -> str:
    """EngineCore resolution for the pull and the push connector with kvcached's own layout
    patch applied (it replaces the method on the ``NixlConnector`` alias = the pull class).
    kvcached's runtime state is stood in under its module name (its interfaces need CUDA)."""
    import types

    from vllm.v1.engine import core

    from pdpatch import kvcached

    mod = types.ModuleType(kvcached.INTERFACES_MODULE)
    mod._kvcached_initialized, mod._is_worker = True, False
    mod._contiguous_layout, mod._created_kv_tensor_capacity = False, {}
    sys.modules[kvcached.INTERFACES_MODULE] = mod
    try:
        got = {}
        for name in ("NixlConnector", "NixlPushConnector"):
            role = "kv_producer" if name == "NixlPushConnector" else "kv_consumer"
            cfg = h.vllm_config(layout=None, kv_connector=name, kv_role=role)
            got[name] = core.resolve_kv_cache_layout(cfg, [["LBNHC", "LBHNC"]], []).name
    finally:
        del sys.modules[kvcached.INTERFACES_MODULE]
    want = ({"NixlConnector": "LBNHC", "NixlPushConnector": "LBNHC"} if pdpatch
            else {"NixlConnector": "LBNHC", "NixlPushConnector": "LBHNC"})
    assert got == want, got
    return f"{got}" + ("" if pdpatch else " (kvcached alone misses the push connector)")


def _connector_classes(v) -> list[type]:
    import importlib

    from pdpatch import vllm_sites

    site = vllm_sites.lookup(vllm_sites.REQUIRED_KV_LAYOUT, v)
    mod = importlib.import_module(site.module)
    names = ["NixlConnector", "NixlPullConnector", "NixlPushConnector"]
    return [getattr(mod, n) for n in names if hasattr(mod, n)]


def _layout_classmethod(v, h, token_major: str, head_major: str) -> str:
    forced = h.vllm_config(layout=None, extra={"pdpatch": {"layout_force": True}})
    plain = h.vllm_config(layout=None)
    seen = []
    for cls in _connector_classes(v):
        assert cls.get_required_kvcache_layout(forced) == token_major, cls
        assert cls.get_required_kvcache_layout(plain) == head_major, cls
        seen.append(cls.__name__)
    return f"{'/'.join(seen)} -> {token_major} forced, {head_major} otherwise"


def _layout_in_force(v, h, token_major: str, head_major: str) -> str:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import utils

    from pdpatch import installer

    forced = h.vllm_config(layout=None, extra={"pdpatch": {"layout_force": True}})
    plain = h.vllm_config(layout=None)
    if hasattr(utils, "resolve_kv_cache_layout"):           # >= 0.29, EngineCore
        from vllm.v1.engine import core

        cands = [[token_major, head_major]]
        assert core.resolve_kv_cache_layout(forced, cands, []).name == token_major
        assert core.resolve_kv_cache_layout(plain, cands, []).name == head_major
        return f"EngineCore resolve_kv_cache_layout: {token_major} / {head_major}"
    got = {}
    for label, cfg in (("forced", forced), ("plain", plain)):
        installer.reset_state()
        utils.get_kv_cache_layout.cache_clear()
        with set_current_vllm_config(cfg):
            got[label] = utils.get_kv_cache_layout()
    utils.get_kv_cache_layout.cache_clear()
    assert got == {"forced": token_major, "plain": head_major}, got
    return f"worker get_kv_cache_layout: {got}"


def _layout_failure(v, h, token_major: str, head_major: str) -> str:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends import utils

    from pdpatch import installer
    from pdpatch.patches.layout import wrappers as layout

    forced = h.vllm_config(layout=None, extra={"pdpatch": {"layout_force": True}})
    installer.reset_state()
    try:
        if hasattr(utils, "resolve_kv_cache_layout"):
            utils.resolve_kv_cache_layout(forced, [[head_major]], [])
        else:
            utils.set_kv_cache_layout(head_major)    # what a head-major-only backend does
            try:
                with set_current_vllm_config(forced):
                    utils.get_kv_cache_layout()
            finally:
                utils.set_kv_cache_layout(None)
    except layout.LayoutForcedError as exc:
        assert "attention backend" in str(exc), exc
        return str(exc)[:160]
    raise AssertionError("a head-major-only attention backend was not reported")


def _under_outcome(h, v, variant: str) -> str:
    """What registering views with fewer blocks than planned does, without kvcached running:
    the release's own answer (its refusal, or what it registers)."""
    try:
        reg = h.register(h.kvcached_views(NAMES, PLANNED - 4, variant), PLANNED, v)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return f"registered {sorted(int(d[1]) for descs in reg.nixl.registered for d in descs)}"


def _hetero_tp(v, h) -> str:
    """0.19: a decode engine with TP 2 reading a TP-1 prefill splits heads; on a token-major
    layout 0.19 slices blocks as if head-major.  vLLM's own validation passes; pdpatch's guard
    must refuse the handshake."""
    import dataclasses

    local = h.register(h.kvcached_views(NAMES, PLANNED, "split-half"), PLANNED, v,
                       engine_id="decode", tp_size=2)
    local.worker.kv_cache_layout = "NHD"          # what the layout override yields on 0.19
    prefill = h.register(h.kvcached_views(NAMES, PLANNED, "split-half"), PLANNED, v,
                         engine_id="prefill")
    meta = h.decoded_metadata(prefill.worker)
    meta = dataclasses.replace(meta, kv_cache_layout="NHD",
                               block_lens=[2 * b for b in meta.block_lens])
    try:
        with h.fake_runtime(v, tp_size=2):
            local.worker.add_remote_agent(meta, 0, 1)
    except RuntimeError as exc:
        assert "heterogeneous TP (ratio 2)" in str(exc), exc
        return str(exc)[:140]
    raise AssertionError("hetero-TP head split on NHD was accepted")


if __name__ == "__main__":
    order = sys.argv[sys.argv.index("--kvcached") + 1] if "--kvcached" in sys.argv else None
    out = _main(sys.argv[1], order)
    print(json.dumps(out))
