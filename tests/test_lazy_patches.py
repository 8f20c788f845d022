"""A patch's code loads when vLLM imports the module it wraps, not inside ``import vllm``.

pdpatch's hook runs inside every ``import vllm`` (API server, EngineCore, each worker), so
``install()`` reads declarations only: a patch package's ``__init__`` declares it, naming its
code lazily (:class:`pdpatch.registry.Lazy`); its ``wrappers`` module (kv_segments: its
pipeline's modules) is imported when the installer wraps a target (issue 55: importing all 43
patch modules was two thirds of pdpatch's ~45 ms there).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pdpatch_child import run_json

PATCHES = Path(__file__).resolve().parents[1] / "pdpatch" / "patches"
# What a declaration may import (summary_note: pdpatch.kvcached where kvcached is loaded).
DECLARATION_IMPORTS = {"__future__", "sys", "packaging.version", "pdpatch.registry",
                       "pdpatch.vllm_sites", "pdpatch.kvcached"}
# Code shared by patches' wrappers, which no declaration needs.
SHARED_CODE = ("pdpatch.metrics", "pdpatch.kvcached", "pdpatch.patches.common",
               "pdpatch.agent_layers", "pdpatch.agent_proxy", "pdpatch.attached")
PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"

CHILD = f"""
import json, sys
def loaded():
    return sorted(m for m in sys.modules if m.startswith("pdpatch"))
import vllm
after_vllm = loaded()
import {PULL}
after_pull_worker = loaded()
import pdpatch
targets = {{n: [status for status, _ in p["targets"].values()]
           for n, p in pdpatch.status()["patches"].items()}}
print(json.dumps({{"after_vllm": after_vllm, "after_pull_worker": after_pull_worker,
                   "wrapped": targets}}))
"""


def declared() -> list[str]:
    """Every patch: a package that holds only its declaration."""
    return sorted(p.parent.name for p in PATCHES.glob("*/__init__.py"))


def code_of(name: str, modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith(f"pdpatch.patches.{name}.")]


@pytest.fixture(scope="module")
def child() -> dict:
    """One process: ``import vllm`` with pdpatch enabled, then vLLM's pull worker."""
    return run_json(["-c", CHILD], enable=True)[0]


def test_every_patch_is_a_declaration_package():
    flat = sorted(p.stem for p in PATCHES.glob("*.py") if p.stem not in ("__init__", "common"))
    assert flat == []
    assert len(declared()) >= 20


@pytest.mark.parametrize("name", declared())
def test_a_declaration_imports_only_the_registry_and_the_sites(name: str):
    """Function-level imports included: the summary line calls ``summary_note`` at install."""
    tree = ast.parse((PATCHES / name / "__init__.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "pdpatch":
            found |= {f"pdpatch.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
    assert found <= DECLARATION_IMPORTS, found - DECLARATION_IMPORTS


def test_import_vllm_loads_no_patch_code(child: dict):
    loaded = child["after_vllm"]
    assert {n: code_of(n, loaded) for n in declared() if code_of(n, loaded)} == {}
    assert {f"pdpatch.patches.{n}" for n in declared()} <= set(loaded)   # declarations: yes


def test_import_vllm_loads_no_code_the_patches_share(child: dict):
    assert [m for m in child["after_vllm"] if m in SHARED_CODE] == []


def test_a_patch_code_loads_when_vllm_imports_its_target(child: dict):
    """vLLM's pull worker holds the read path: read_guard's code loads with it and wraps it;
    params_check's target (the API server's input processing) is not imported here, so its
    code stays unloaded and its target armed."""
    loaded = child["after_pull_worker"]
    assert "pdpatch.patches.read_guard.wrappers" in loaded
    assert child["wrapped"]["read_guard"] == ["wrapped"]
    assert code_of("params_check", loaded) == []
    assert child["wrapped"]["params_check"] == ["armed"]
