"""Running a scenario module that builds an old release's real scheduler from its own
unit-test helpers (``hma_failed_recv_scenarios``, ``ssm_prefix_scenarios``), stock then
patched, in that release's subprocess; shared by their test modules."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from versions_harness import run_in_release

from lab.env import cache_dir


@functools.cache
def _report(module: str, names: tuple[str, ...], version: str) -> dict[str, Any]:
    run = run_in_release(version, f"import {module} as m\nemit(m.release_report({list(names)!r}))",
                         timeout=600)
    return run.check()


def report(module: str, names: list[str], version: str) -> dict[str, Any]:
    """``module.release_report(names)`` under ``version`` (once per test session); skips where
    the release's tree or its sdist's unit-test helpers are not fetched."""
    if version == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    if not (cache_dir() / "vllm-tests" / version).exists():
        pytest.skip(f"vLLM {version}'s sdist tests not fetched (its unit-test scheduler "
                    "helpers: python -m scripts.upstream_suites --fetch-only --helpers)")
    return _report(module, tuple(names), version)


def observed(rep: dict[str, Any], phase: str, name: str) -> dict[str, Any]:
    data = rep[phase][name]
    if "error" in data:
        raise AssertionError(f"{name} ({phase}) could not run:\n{data['error']}")
    return data
