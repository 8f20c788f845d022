"""Shared plumbing for the end-to-end tests: real vLLM engines doing P/D over real NIXL.

Every test here is marked ``e2e`` (deselect with ``-m "not e2e"``).  Engines are started once
per module by module-scoped fixtures; when a test fails, the tail of every live engine's log is
attached to that test's report (``pytest_runtest_makereport``), so a CI failure shows what P
and D said without anyone having to fetch files.  A missing engine runtime is a failure with
the fix in the message, not a skip: CI must not go green without having run the engines.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.rig import proxy
from lab.rig.servers import DEFAULT_START_TIMEOUT_S, EngineGroup

LOG_TAIL_LINES = 150
_live_groups: list[EngineGroup] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        # The engine the failure names first (a timeout names the engine that stalled); DEBUG
        # lines left out (a DEBUG engine's start-up alone filled the tail that CI printed).
        failure = str(rep.longrepr)
        engines = [eng for group in _live_groups for eng in group]
        engines.sort(key=lambda eng: f"{eng.spec.name}:" not in failure)
        for eng in engines:
            rep.sections.append(
                (
                    f"engine {eng.spec.name} log (last {LOG_TAIL_LINES} lines but DEBUG; "
                    f"full log {eng.log_path})",
                    eng.log_tail(LOG_TAIL_LINES, skip_debug=True),
                )
            )


WARM_UP_MARGIN_S = 90.0


def check_start_timeout(start_timeout_s: float, config: pytest.Config) -> None:
    """The rig's own start timeout must fire before pytest-timeout's, which covers the whole
    setup: only the rig's :class:`EngineStartError` carries the engines' stage and log tails
    (a pytest-timeout in the start loop reported nothing but a ``time.sleep`` line)."""
    test_timeout_s = float(config.getini("timeout") or 0)
    if test_timeout_s and start_timeout_s + WARM_UP_MARGIN_S > test_timeout_s:
        raise pytest.UsageError(
            f"RIG_START_TIMEOUT_S={start_timeout_s:.0f} leaves less than {WARM_UP_MARGIN_S:.0f} s "
            f"of pytest's {test_timeout_s:.0f} s timeout for the warm-ups"
        )


@pytest.fixture(scope="module")
def rig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineGroup]:
    """The module's engines, started once.

    The module defines ``RIG_SPECS`` (a list of :class:`EngineSpec`, or a callable returning
    one), optionally ``RIG_WARMUP`` (``(P, D)`` name pairs whose first NIXL handshake is done
    here, see :func:`rig.proxy.warm_up`) and ``RIG_START_TIMEOUT_S``.
    """
    specs = request.module.RIG_SPECS
    specs = specs() if callable(specs) else specs
    log_dir = tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1] + "_logs")
    group = EngineGroup(specs, log_dir)
    _live_groups.append(group)
    try:
        timeout_s = getattr(request.module, "RIG_START_TIMEOUT_S", DEFAULT_START_TIMEOUT_S)
        check_start_timeout(timeout_s, request.config)
        group.start(timeout_s=timeout_s, progress=None)
        print(f"\nengines healthy after {group.start_s:.0f}s (logs: {log_dir})")
        for p_name, d_name in getattr(request.module, "RIG_WARMUP", ()):
            notes: list[str] = []
            warm = proxy.warm_up(group[p_name], group[d_name], log=notes)
            print(f"{p_name}->{d_name} warm-up: TTFT {warm.ttft_s:.2f}s", *notes, sep="\n  ")
        yield group
    finally:
        group.stop()
        _live_groups.remove(group)
