"""The rig's P/D pairs lease P's blocks for two minutes, not vLLM's 30 s: on the 2-core CI
machine D's NIXL calls stall for up to 30 s (``lab.rig.servers.RIG_KV_LEASE_S``), and a test of
something else must not fail because a lease ran out behind such a stall.  The module that tests
the lease itself keeps vLLM's default (``test_expired_lease_declined`` waits it out, and would see
no declined READ under a two-minute lease)."""

from __future__ import annotations

import json
from pathlib import Path

from lab.rig import servers
from lab.rig.servers import EngineSpec


def kv_transfer_config(spec: EngineSpec, tmp_path: Path) -> dict | None:
    cmd = servers.Engine(spec, tmp_path).command()
    if "--kv-transfer-config" not in cmd:
        return None
    return json.loads(cmd[cmd.index("--kv-transfer-config") + 1])


def test_pairs_lease_two_minutes_unless_a_spec_sets_its_own(tmp_path: Path) -> None:
    assert servers.RIG_KV_LEASE_S == 120
    for role in ("kv_producer", "kv_consumer"):
        cfg = kv_transfer_config(EngineSpec("X", role, model=tmp_path), tmp_path)
        assert cfg["kv_connector_extra_config"] == {"kv_lease_duration": 120}, cfg
        cfg = kv_transfer_config(EngineSpec("X", role, model=tmp_path, kv_lease_s=30), tmp_path)
        assert cfg["kv_connector_extra_config"] == {"kv_lease_duration": 30}, cfg
    assert kv_transfer_config(EngineSpec("baseline", None, model=tmp_path), tmp_path) is None

