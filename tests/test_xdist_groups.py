"""The test command's worker split (``tests/xdist_groups.py``) really groups: a small suite run
with ``--dist loadgroup`` as ``scripts/run_tests.sh`` does (on two workers here).  Before the
fix, pytest 9.2 with pytest-xdist 3.8 spread every group over both workers (module fixtures
built twice, each release's reports computed twice)."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SUITE = '''
import os
import pytest

def seen(tag):
    with open(os.environ["SEEN"], "a") as f:
        f.write(f"{tag} {os.environ['PYTEST_XDIST_WORKER']}\\n")

@pytest.fixture(scope="module")
def built():
    seen("module-fixture")

@pytest.mark.parametrize("n", range(20))
def test_module_group(built, n):
    seen("module")

@pytest.mark.parametrize("ver", ["0.19.1", "0.20.2"])
@pytest.mark.parametrize("n", range(20))
def test_release_group(ver, n):
    seen(ver)
'''

SPREAD = '''
import os
import time
import pytest

XDIST_SPREAD = True

@pytest.mark.parametrize("n", range(20))
def test_spread(n):
    time.sleep(0.05)
    with open(os.environ["SEEN"], "a") as f:
        f.write(f"spread {os.environ['PYTEST_XDIST_WORKER']}\\n")
'''


def test_each_group_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from xdist_groups import set_groups\n\n"
        "def pytest_collection_modifyitems(config, items):\n"
        "    set_groups(config, items)\n")
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "test_spread.py").write_text(SPREAD)
    seen = tmp_path / "seen.txt"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-n", "2", "--dist", "loadgroup", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS),
                            "SEEN": str(seen)})
    assert p.returncode == 0, p.stdout + p.stderr
    workers: dict[str, set[str]] = defaultdict(set)
    count: dict[str, int] = defaultdict(int)
    for line in seen.read_text().splitlines():
        tag, worker = line.split()
        workers[tag].add(worker)
        count[tag] += 1
    assert count == {"module-fixture": 1, "module": 20, "0.19.1": 20, "0.20.2": 20,
                     "spread": 20}
    spread = workers.pop("spread")
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert len(spread) == 2, spread            # XDIST_SPREAD: each test a group of its own
    # three groups on two workers: both were used
    assert len(set().union(*workers.values())) == 2, dict(workers)


def test_a_release_run_outside_its_group_is_refused(monkeypatch) -> None:
    """The test that hard-coded 0.21.0 without a ``ver`` parameter ran that release's report a
    second time, on the other worker (73 s of CI)."""
    from versions_harness import run_in_release

    monkeypatch.setenv("PYTEST_CURRENT_TEST",
                       "tests/test_x.py::test_y@tests/test_x.py (call)")
    with pytest.raises(AssertionError, match="outside that release's worker group"):
        run_in_release("0.21.0", "emit(1)")
