"""Peers that come and go, measured on the CPU rig's real engines (docs/peers.md).

    .venv/bin/python -m scripts.peer_restart table  [--variant same_id|new_id|both] [--p-stock]
    .venv/bin/python -m scripts.peer_restart census [--restarts 20] [--variant ...]
    .venv/bin/python -m scripts.peer_restart stall  [--stop-s 40] [--deadline-s 20]
    .venv/bin/python -m scripts.peer_restart soak   [--minutes 5] [--every-s 45]
    .venv/bin/python -m scripts.peer_restart report [--write]   # docs/peers.md's tables

Engines: P (kv_producer; pdpatch unless ``--p-stock``; ``engine_id`` pinned for ``same_id``),
D (kv_consumer, pdpatch) and Dstock (kv_consumer, pdpatch off), all on the installed vLLM (the
tiny seeded model, lab/rig).  Each command prints a JSON record and appends it to
``--out`` (default ``lab/results/peers.jsonl``).

* ``table``: warm up, prefill two prompts on P (params of the incarnation about to die), kill P
  (SIGKILL of its process group) and start it again on the same HTTP and side-channel ports,
  then send D and Dstock the old params (streaming and not) and fresh P/D requests through the
  new P (streaming and not); every answer judged against P's own answer to the prompt.
* ``census``: ``--restarts`` kill/restart cycles with one P/D request to each D after each;
  what each D's NIXL worker holds then (lab/rig/peer_census), first and last.
* ``stall``: requests in flight to D while P is SIGSTOPped for ``--stop-s`` (longer than its
  ``kv_lease_duration``), then SIGCONT: how long each took and how it ended, and the requests
  after.
* ``soak``: concurrent P/D traffic to D (and Dstock) for ``--minutes``, P killed and restarted
  every ``--every-s``: failed answers per restart against those in flight, wrong answers, D
  deaths, time from each restart to D's first good answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lab import peers
from lab.rig import proxy
from lab.rig.engine_env import runtime_versions
from lab.rig.servers import EngineGroup, EngineSpec, sigterm_as_interrupt

FIXED_ID = "prefill-fixed"
#: The table's engines lease P's blocks for vLLM's default 30 s: how long a D without P's
#: incarnation tokens waits after noticing a restart (docs/peers.md).
TABLE_LEASE_S = 30


def specs(variant: str, *, p_stock: bool = False, lease_s: int | None = None,
          deadline_s: int | None = None, stock_d: bool = True) -> list[EngineSpec]:
    lease: dict[str, Any] = {} if lease_s is None else {"kv_lease_s": lease_s}
    env_d = {} if deadline_s is None else {"PDPATCH_PEER_DEADLINE_S": str(deadline_s)}
    out = [EngineSpec("P", "kv_producer", pdpatch=not p_stock,
                      engine_id=FIXED_ID if variant == "same_id" else None, **lease),
           EngineSpec("D", "kv_consumer", pdpatch=True, extra_env=env_d, **lease)]
    if stock_d:
        out.append(EngineSpec("Dstock", "kv_consumer", pdpatch=False, **lease))
    return out


def started(group: EngineGroup, decoders: list[str]) -> None:
    group.start(progress=sys.stderr)
    for name in decoders:
        proxy.warm_up(group["P"], group[name])


def restart_p(group: EngineGroup) -> float:
    """SIGKILL P's group and start it again on the same ports; seconds until healthy."""
    p = group["P"]
    p.kill()
    return p.restart()


def decoders_of(group: EngineGroup) -> list[str]:
    return [e.spec.name for e in group if e.spec.kv_role == "kv_consumer"]


