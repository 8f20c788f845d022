"""docs/peers.md's measured tables, from the raw records ``scripts/peer_restart.py`` appends to
``lab/results/peers.jsonl`` (``python -m scripts.peer_restart report [--write]``): the newest
record of each kind and variant, never a hand-typed figure."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lab.generated import fill

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "lab" / "results" / "peers.jsonl"
DOC = ROOT / "docs" / "peers.md"
COMMAND = "python -m scripts.peer_restart report --write"
DASH = "\u2013"     # the range dash docs/ write


def records(path: Path = RECORDS) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def newest(recs: Iterable[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    found = [r for r in recs if all(r.get(k) == v for k, v in match.items())]
    return max(found, key=lambda r: r["started"]) if found else None


def spread(values: list[float]) -> str:
    """median (range, n) -- or the one value and n=1."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.1f} (n=1)"
    return f"{statistics.median(values):.1f} ({min(values):.1f}{DASH}{max(values):.1f}, " \
           f"n={len(values)})"


def _count(answers: list[dict], outcome: str) -> str:
    return f"{sum(a['outcome'] == outcome for a in answers)}/{len(answers)}"


def verdict(stale: list[dict], fresh: list[dict], lease_s: float | None = None) -> str:
    """``recovered``: no wrong answer, the dead incarnation's params never answered, a fresh
    request answered, and none failed after the first one that was."""
    if any(a["outcome"] == "wrong" for a in stale + fresh):
        return "**WRONG TOKENS**"
    if any(a["outcome"] == "ok" for a in stale):
        return "stale params answered"
    first = next((i for i, a in enumerate(fresh) if a["outcome"] == "ok"), None)
    if first is None:
        return "not recovered"
    if any(a["outcome"] != "ok" for a in fresh[first:]):
        return "recovered, then failed"
    if first == 0:
        return "recovered"
    waited = f" once P's {lease_s:.0f} s lease ran out" if lease_s else ""
    return f"recovered{waited} ({first} failed before)"


def table_block(recs: list[dict[str, Any]]) -> str:
    lines = ["| P's identity after the restart | P | D | params from before the restart "
             "(stream + not) | P/D requests after, not streaming | streaming | wrong 200 | "
             "first good answer after P healthy (s) | verdict | vLLM, when |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for variant, label in (("same_id", "same `engine_id`"), ("new_id", "new `engine_id` "
                                                                      "(vLLM's default)")):
        for p_pdpatch in (True, False):
            rec = newest(recs, kind="table", variant=variant, p_pdpatch=p_pdpatch)
            if rec is None:
                continue
            for d in ("D", "Dstock"):
                mine = [a for a in rec["answers"] if a["engine"] == d]
                stale = [a for a in mine if a["tag"].startswith("stale/")]
                fresh = [a for a in mine if not a["tag"].startswith("stale/")]
                rec_s = rec["recovered_after_s"].get(d)
                lines.append(
                    f"| {label} | {'pdpatch' if p_pdpatch else 'stock'} | "
                    f"{'pdpatch' if d == 'D' else 'stock'} | failed {_count(stale, 'error')} | "
                    f"ok {_count([a for a in fresh if not a['stream']], 'ok')} | "
                    f"ok {_count([a for a in fresh if a['stream']], 'ok')} | "
                    f"{sum(a['outcome'] == 'wrong' for a in mine)} | "
                    f"{'—' if rec_s is None else f'{rec_s:.1f}'} | "
                    f"{verdict(stale, fresh, None if p_pdpatch else rec.get('p_lease_s'))} | "
                    f"{rec['vllm']}, {_day(rec)} |")
    return "\n".join(lines)


def _day(rec: dict[str, Any]) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(rec["started"], datetime.UTC).strftime("%Y-%m-%d")


CENSUS_ROWS = (("_remote_agents", "engines with agents (`_remote_agents`)"),
               ("agents_nixl_knows", "agents NIXL still holds (of those ever loaded)"),
               ("dst_xfer_side_handles", "prepared remote lists (`dst_xfer_side_handles`)"),
               ("kv_caches_base_addr", "`kv_caches_base_addr` entries"),
               ("transfer_topo._engines", "transfer topology entries"),
               ("_engine_by_address", "`_engine_by_address` entries"),
               ("_remote_registration_generations", "`_remote_registration_generations`"),
               ("sockets", "open sockets of the worker process"))


