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
