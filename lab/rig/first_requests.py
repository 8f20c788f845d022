"""How long a decode engine's first P/D request takes on the rig, and which processes used the
CPU meanwhile: the measurement behind ``lab/rig/quiet_spin`` (docs/rig.md).

    python -m scripts.rig_first_requests [--rounds 8]       # the rig as the tests run it
    PDLAB_RIG_MQ_SPIN=1 python -m scripts.rig_first_requests  # vLLM's spinning queue readers

Starts the rig's P (pdpatch), D (pdpatch) and baseline engines, then per round restarts D (from
the second round on) and times one 16-token prompt through P and D (``proxy.pd_request``: D's
first NIXL handshake with P, the READ, two tokens), printing the four processes that used the
most CPU per second of the round.  A round that fails (the rig's 120 s request timeout) is
printed with its error.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from lab.rig import proxy
from lab.rig.servers import EngineGroup, EngineSpec

SPECS = [EngineSpec("P", "kv_producer", pdpatch=True),
         EngineSpec("D", "kv_consumer", pdpatch=True),
         EngineSpec("baseline", None, pdpatch=False)]


def cpu_seconds(pids: list[tuple[str, int]]) -> dict[tuple[str, str], float]:
    """(engine, process name) -> user + system CPU seconds so far, from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[str, str], float] = {}
    for engine, pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:                     # ended meanwhile
            continue
        key = (engine, f"{comm}[{pid}]")
        out[key] = (int(fields[11]) + int(fields[12])) / tick
    return out


def one_round(group: EngineGroup, rnd: int) -> str:
    pids = [(e.spec.name, pid) for e in group for pid in e.pids()]
    before, t0 = cpu_seconds(pids), time.monotonic()
    try:
        res = proxy.pd_request(group["P"], group["D"], list(range(3 + rnd, 19 + rnd)), 2)
        error = res.decode.error
    except OSError as exc:                  # urllib's HTTP errors and timeouts
        error = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    after = cpu_seconds(pids)
    busiest = sorted(((after[k] - before[k]) / took, k) for k in after.keys() & before.keys())
    use = ", ".join(f"{engine} {comm} {share:.2f}" for share, (engine, comm) in busiest[::-1][:4])
    return f"round {rnd}: {took:6.1f} s  error={error}  CPU s/s: {use}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    spin = os.environ.get("PDLAB_RIG_MQ_SPIN") == "1"
    print(f"message-queue readers: {'spinning (vLLM)' if spin else 'parked (rig)'}")
    with tempfile.TemporaryDirectory(prefix="first-requests-") as logs, \
            EngineGroup(SPECS, Path(logs)) as group:
        group.start(timeout_s=300, progress=None)
        print(f"engines healthy after {group.start_s:.0f} s", flush=True)
        for rnd in range(args.rounds):
            if rnd:
                group["D"].restart()
            print(one_round(group, rnd), flush=True)
    return 0
