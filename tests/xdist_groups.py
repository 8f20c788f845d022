"""Which pytest-xdist worker runs which test (``pytest -n 2 --dist loadgroup``).

Every test of one old vLLM release runs on one worker: a release's subprocess reports are
cached per process (one subprocess per release and test family), so spreading a release over
the workers would run its real code twice for the same facts.  Every other test runs with the
rest of its module, so that module-scoped fixtures (a pool of 23 releases' hashers, a NIXL
bench run) are built once -- unless the module sets ``XDIST_SPREAD = True``: independent tests
that each start their own processes (``test_activation.py``'s ~320 s ran last, alone, on one
worker while the other idled).

``--dist loadgroup`` groups the node ids that end in ``@group``.  pytest-xdist 3.8 writes that
suffix into ``item._nodeid``, which pytest 9.2 no longer reads (node ids come from the
structured ``item._id``): the marks were silently ignored and every test was scheduled alone
(pytest-dev/pytest-xdist#1386).  So the suffix is written here, on whichever attribute this
pytest reads, and a worker whose collected ids lack it stops the run instead of degrading.
"""

from __future__ import annotations

import re

import pytest


def group_of(item: pytest.Item) -> str:
    params = getattr(getattr(item, "callspec", None), "params", {})
    release = params.get("ver") or params.get("version")
    if isinstance(release, str) and release[:1].isdigit():
        return f"vllm-{release}"
    if getattr(getattr(item, "module", None), "XDIST_SPREAD", False):
        return re.sub(r"[\[\]@]", "_", item.nodeid)      # a group of its own
    return item.nodeid.split("::", 1)[0]


def grouped(nodeid: str) -> bool:
    """xdist's own test of a group suffix (``LoadGroupScheduling._split_scope``)."""
    return nodeid.rfind("@") > nodeid.rfind("]")


def _set_node_id(item: pytest.Item, nodeid: str) -> None:
    if hasattr(item, "_id"):  # pytest >= 9.2
        item._id = type(item._id).parse(nodeid)
    else:
        item._nodeid = nodeid


def set_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every item its group suffix (``tests/conftest.py`` calls this last in its
    collection hook, after xdist's own)."""
    if not config.getoption("loadgroup", False):  # set on xdist workers under --dist loadgroup
        return
    for item in items:
        if not grouped(item.nodeid):
            _set_node_id(item, f"{item.nodeid}@{group_of(item)}")
        if not grouped(item.nodeid):
            raise pytest.UsageError(
                f"cannot give {item.nodeid} its xdist group on this pytest "
                "(pytest-dev/pytest-xdist#1386): run without -n, or pin a pytest whose node "
                "ids this file knows how to set")
