"""The rig's engines run NIXL's UCX progress thread with a poll delay (``rig/quiet_nixl``): an
idle NIXL agent as NIXL 1.5.1 makes it spins a core; one made under the rig's environment
sleeps.  Measured as the CPU time of a process that makes one agent and then idles."""

from __future__ import annotations

import os
import subprocess
import sys

from rig import engine_env

IDLE_S = 2.0
PROBE = f"""
import os, time
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
t = os.times()
time.sleep({IDLE_S})
u = os.times()
print((u.user - t.user) + (u.system - t.system))
"""


def idle_cpu_s(pythonpath: str) -> float:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_rig_engines_idle_nixl_agent_sleeps_where_stock_spins() -> None:
    stock = idle_cpu_s("")
    quiet = idle_cpu_s(str(engine_env.QUIET_NIXL))
    # Stock spins one thread for the whole idle time; even sharing 2 loaded cores it gets a
    # good part of one.  The quiet agent wakes once a millisecond.
    assert stock > 0.3 * IDLE_S, stock
    assert quiet < 0.1 * IDLE_S, quiet
