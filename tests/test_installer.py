"""install()/uninstall() against real vLLM 0.33 classes: wrapping, restoring, gates, kvcached."""

from __future__ import annotations

import importlib

import pytest
import wrapt

from pdpatch import patches
from pdpatch.registry import Patch, Target

PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"


def pull_cls():
    return importlib.import_module(PULL).NixlPullConnectorWorker


def read_attr():
    return pull_cls().__dict__["_read_blocks_for_req"]


def test_install_wraps_and_uninstall_restores_the_exact_original(fresh_pdpatch, monkeypatch):
    original = read_attr()
    monkeypatch.setenv("ENABLE_PDPATCH", "1")
    states = fresh_pdpatch.install()
    assert states["read_guard"].status == "active"
    wrapped = read_attr()
    assert isinstance(wrapped, wrapt.FunctionWrapper)
    inner = wrapped                                  # block_ids_bound and read_guard wrap it
    while isinstance(inner, wrapt.FunctionWrapper):
        inner = inner.__wrapped__
    assert inner is original
    assert fresh_pdpatch.install() is states          # idempotent: nothing re-wrapped
    assert read_attr() is wrapped
    fresh_pdpatch.uninstall()
    assert read_attr() is original


def test_install_reapplied_after_uninstall_wraps_once(fresh_pdpatch):
    original = read_attr()
    fresh_pdpatch.install()
    fresh_pdpatch.uninstall()
    fresh_pdpatch.install()
    chain = list(wrapt.wrapper_chain(read_attr()))
    # Once per patch that wraps the read path here: peer_restart, block_ids_bound, lease_guard,
    # read_guard.
    assert len([w for w in chain if isinstance(w, wrapt.FunctionWrapper)]) == 4
    fresh_pdpatch.uninstall()
    assert read_attr() is original


def test_wraps_names_only_a_live_wrapper_of_that_patch(fresh_pdpatch, monkeypatch):
    """``installer.wraps``: what read_guard asks before it hands an HMA request to
    hma_failed_recv's channel; a subclass of the wrapped class counts, an uninstalled or
    skipped patch does not."""
    worker = pull_cls()
    assert not fresh_pdpatch.wraps("read_guard", worker, "_read_blocks_for_req")
    monkeypatch.setenv("PDPATCH_LEASE_GUARD", "0")
    fresh_pdpatch.install()
    assert fresh_pdpatch.wraps("read_guard", worker, "_read_blocks_for_req")
    assert fresh_pdpatch.wraps("read_guard", type("Sub", (worker,), {}), "_read_blocks_for_req")
    assert not fresh_pdpatch.wraps("read_guard", worker, "start_load_kv")
    assert not fresh_pdpatch.wraps("lease_guard", worker, "_read_blocks_for_req")    # skipped
    fresh_pdpatch.uninstall()
    assert not fresh_pdpatch.wraps("read_guard", worker, "_read_blocks_for_req")


def test_toggle_off_skips_with_reason(fresh_pdpatch, monkeypatch):
    monkeypatch.setenv("PDPATCH_READ_GUARD", "0")
    monkeypatch.setenv("PDPATCH_BLOCK_IDS_BOUND", "0")      # the read path's other wrappers
    monkeypatch.setenv("PDPATCH_LEASE_GUARD", "0")
    monkeypatch.setenv("PDPATCH_PEER_RESTART", "0")
    original = read_attr()
    states = fresh_pdpatch.install()
    assert states["read_guard"].status == "skipped"
    assert "PDPATCH_READ_GUARD=0" in states["read_guard"].reason
    assert read_attr() is original
    line = fresh_pdpatch.summary_line()
    assert "read_guard (toggled off (PDPATCH_READ_GUARD=0))" in line.split("skipped=[")[1]
    assert "read_guard" not in line.split("ready=[")[1].split("]")[0]


def test_summary_line_calls_a_patch_ready_before_vllm_imports_its_module(
        fresh_pdpatch, monkeypatch):
    """A target whose module this process has not imported is wrapped when it is: the patch is
    ready, and ``status()`` shows the target still waiting (armed)."""
    never = Patch(name="never", summary="test", versions=">=0.1",
                  targets=lambda v: [Target("vllm.no_such_module", "f",
                                            lambda w, i, a, k: w(*a, **k))])
    from pdpatch.patches import read_guard

    monkeypatch.setattr(patches, "all_patches", lambda: [never, read_guard.PATCH])
    importlib.import_module(PULL)                 # read_guard's module is already imported
    fresh_pdpatch.install()
    line = fresh_pdpatch.summary_line()
    assert "ready=[never, read_guard] skipped=[]" in line, line
    assert fresh_pdpatch.status()["patches"]["never"]["targets"] == {
        "vllm.no_such_module:f": ("armed", "")}


def _inherited_target_patch() -> Patch:
    # NixlPullConnectorWorker inherits register_kv_caches from NixlBaseConnectorWorker:
    # wrapping it on the subclass would miss the push worker, so the installer refuses.
    return Patch(name="bad_target", summary="test", versions=">=0.1",
                 targets=lambda v: [Target(PULL, "NixlPullConnectorWorker.register_kv_caches",
                                           lambda w, i, a, k: w(*a, **k))])


