"""A prefill engine whose NIXL side-channel port another process holds, pdpatch on: the engine
exits during start with ``side_channel_listen``'s reason in its log.  (Stock vLLM 0.33 waits
forever there: its engine core blocks on a listener thread that died on the bind; the worker
level proof on every release is ``tests/test_robustness_side_channel.py``.)  One engine, no rig:
it must not be started beside the module rigs' engines."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from lab.rig.servers import Engine, EngineSpec

EXIT_BOUND_S = 420.0


def test_taken_side_channel_port_fails_the_start(tmp_path: Path) -> None:
    engine = Engine(EngineSpec("P", "kv_producer", pdpatch=True), tmp_path)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", engine.side_channel_port))
        blocker.listen()
        engine.start()
        try:
            t0 = time.monotonic()
            while engine.alive() and time.monotonic() - t0 < EXIT_BOUND_S:
                assert not engine.healthy(), "healthy without a side channel"
                time.sleep(1.0)
            log = engine.log_text()
            assert not engine.alive(), f"still running after {EXIT_BOUND_S:.0f} s:\n{log[-4000:]}"
        finally:
            engine.stop()
    assert engine.proc is not None and engine.proc.returncode != 0
    assert "EngineCore failed to start" in log, log[-4000:]
    assert (f"SideChannelUnavailable: pdpatch: the NIXL side channel could not listen on port "
            f"{engine.side_channel_port} (ZMQError: Address already in use") in log, log[-4000:]
