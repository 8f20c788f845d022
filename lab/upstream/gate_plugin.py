"""pytest plugin for the upstream gate runs (``-p gate_plugin``): a cheaper global cleanup.

vLLM's root ``conftest.py`` ends every test with ``cleanup_dist_env_and_memory()``, which
unfreezes the garbage collector's permanent generation and collects the whole heap: ~1.2 s per
test on a 2-core machine with torch, transformers and ray imported, two thirds of a run of the
NIXL suites.  Here whatever is alive after a test's own cleanup (modules, caches, anything the
test kept) is frozen, and the cleanup's ``gc.unfreeze()`` leaves it frozen, so each later
collection scans only what that later test created.  A test's garbage is still collected by
its own cleanup, as in vLLM's CI; the tests run unchanged, and both modes of the gate (stock
and pdpatch) run with this plugin.
"""

from __future__ import annotations

import gc
from collections.abc import Generator

import pytest


def pytest_configure(config: pytest.Config) -> None:
    gc.unfreeze = lambda: None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None
                            ) -> Generator[None, None, None]:
    result = yield
    gc.freeze()
    return result
