"""The rig's engines wait without spinning (``lab/rig/quiet_spin``).

NIXL's UCX progress thread runs with a poll delay: an idle NIXL agent as NIXL 1.5.1 makes it
spins a core; one made under the rig's environment sleeps.  vLLM's shared-memory message-queue
readers park on the queue's notification at once instead of spinning for a second after each
message, and still get every message promptly.

Measured on a process that makes one agent and then idles: how long its threads were
runnable (on a CPU or waiting in the run queue, ``/proc/<pid>/task/*/schedstat``), which for a
spinning thread is the whole idle time however loaded the machine is (its CPU time alone
depends on what else runs: CI once gave it 0.5 s of 2 s), and the CPU time they used, which for
a thread that sleeps between short wake-ups stays small under load too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lab.rig import engine_env

IDLE_S = 2.0
PROBE = f"""
import json, os, time
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(backends=["UCX"]))

def runnable_ns():
    out = {{}}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{{tid}}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except OSError:  # a thread that ended meanwhile
            continue
        out[tid] = int(run) + int(wait)
    return out

t, tc = runnable_ns(), os.times()
time.sleep({IDLE_S})
u, uc = runnable_ns(), os.times()
print(json.dumps({{"runnable": sum(u[k] - t[k] for k in t.keys() & u.keys()) / 1e9,
                  "cpu": (uc.user - tc.user) + (uc.system - tc.system)}}))
"""


def idle(pythonpath: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rig_engines_idle_nixl_agent_sleeps_where_stock_spins() -> None:
    stock = idle("")
    quiet = idle(str(engine_env.QUIET_SPIN))
    # stock keeps one thread runnable for the whole idle time; the quiet agent wakes once a
    # millisecond for a few microseconds of work
    assert stock["runnable"] > 0.8 * IDLE_S, stock
    assert quiet["cpu"] < 0.1 * IDLE_S, quiet


MQ_GAP_S = 0.8
MQ_MESSAGES = 40
MQ_PROBE = f"""
import json, os, random, threading, time
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

writer = MessageQueue(n_reader=1, n_local_reader=1)
handle = writer.export_handle()
got, tid = [], []

def read():
    tid.append(threading.get_native_id())
    reader = MessageQueue.create_from_handle(handle, 0)
    reader.wait_until_ready()
    for _ in range({MQ_MESSAGES} + 2):
        sent = reader.dequeue()
        got.append(time.monotonic() - sent)

def schedstat_s():
    with open(f"/proc/self/task/{{tid[0]}}/schedstat") as f:
        run, wait = f.read().split()[:2]
    return int(run) / 1e9, int(wait) / 1e9

thread = threading.Thread(target=read, daemon=True)
thread.start()
writer.wait_until_ready()
writer.enqueue(time.monotonic())
while not got:
    time.sleep(0.01)
run0, wait0 = schedstat_s()
time.sleep({MQ_GAP_S})          # the reader waits for the next message: spinning or parked
run1, wait1 = schedstat_s()
writer.enqueue(time.monotonic())
rng = random.Random(0)
for _ in range({MQ_MESSAGES}):  # gaps of 0-30 ms: parked readers woken by notification only
    time.sleep(rng.uniform(0, 0.03))
    writer.enqueue(time.monotonic())
thread.join(60)
print(json.dumps({{"waiting_runnable_s": run1 - run0 + wait1 - wait0,
                  "waiting_cpu_s": run1 - run0, "received": len(got),
                  "worst_latency_s": max(got)}}))
"""


def message_queue(extra_env: dict[str, str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(engine_env.QUIET_SPIN), **extra_env}
    out = subprocess.run([sys.executable, "-c", MQ_PROBE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_rig_engines_message_queue_readers_park_where_stock_spins() -> None:
    """vLLM's own ``MessageQueue``, one writer and one reader: stock, the reader waiting for the
    next message stays runnable the whole gap (``sched_yield`` for ``busy_loop_s`` = 1 s after
    each read); in the rig it sleeps on the queue's notification, and every one of 40 messages
    sent at 0-30 ms gaps still arrives within half a second."""
    stock = message_queue({"PDLAB_RIG_MQ_SPIN": "1"})
    quiet = message_queue({})
    assert stock["waiting_runnable_s"] > 0.6 * MQ_GAP_S, stock
    # a spinning thread is runnable the whole gap however loaded the machine; a parked one
    # wakes every 20 ms for microseconds of CPU (its wait in the run queue depends on the load)
    assert quiet["waiting_cpu_s"] < 0.1 * MQ_GAP_S, quiet
    assert quiet["received"] == MQ_MESSAGES + 2, quiet
    assert quiet["worst_latency_s"] < 0.5, quiet