def run_table(variant: str, log_dir: Path, p_stock: bool, fresh: int) -> dict[str, Any]:
    """See the module doc.  Fresh P/D requests go on until D answered ``fresh`` of them or
    P's lease plus a minute passed since the restart (without pdpatch on P, D waits out the
    lease before it reads requests that name no incarnation)."""
    with EngineGroup(specs(variant, p_stock=p_stock, lease_s=TABLE_LEASE_S), log_dir) as group:
        names = decoders_of(group)
        started(group, names)
        p = group["P"]
        stale_tags = ["stale-0", "stale-1"]
        refs = {t: peers.reference(p, t) for t in stale_tags}
        stale = {t: peers.prefill(p, t) for t in stale_tags}
        restart_s = restart_p(group)
        healthy_at = time.time()
        answers = []
        for name in names:
            for i, t in enumerate(stale_tags):
                a = peers.decode(group[name], t, stale[t], refs[t], stream=bool(i % 2))
                a.tag = f"stale/{a.tag}"
                answers.append(a)
        ok = dict.fromkeys(names, 0)
        deadline = time.monotonic() + p.spec.kv_lease_s + 60
        i = 0
        while ok["D"] < fresh and time.monotonic() < deadline:
            t = f"fresh-{i}"
            want = peers.reference(p, t)
            params = peers.prefill(p, t)
            for name in names:
                a = peers.decode(group[name], t, params, want, stream=bool(i % 2))
                answers.append(a)
                ok[name] += a.outcome == "ok"
            i += 1
            if answers[-len(names)].outcome != "ok":
                time.sleep(5.0)
        recovered = {name: min((a.started + a.wall_s - healthy_at for a in answers
                                if a.engine == name and a.outcome == "ok"), default=None)
                     for name in names}
        healthy = {name: group[name].healthy() for name in names}
        logs = {name: [ln for ln in group[name].log_text().splitlines()
                       if "[peer_restart]" in ln or "NIXL_ERR" in ln][-12:] for name in names}
    return {"kind": "table", "variant": variant, "p_pdpatch": not p_stock,
            "restart_s": round(restart_s, 1), "p_lease_s": p.spec.kv_lease_s,
            "answers": [a.row() | {"since_restart_s": round(a.started - healthy_at, 1)}
                        for a in answers],
            "recovered_after_s": recovered, "healthy_after": healthy, "log_lines": logs}


def run_census(variant: str, log_dir: Path, restarts: int) -> dict[str, Any]:
    census_dir = log_dir / "census"
    os.environ["PDLAB_PEER_CENSUS"] = str(census_dir)
    try:
        with EngineGroup(specs(variant), log_dir) as group:
            names = decoders_of(group)
            started(group, names)
            p = group["P"]
            time.sleep(1.0)
            first = {n: peers.held_engines(peers.census(census_dir, group[n])) for n in names}
            outcomes: dict[str, list[str]] = {n: [] for n in names}
            restart_s = []
            for i in range(restarts):
                restart_s.append(restart_p(group))
                tag = f"census-{i}"
                for n in names:
                    # two tries: the first request after a restart may meet the dead agent
                    got = [peers.pd(p, group[n], f"{tag}-{k}", peers.reference(p, f"{tag}-{k}"),
                                    stream=False).outcome for k in range(2)]
                    outcomes[n].append("/".join(got))
                print(f"restart {i + 1}/{restarts}: {restart_s[-1]:.0f} s; "
                      + "; ".join(f"{n}: {outcomes[n][-1]}" for n in names), file=sys.stderr)
            time.sleep(1.5)
            last = {n: peers.held_engines(peers.census(census_dir, group[n])) for n in names}
    finally:
        os.environ.pop("PDLAB_PEER_CENSUS", None)
    return {"kind": "census", "variant": variant, "restarts": restarts,
            "restart_s": summary(restart_s), "first": first, "last": last,
            "outcomes": outcomes}


def run_stall(log_dir: Path, stop_s: float, deadline_s: int, lease_s: int,
              inflight: int) -> dict[str, Any]:
    with EngineGroup(specs("same_id", lease_s=lease_s, deadline_s=deadline_s), log_dir) as group:
        names = decoders_of(group)
        started(group, names)
        p = group["P"]
        tags = [f"stall-{i}" for i in range(inflight)] + ["after-0", "after-1"]
        refs = {t: peers.reference(p, t) for t in tags}
        params = {t: peers.prefill(p, t) for t in tags[:inflight]}
        answers: list[peers.Answer] = []
        lock = threading.Lock()

        def send(name: str, tag: str, stream: bool) -> None:
            a = peers.decode(group[name], tag, params[tag], refs[tag], stream=stream,
                             timeout_s=stop_s + 240)
            with lock:
                answers.append(a)

        p.pause()
        paused_at = time.time()
        threads = [threading.Thread(target=send, args=(n, t, bool(i % 2)))
                   for n in names for i, t in enumerate(tags[:inflight])]
        for th in threads:
            th.start()
        time.sleep(stop_s)
        p.resume()
        resumed_at = time.time()
        for th in threads:
            th.join()
        after = [peers.pd(p, group[n], t, refs[t], stream=False)
                 for t in tags[inflight:] for n in names]
        healthy = {n: group[n].healthy() for n in names}
    return {"kind": "stall", "stop_s": stop_s, "deadline_s": deadline_s, "lease_s": lease_s,
            "paused_at": paused_at, "resumed_at": resumed_at,
            "during": [a.row() for a in answers], "after": [a.row() for a in after],
            "healthy_after": healthy}


