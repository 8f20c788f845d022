"""Shared test setup: real vLLM on a CPU machine, pdpatch state reset around each test."""

from __future__ import annotations

import os

import pytest

# The vLLM wheel on a GPU-less machine cannot infer its platform without this.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
for _var in [v for v in os.environ if v.startswith("PDPATCH_") or v == "ENABLE_PDPATCH"]:
    del os.environ[_var]


@pytest.fixture
def fresh_pdpatch(monkeypatch):
    """pdpatch uninstalled before and after; yields the installer module."""
    from pdpatch import installer

    installer.uninstall()
    yield installer
    installer.uninstall()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``), every test of one old vLLM release runs on
    the same worker -- the release's subprocess reports are cached per process (one
    subprocess per release and test family), so spreading a release over workers would run its
    real code twice for the same facts -- and every other test with the rest of its module
    (module-scoped fixtures are built once)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        release = params.get("ver") or params.get("version")
        if isinstance(release, str) and release[:1].isdigit():
            group = f"vllm-{release}"
        else:
            group = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
