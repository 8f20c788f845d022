"""Shared test setup: real vLLM on a CPU machine, pdpatch state reset around each test."""

from __future__ import annotations

import os

import pytest
from xdist_groups import group_of, set_groups

from lab import cpu_platform
from pdpatch.versions import vllm_version

# The vLLM wheel on a GPU-less machine cannot infer its platform without this.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
# The installed release's unit code on this x86 CPU (lab/cpu_platform.py), before vLLM is
# imported: its Triton check is made once, at import.
cpu_platform.apply(os.environ, str(vllm_version() or "0"))
for _var in [v for v in os.environ if v.startswith("PDPATCH_") or v == "ENABLE_PDPATCH"]:
    del os.environ[_var]


@pytest.fixture
def fresh_pdpatch(monkeypatch):
    """pdpatch uninstalled, and every patch's state fresh, before and after; yields the
    installer module."""
    from pdpatch import installer

    installer.uninstall()
    installer.reset_state()
    yield installer
    installer.uninstall()
    installer.reset_state()


@pytest.hookimpl(trylast=True)  # after xdist's own hook, which may or may not set the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``scripts.qualify`` (``PDLAB_QUALIFY_RELEASE``) only the named release's tests
    run; then each test gets its xdist group (``tests/xdist_groups.py``)."""
    release = os.environ.get("PDLAB_QUALIFY_RELEASE")
    if release:
        config.hook.pytest_deselected(
            items=[i for i in items if group_of(i) != f"vllm-{release}"])
        items[:] = [i for i in items if group_of(i) == f"vllm-{release}"]
    set_groups(config, items)