def run_soak(variant: str, log_dir: Path, minutes: float, every_s: float,
             workers: int) -> dict[str, Any]:
    with EngineGroup(specs(variant, stock_d=False), log_dir) as group:
        names = decoders_of(group)
        started(group, names)
        p = group["P"]
        refs = {f"soak-{i}": peers.reference(p, f"soak-{i}") for i in range(12)}
        traffic = peers.Traffic(p, [group[n] for n in names], refs, workers=workers)
        end = time.monotonic() + minutes * 60
        stop = threading.Event()
        runner = threading.Thread(target=traffic.run, args=(stop.is_set,))
        runner.start()
        restarts: list[dict[str, float]] = []
        try:
            while time.monotonic() + every_s < end:
                time.sleep(every_s)
                killed = time.time()
                took = restart_p(group)
                restarts.append({"killed": killed, "healthy": time.time(), "restart_s": took})
                print(f"restart {len(restarts)}: P healthy after {took:.0f} s", file=sys.stderr)
            time.sleep(max(0.0, end - time.monotonic()))
        finally:
            stop.set()
            runner.join()
        deaths = {n: not group[n].alive() for n in names}
    return {"kind": "soak", "variant": variant, "minutes": minutes, "every_s": every_s,
            "workers": workers, "restarts": restarts, "deaths": deaths,
            "answers": [a.row() for a in traffic.answers],
            "judged": judge_soak(traffic.answers, restarts)}


def judge_soak(answers: list[peers.Answer], restarts: list[dict[str, float]]
               ) -> dict[str, Any]:
    """D's answers against the restarts (a prefill P refused, down or starting, is counted
    apart and sent nowhere): an answer sent before a restart's kill and ended
    after it was in flight then; one sent while P was down or starting is a failure of the
    restart window; after P is healthy again, every failure counts against recovery.  Time to
    recover: from P healthy to D's first good answer sent after it."""
    failures_inflight = failures_down = failures_after = 0
    recover = []
    refused = [a for a in answers if a.detail.startswith("prefill:")]
    answers = [a for a in answers if not a.detail.startswith("prefill:")]
    for a in answers:
        if a.outcome == "ok":
            continue
        end = a.started + a.wall_s
        inflight = any(a.started < r["killed"] <= end for r in restarts)
        down = any(r["killed"] <= a.started < r["healthy"] for r in restarts)
        if inflight:
            failures_inflight += 1
        elif down:
            failures_down += 1
        else:
            failures_after += 1
    for r in restarts:
        good = [a.started + a.wall_s - r["healthy"] for a in answers
                if a.outcome == "ok" and a.started >= r["healthy"]]
        if good:
            recover.append(min(good))
    return {"prefills_refused_p_down": len(refused),
            "answers": len(answers), "ok": sum(a.outcome == "ok" for a in answers),
            "wrong": sum(a.outcome == "wrong" for a in answers),
            "failed_in_flight_at_kill": failures_inflight,
            "failed_while_p_down": failures_down,
            "failed_after_recovery": failures_after,
            "recover_s": summary(recover)}


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 2),
            "min": round(min(values), 2), "max": round(max(values), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("table", "census", "stall", "soak", "report"))
    ap.add_argument("--write", action="store_true", help="report: write docs/peers.md")
    ap.add_argument("--variant", choices=("same_id", "new_id", "both"), default="both")
    ap.add_argument("--p-stock", action="store_true", help="P without pdpatch (table)")
    ap.add_argument("--fresh", type=int, default=4, help="fresh P/D requests (table)")
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--stop-s", type=float, default=40.0)
    ap.add_argument("--deadline-s", type=int, default=20)
    ap.add_argument("--lease-s", type=int, default=30)
    ap.add_argument("--inflight", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--every-s", type=float, default=45.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("lab/results/peers.jsonl"))
    ap.add_argument("--log-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.what == "report":
        from lab import peers_report

        text = peers_report.render(peers_report.DOC.read_text())
        if args.write:
            peers_report.DOC.write_text(text)
        else:
            print(text)
        return 0
    variants = ["same_id", "new_id"] if args.variant == "both" else [args.variant]
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="peers-"))
    records = []
    with sigterm_as_interrupt():
        for v in variants if args.what != "stall" else ["same_id"]:
            log_dir = log_root / f"{args.what}-{v}"
            t0 = time.time()
            if args.what == "table":
                rec = run_table(v, log_dir, args.p_stock, args.fresh)
            elif args.what == "census":
                rec = run_census(v, log_dir, args.restarts)
            elif args.what == "stall":
                rec = run_stall(log_dir, args.stop_s, args.deadline_s, args.lease_s,
                                args.inflight)
            else:
                rec = run_soak(v, log_dir, args.minutes, args.every_s, args.workers)
            rec.update({"vllm": runtime_versions().vllm_python, "started": t0,
                        "took_s": round(time.time() - t0), "logs": str(log_dir),
                        "command": "python -m scripts.peer_restart " + " ".join(
                            argv if argv is not None else sys.argv[1:])})
            records.append(rec)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with args.out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps({k: v for k, v in rec.items() if k != "answers"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
