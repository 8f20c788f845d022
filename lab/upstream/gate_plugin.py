"""pytest plugin for the upstream gate runs (``-p gate_plugin``): a cheaper global cleanup, and
a record of what pdpatch applied in the run.

vLLM's root ``conftest.py`` ends every test with ``cleanup_dist_env_and_memory()``, which
unfreezes the garbage collector's permanent generation and collects the whole heap: ~1.2 s per
test on a 2-core machine with torch, transformers and ray imported, two thirds of a run of the
NIXL suites.  Here whatever is alive after a test's own cleanup (modules, caches, anything the
test kept) is frozen, and the cleanup's ``gc.unfreeze()`` leaves it frozen, so each later
collection scans only what that later test created.  A test's garbage is still collected by
its own cleanup, as in vLLM's CI; the tests run unchanged, and both modes of the gate (stock
and pdpatch) run with this plugin.

The record: with ``PDLAB_GATE_STATUS=<file>``, the run writes there which patches pdpatch had
in force and which it skipped, and why (``pdpatch.status()`` of the pytest process, where the
tests build vLLM's connector objects): a "pdpatch" run in which no patch applied compared
nothing, and the gate must say so rather than pass.  With ``PDLAB_GATE_PRETEND_VLLM=<release>``
pdpatch reads that release as the installed one (the backtest of ``scripts.qualify``: a newer
release's tests, pdpatch deciding as if the older release were the one it knows).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Generator
from pathlib import Path

import pytest


def _pretend(release: str) -> None:
    """Here, at the plugin's import: ``-p`` plugins load before the initial conftests, and
    vLLM's root conftest imports vllm, which installs pdpatch."""
    from packaging.version import Version

    from pdpatch import versions

    versions.vllm_version = lambda: Version(release)


if os.environ.get("PDLAB_GATE_PRETEND_VLLM"):
    _pretend(os.environ["PDLAB_GATE_PRETEND_VLLM"])


def pytest_configure(config: pytest.Config) -> None:
    gc.unfreeze = lambda: None


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("PDLAB_GATE_STATUS")
    if not out:
        return
    from pdpatch import installer

    status = installer.status()
    Path(out).write_text(json.dumps({
        "installed": status["installed"], "vllm": status["vllm"],
        "active": sorted(n for n, p in status["patches"].items() if p["status"] == "active"),
        "skipped": {n: p["reason"] for n, p in status["patches"].items()
                    if p["status"] == "skipped"}}, indent=1))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    result = yield
    gc.freeze()
    return result