def census_block(recs: list[dict[str, Any]]) -> str:
    lines = []
    for variant, label in (("same_id", "same `engine_id`"), ("new_id", "new `engine_id`")):
        rec = newest(recs, kind="census", variant=variant)
        if rec is None:
            continue
        n = rec["restarts"]
        lines += [f"**{label}**, {n} restarts ({rec['vllm']}, {_day(rec)}; P back after "
                  f"{spread_of(rec['restart_s'])} s each): after the warm-up -> after the last",
                  "", "| held by D's worker | D (pdpatch) | Dstock |", "|---|---|---|"]
        for key, what in CENSUS_ROWS:
            cells = []
            for d in ("D", "Dstock"):
                first, last = rec["first"].get(d, {}), rec["last"].get(d, {})
                if key not in last:
                    cells.append("—")
                    continue
                extra = f" of {last['agents_loaded_ever']}" if key == "agents_nixl_knows" else ""
                cells.append(f"{first.get(key, '—')} -> {last[key]}{extra}")
            lines.append(f"| {what} | {cells[0]} | {cells[1]} |")
        ok = {d: sum(o.startswith("ok") for o in outs) for d, outs in rec["outcomes"].items()}
        lines += ["", "First P/D request after each restart answered: "
                  + ", ".join(f"{d} {ok[d]}/{n}" for d in ok) + ".", ""]
    return "\n".join(lines).rstrip()


def spread_of(summary: dict[str, Any]) -> str:
    if not summary.get("n"):
        return "—"
    return f"{summary['median']:.0f} ({summary['min']:.0f}{DASH}{summary['max']:.0f}, " \
           f"n={summary['n']})"


def stall_block(recs: list[dict[str, Any]]) -> str:
    rec = newest(recs, kind="stall")
    if rec is None:
        return "(not measured yet)"
    lines = [f"P SIGSTOPped {rec['stop_s']:.0f} s (its lease {rec['lease_s']} s) with requests in "
             f"flight; D's `PDPATCH_PEER_DEADLINE_S={rec['deadline_s']}` ({rec['vllm']}, "
             f"{_day(rec)}):", "",
             "| D | requests in flight | ended | seconds to end: median (range, n) | wrong 200 |",
             "|---|---|---|---|---|"]
    for d in ("D", "Dstock"):
        mine = [a for a in rec["during"] if a["engine"] == d]
        if not mine:
            continue
        ends = ", ".join(f"{o} {sum(a['outcome'] == o for a in mine)}" for o in ("ok", "error")
                         if any(a["outcome"] == o for a in mine))
        lines.append(f"| {'pdpatch' if d == 'D' else 'stock'} | {len(mine)} | {ends} | "
                     f"{spread([a['wall_s'] for a in mine])} | "
                     f"{sum(a['outcome'] == 'wrong' for a in mine)} |")
    after = rec["after"]
    lines += ["", "After SIGCONT: " + ", ".join(
        f"{a['engine']} {a['outcome']}" for a in after) + "."]
    return "\n".join(lines)


def soak_block(recs: list[dict[str, Any]]) -> str:
    rec = newest(recs, kind="soak")
    if rec is None:
        return "(not measured yet)"
    j = rec["judged"]
    rs = [r["restart_s"] for r in rec["restarts"]]
    rec_s = j["recover_s"]
    return "\n".join([
        f"{rec['minutes']:.0f} minutes, {rec['workers']} concurrent clients of P/D requests "
        f"(streaming and not), P (pdpatch, same `engine_id`) SIGKILLed and restarted every "
        f"{rec['every_s']:.0f} s: {len(rs)} restarts, P healthy again after {spread(rs)} s "
        f"({rec['vllm']}, {_day(rec)}).", "",
        "| D's answers | ok | wrong 200 | failed, in flight at a kill | failed, sent while P was "
        "down | failed after P was back | D deaths | first good answer after P healthy (s) | "
        "prefills P refused while down (not sent to D) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {j['answers']} | {j['ok']} | {j['wrong']} | {j['failed_in_flight_at_kill']} | "
        f"{j['failed_while_p_down']} | {j['failed_after_recovery']} | "
        f"{sum(rec['deaths'].values())} | {spread_of(rec_s) if rec_s.get('n') else '—'} | "
        f"{j.get('prefills_refused_p_down', '—')} |"])


BLOCKS = {"peers-table": table_block, "peers-census": census_block,
          "peers-stall": stall_block, "peers-soak": soak_block}


def render(text: str, recs: list[dict[str, Any]] | None = None) -> str:
    recs = records() if recs is None else recs
    return fill(text, COMMAND, {k: (lambda f=f: f(recs)) for k, f in BLOCKS.items()},
                where=str(DOC))
