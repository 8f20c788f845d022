"""The proxies on ``worker.nixl_wrapper`` (pdpatch.agent_layers): one fixed order whichever goes
on first, each found by type, each taken off wherever it sits, the real agent back at the end."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from pdpatch import agent_layers
from pdpatch.agent_layers import ORDER, Layer


class Real:
    def send_notif(self, agent, notif_msg=None):
        return ("real", agent, notif_msg)

    def ping(self):
        return "real"


def _layer(kind: str) -> type[Layer]:
    return type(f"L_{kind}", (Layer,), {"kind": kind})


LAYERS = {kind: _layer(kind) for kind in ORDER}


def kinds(worker) -> list[str]:
    return [layer.kind for layer in agent_layers.stack(worker)]


def test_the_four_proxies_are_layers_of_known_kinds() -> None:
    from pdpatch.kv.staging import StagingAgent
    from pdpatch.patches.kv_segments.substitution import _SubstitutingAgent
    from pdpatch.patches.mla_notif.wrappers import _NotifIdFix
    from pdpatch.patches.peer_restart.watch import PeerWatch

    assert [c.kind for c in (_NotifIdFix, _SubstitutingAgent, PeerWatch, StagingAgent)] == \
        list(ORDER)


@pytest.mark.parametrize("order", list(itertools.permutations(ORDER)))
def test_fixed_order_whatever_goes_on_first(order) -> None:
    real = Real()
    worker = SimpleNamespace(nixl_wrapper=real)
    layers = {kind: agent_layers.push(worker, LAYERS[kind]) for kind in order}
    assert kinds(worker) == list(ORDER)
    assert worker.nixl_wrapper.ping() == "real"            # delegation through every layer
    for kind, layer in layers.items():
        assert agent_layers.find(worker, LAYERS[kind]) is layer
    for kind in order:                                     # off in the order they went on
        assert agent_layers.remove(worker, layers[kind])
        assert kind not in kinds(worker) and worker.nixl_wrapper.ping() == "real"
    assert worker.nixl_wrapper is real


def test_interleaved_scoped_layers_never_strand_one() -> None:
    """A per-call view put on while another is on (two threads) and taken off first or last:
    each removal takes out exactly its own layer (a snapshot restore would leave one behind)."""
    real = Real()
    worker = SimpleNamespace(nixl_wrapper=real)
    staging = agent_layers.push(worker, LAYERS["staging"])
    watch = agent_layers.push(worker, LAYERS["peer_watch"])
    with agent_layers.layered(worker, LAYERS["substitution"]) as sub:
        notif = agent_layers.push(worker, LAYERS["notif_fix"])
        assert kinds(worker) == list(ORDER)
    assert agent_layers.stack(worker) == [notif, watch, staging]
    assert not agent_layers.remove(worker, sub)            # already off
    assert agent_layers.remove(worker, notif)
    assert agent_layers.remove(worker, watch)
    assert agent_layers.stack(worker) == [staging] and staging._agent is real
    assert agent_layers.remove(worker, staging) and worker.nixl_wrapper is real


def test_no_agent_no_layers() -> None:
    worker = SimpleNamespace()
    assert agent_layers.stack(worker) == []
    assert agent_layers.find(worker, LAYERS["staging"]) is None
    with pytest.raises(AttributeError):
        agent_layers.push(worker, LAYERS["notif_fix"])


def test_unknown_kind_refused() -> None:
    worker = SimpleNamespace(nixl_wrapper=Real())
    with pytest.raises(ValueError, match="unknown agent layer kind"):
        agent_layers.push(worker, _layer("mystery"))


def test_notif_fix_rewrites_only_its_message_and_comes_off() -> None:
    from pdpatch.patches.mla_notif.wrappers import _NotifIdFix

    real = Real()
    worker = SimpleNamespace(nixl_wrapper=real)
    with agent_layers.layered(worker, _NotifIdFix, b"d:2", b"p:2") as view:
        assert worker.nixl_wrapper.send_notif("P1", b"d:2") == ("real", "P1", b"p:2")
        assert worker.nixl_wrapper.send_notif("P1", b"x:2") == ("real", "P1", b"x:2")
        assert view.rewritten == 1
    assert worker.nixl_wrapper is real