def test_target_on_a_subclass_that_only_inherits_is_refused(fresh_pdpatch, monkeypatch):
    monkeypatch.setattr(patches, "all_patches", lambda: [_inherited_target_patch()])
    states = fresh_pdpatch.install()
    (ts,) = states["bad_target"].targets
    assert ts.status == "failed"
    assert "inherited from NixlBaseConnectorWorker" in ts.detail
    assert "register_kv_caches" not in pull_cls().__dict__
    line = fresh_pdpatch.summary_line()
    assert f"ready=[] failed=[bad_target ({ts.target.label}: LookupError: " in line, line


def test_strict_mode_turns_a_failed_target_into_an_error(fresh_pdpatch, monkeypatch):
    monkeypatch.setattr(patches, "all_patches", lambda: [_inherited_target_patch()])
    monkeypatch.setenv("PDPATCH_STRICT", "1")
    with pytest.raises(fresh_pdpatch.StrictModeError, match="inherited from"):
        fresh_pdpatch.install()


def _kvcached_style_setattr(cls, name):
    """What kvcached's nixl_compat does: save the live attribute, install a plain function."""
    saved = cls.__dict__[name]
    calls = []

    def replacement(self, *args, **kwargs):
        calls.append(args)
        return saved.__get__(self, cls)(*args, **kwargs)

    setattr(cls, f"_kvcached_original_{name}", saved)
    setattr(cls, name, replacement)
    return saved, calls


class _Worker:
    """A stand-in instance: the guarded method only needs failure bookkeeping attributes."""

    def __init__(self):
        self.failed = []
        self._recv_failures = set()

    def _handle_failed_transfer(self, req_id, handle, failures, record_failed_transfer=True):
        failures.add(req_id)
        self.failed.append(req_id)
        return True


def _bound_read(cls, worker):
    """``self._read_blocks_for_req`` as vLLM calls it, on a stand-in instance."""
    return cls.__dict__["_read_blocks_for_req"].__get__(worker, cls)


def _raise_in_read(cls, monkeypatch):
    def boom(self, req_id, meta):
        raise AssertionError("num_local_blocks <= len(remote)")

    monkeypatch.setattr(cls, "_read_blocks_for_req", boom)
    return boom


@pytest.mark.parametrize("order", ["kvcached_first", "pdpatch_first"])
def test_coexists_with_kvcached_style_setattr(fresh_pdpatch, monkeypatch, order):
    cls = pull_cls()
    boom = _raise_in_read(cls, monkeypatch)
    if order == "kvcached_first":
        _, calls = _kvcached_style_setattr(cls, "_read_blocks_for_req")
        fresh_pdpatch.install()
    else:
        fresh_pdpatch.install()
        _, calls = _kvcached_style_setattr(cls, "_read_blocks_for_req")
    worker = _Worker()
    assert _bound_read(cls, worker)("req-1", None) is None   # contained, not raised
    assert worker.failed == ["req-1"] and len(calls) == 1
    fresh_pdpatch.uninstall()
    if order == "kvcached_first":
        assert cls.__dict__["_read_blocks_for_req"].__name__ == "replacement"
    else:
        # Buried under a plain function wrapt cannot splice: left in place as a pass-through.
        status = fresh_pdpatch.status()["patches"]["read_guard"]["targets"]
        assert next(iter(status.values()))[0] == "disabled"
    with pytest.raises(AssertionError, match="num_local_blocks"):
        _bound_read(cls, _Worker())("req-2", None)
    monkeypatch.setattr(cls, "_read_blocks_for_req", boom)


def test_summary_line_says_who_reconciles_block_counts_when_kvcached_is_loaded(
        fresh_pdpatch, monkeypatch):
    import sys
    import types

    from pdpatch import kvcached

    assert "notes=[" not in (fresh_pdpatch.install() and fresh_pdpatch.summary_line())
    fresh_pdpatch.uninstall()
    iface = types.ModuleType(kvcached.INTERFACES_MODULE)   # kvcached's module globals, as
    iface._kvcached_initialized = True                      # init_kvcached() leaves them
    iface._is_worker = True
    iface._contiguous_layout = False
    iface._created_kv_tensor_capacity = {0: {"num_blocks": 29}}
    monkeypatch.setitem(sys.modules, kvcached.INTERFACES_MODULE, iface)
    fresh_pdpatch.install()
    assert ("notes=[kvcached initialised (worker, non-contiguous layout; group 0: 29 virtual "
            "blocks); block-count reconciliation by pdpatch]") in fresh_pdpatch.summary_line()
    fresh_pdpatch.uninstall()
    monkeypatch.setenv("PDPATCH_NUM_BLOCKS", "0")
    fresh_pdpatch.install()
    assert "reconciliation by kvcached's own patch" in fresh_pdpatch.summary_line()


# ------------------------------------------------------------------ who owns a patch's state


