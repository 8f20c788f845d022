"""The rig's engine start: ports an engine binds late cannot be taken meanwhile, and an engine
that can never become healthy is reported at once, with its log, not after the timeout.

Seen in CI: a side-channel port picked with ``bind(0)`` is ephemeral, so by the time vLLM's
engine core bound it (tens of seconds later) another connection could own it; stock vLLM's
``nixl_handshake_listener`` thread then dies on ``EADDRINUSE`` and the engine core waits for
it forever, and the run ended in a pytest-timeout that showed nothing of the engines."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import pytest

from lab.rig import servers
from lab.rig.servers import EngineGroup, EngineSpec, EngineStartError


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_bindable() -> None:
    ephemeral = servers._ephemeral_ports()
    ports = [servers.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert not [p for p in ports if p in ephemeral or p < 1024]
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


STUCK_ENGINE = (
    "import time\n"
    "print('Exception in thread nixl_handshake_listener:', flush=True)\n"
    "print('zmq.error.ZMQError: Address already in use', flush=True)\n"
    "time.sleep(120)\n"
)


def test_an_engine_whose_listener_died_fails_the_start_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stuck = [sys.executable, "-c", STUCK_ENGINE]
    monkeypatch.setattr(servers.Engine, "command", lambda self: stuck)
    group = EngineGroup([EngineSpec("D", "kv_consumer", pdpatch=False)], tmp_path)
    t0 = time.monotonic()
    with group, pytest.raises(EngineStartError) as err:
        group.start(timeout_s=60.0, progress=None)
    assert time.monotonic() - t0 < 20.0
    assert "can never become healthy" in str(err.value)
    assert "Address already in use" in str(err.value)


def test_a_failure_report_leaves_out_debug_lines_of_either_form(tmp_path: Path) -> None:
    """What a failed e2e test prints of each engine (``tests/e2e/conftest.py``): CI once showed
    only a DEBUG engine's start-up, pdpatch's lines (``DEBUG 12-05 …``) as well as an engine
    process's (``(Worker pid=…) DEBUG …``); other lines naming DEBUG are kept."""
    eng = servers.Engine(EngineSpec("P", None, pdpatch=False), tmp_path)
    eng.log_path.write_text(
        "INFO 12-05 08:08:48 [pdpatch] pdpatch: ready\n"
        "DEBUG 12-05 08:08:48 [pdpatch] pdpatch: layout wrapped x\n"
        "(Worker pid=7) DEBUG 12-05 08:08:49 [core.py:1] EngineCore waiting for work.\n"
        "(Worker pid=7) INFO 12-05 08:08:50 [x.py:2] PDPATCH_LOG_LEVEL=DEBUG seen\n"
        "(Worker pid=7) ERROR 12-05 08:08:51 [x.py:3] stalled\n")
    assert eng.log_tail(2, skip_debug=True).splitlines() == [
        "(Worker pid=7) INFO 12-05 08:08:50 [x.py:2] PDPATCH_LOG_LEVEL=DEBUG seen",
        "(Worker pid=7) ERROR 12-05 08:08:51 [x.py:3] stalled"]
    assert len(eng.log_tail(5, skip_debug=True).splitlines()) == 3
    assert len(eng.log_tail(5).splitlines()) == 5
