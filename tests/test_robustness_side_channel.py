"""A NIXL side channel that cannot listen: in every release the scheduler half waits, with no
timeout, for a listener thread that died on the bind, so the engine never becomes healthy (seen
in this project's CI when an engine's side-channel port had been taken).  With
``side_channel_listen`` the start fails at once, naming the port and what to set; a free port
(the control) starts exactly as stock does.  Real code: the release's scheduler half, built
through its connector facade (``tests/robust_worker.py::scenario_side_channel_taken``)."""

from __future__ import annotations

import socket
import threading

import pytest
import robust_matrix
import robust_worker as rw
import zmq

from pdpatch import vllm_sites


def assert_free_port_serves(obs: dict) -> None:
    free = obs["free"]
    assert free.get("returned") and not free["waiting"] and free["listener_alive"], free


def assert_hangs(obs: dict) -> None:
    taken = obs["taken"]
    # Still waiting, on a listener that is gone: nothing will ever release it.
    assert taken["waiting"] and not taken["listener_alive"], taken
    assert "returned" not in taken and "raised" not in taken, taken
    assert_free_port_serves(obs)


def assert_fails_start(obs: dict) -> None:
    taken = obs["taken"]
    assert not taken["waiting"] and taken["seconds"] < 2.0, taken
    err = taken["raised"]
    assert err.startswith("SideChannelUnavailable: pdpatch: the NIXL side channel could not "
                          f"listen on port {taken['port']} (ZMQError: Address already in use"), err
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in err and "[side_channel_listen]" in err, err
    assert_free_port_serves(obs)


def test_stock_installed_waits_forever_on_a_taken_port(fresh_pdpatch):
    assert_hangs(rw.scenario_side_channel_taken())


def test_side_channel_listen_installed_fails_the_start(fresh_pdpatch):
    assert fresh_pdpatch.install()["side_channel_listen"].status == "active"
    assert_fails_start(rw.scenario_side_channel_taken())


def test_switched_off_per_deployment_it_is_stock(fresh_pdpatch):
    fresh_pdpatch.install()
    assert_hangs(rw.scenario_side_channel_taken({"pdpatch": {"side_channel_listen": False}}))


def test_a_direct_listener_call_is_untouched(fresh_pdpatch):
    """vLLM's own code or tests may run the listener without a waiting starter: it raises the
    release's error and its event stays unset."""
    fresh_pdpatch.install()
    owner = vllm_sites.lookup(vllm_sites.HANDSHAKE_LISTENER_OWNER, robust_matrix.INSTALLED)
    cls = getattr(__import__(owner.module, fromlist=["_"]), owner.qualname)
    ready, stop = threading.Event(), threading.Event()
    with socket.socket() as blocker:
        blocker.bind((rw.HOST, 0))
        blocker.listen()
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            cls._nixl_handshake_listener({}, ready, stop, rw.HOST, blocker.getsockname()[1])
    assert not ready.is_set()


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_side_channel_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "side_channel", "side_channel_listen")
    assert_hangs(stock)
    assert_fails_start(patched)