def test_every_patch_state_is_made_on_first_use_and_replaced_by_one_reset(fresh_pdpatch,
                                                                           monkeypatch):
    """One answer to "where does a patch keep its state, and how is it reset?": the ``State``
    its ``Patch`` declares (named lazily in its wrappers module, or the base class), made on
    first use, counted in counters(), replaced by reset_state() -- for every patch, under the
    one spelling of its name (``NAME``)."""
    import dataclasses
    import sys

    from pdpatch.registry import Lazy
    from pdpatch.state import State

    monkeypatch.setenv("ENABLE_PDPATCH", "1")
    fresh_pdpatch.install()
    modules = [m for n, m in list(sys.modules.items())
               if n.startswith("pdpatch.patches.") and hasattr(m, "PATCH")]
    assert sorted(m.NAME for m in modules) == sorted(m.PATCH.name for m in modules) \
        == sorted(patches.patch_names())
    made = {}
    for patch in patches.all_patches():
        state = fresh_pdpatch.state_of(patch.name)
        kind = patch.state.resolve() if isinstance(patch.state, Lazy) else patch.state
        assert type(state) is kind and isinstance(state, State)
        made[patch.name] = state
        for f in dataclasses.fields(state):
            if "pdpatch_counter" in f.metadata:
                state.bump(f.name, label="x" if isinstance(getattr(state, f.name), dict)
                           else None)
    counted = fresh_pdpatch.counters()
    assert counted and all(c.value == 1 for c in counted if c.name in {
        f"{n}_{f.name}" for n, s in made.items() for f in dataclasses.fields(s)})
    assert {"block_keys_mismatched", "kv_segments_advertised",
            "pdpatch:failures_contained_total", "pdpatch:refusals_total",
            "pdpatch:peers_converted_total"} <= {c.name for c in counted}
    fresh_pdpatch.reset_state()
    for name, old in made.items():
        assert type(fresh_pdpatch.state_of(name)) is type(old)
        assert fresh_pdpatch.state_of(name) is not old
    assert all(c.value == 0 for c in fresh_pdpatch.counters())


# Every name pdpatch can give to something on another's object, and why it may: what pdpatch
# keeps on a vLLM object lives under pdpatch.attached.ATTR only; the rest is protocol (keys
# that travel to the peer) or belongs to pdpatch's own objects.
PDPATCH_NAMES = {
    "_pdpatch": "pdpatch.attached.ATTR: the one attribute on vLLM objects",
    "_self_pdpatch_patch": "on pdpatch's own wrapt wrapper (installer)",
    "_pdpatch_handler": "on pdpatch's own log handler (log)",
    "_pdpatch_base": "on pdpatch's own payload subclass (kv_segments.handshake)",
    "pdpatch_kv_geometry": "protocol: P's handshake metadata field",
    "pdpatch_block_keys": "protocol: the kv_transfer_params entry P sends",
    "pdpatch_kv_lease_expiry": "protocol: the kv_transfer_params entry P sends (lease_guard)",
    "pdpatch_p_incarnation": "protocol: the kv_transfer_params entry P sends (peer_restart)",
    "_pdpatch_block_keys": "D's verdict memo inside the params it judged (block_keys)",
    "pdpatch_counter": "dataclass field metadata (pdpatch.state)",
    "pdpatch_label": "dataclass field metadata (pdpatch.state)",
    "pdpatch_autoload": "the .pth file's name",
    "pdpatch_bootstrap": "the installed sitecustomize directory's name",
}


def test_only_the_attached_helper_keeps_pdpatch_data_on_vllm_objects():
    """No module stashes data on vLLM objects under names of its own: every pdpatch-ish name
    in the package (identifier or string) is one of :data:`PDPATCH_NAMES`, and only
    pdpatch/attached.py names the attribute; no patch keeps module-global state; the KV core
    (pdpatch/kv/) imports nothing of the patches (their proxy stack included)."""
    import ast
    import re
    from pathlib import Path

    import pdpatch
    from pdpatch import attached

    root = Path(pdpatch.__file__).parent
    pattern = re.compile(r"^_*(self_)?pdpatch(_\w*)?$")
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        rel = str(path.relative_to(root))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.append(node.value)
            elif isinstance(node, ast.Attribute):
                names.append(node.attr)
            elif isinstance(node, ast.ImportFrom) and rel.startswith("kv/"):
                assert not (node.module or "").startswith(
                    ("pdpatch.patches", "pdpatch.agent_layers", "pdpatch.installer")), rel
            elif isinstance(node, ast.Global) and rel.startswith("patches"):
                pytest.fail(f"{rel}: `global {', '.join(node.names)}` (a patch's state "
                            "belongs in its State)")
            for name in names:
                if pattern.match(name) and name != "pdpatch":
                    found.setdefault(name, set()).add(rel)
    assert set(found) <= set(PDPATCH_NAMES), {n: found[n] for n in set(found) - set(PDPATCH_NAMES)}
    assert found[attached.ATTR] == {"attached.py"}
