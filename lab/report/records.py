"""The raw GPU records (``docs/gpu/*.json``), read into what the report pools.

Two kinds of file, both written on the device machine by ``python3 -m scripts.gpu_pd``:
``gpu_pd.json`` (a run's scenarios: every P/D request's D-side NIXL time and first-request time,
the oracle's verdicts, the controls) and ``gpu_speed.json`` (one pair start of ``--speed``:
TTFT pdpatch on vs off, paired rounds).  A run is named by the letters in its file name
(``2026-12-01-cz-0.25.1-8b-ref-coalesce.json``: run ``cz``), given in the order the runs were
made (a..z, aa..az, ba..); a run may have several files (one per pair start or GPU).

The records changed as the harness grew: the oldest lack the model geometry in their ``gpu``
line, each scenario's TP sizes and backends, the speed starts' order and settings.  What they
lack is read from what they have (a scenario's ``P``/``D`` say ``FLASH_ATTN TP2``) or, where
nothing in the file says it, from :data:`GEOMETRY_OF` and :data:`SPEED_ENV_OF`, which name the
run's command as recorded with it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_DIR = ROOT / "docs" / "gpu"
FILE_NAME = re.compile(r"(?P<date>\d{4}-\d\d-\d\d)-(?P<run>[a-z]{1,2})(?:-(?P<what>.*))?\.json")
GEOMETRY_OF = {"n": "llama3-8b", "o": "llama3-8b", "p": "llama3-8b", "q": "llama3-8b"}
"""Runs whose ``gpu`` line predates ``model geometry``: their command's ``--geometry``."""
SPEED_ENV_OF = {"m": {"PDPATCH_BLOCK_KEYS": "0"}}
"""Speed starts whose record predates ``on_env``: the pdpatch pair's settings in their command."""


def run_order(letter: str) -> tuple[int, str]:
    """Runs in the order they were made: a..z, then aa..az, ba.."""
    return len(letter), letter


@dataclass(frozen=True)
class Run:
    """One file's run: its letter, file, vLLM release, KV geometry, GPUs, prefix caching."""

    letter: str
    file: str
    release: str
    geometry: str
    gpus: str
    prefix_caching: bool


@dataclass(frozen=True)
class Request:
    """One P/D request of a scenario: D's NIXL time (vLLM's ``vllm:nixl_xfer_time_seconds``),
    the whole request's time, whether it failed, and the oracle's verdict (None: not judged)."""

    xfer_ms: float | None
    ms: float | None
    failed: bool
    intact: bool | None
    same_as_stock: bool | None


@dataclass(frozen=True)
class Scenario:
    """One scenario of a run: its pair, its requests in the order sent (the first is the pair's
    first P/D request), its controls (caught: True/False, None: not judged), the load phase."""

    run: Run
    name: str
    position: int
    pdpatch: bool
    backends: tuple[str, str]
    tp: tuple[int, int]
    requests: dict[str, Request]
    controls: dict[str, bool | None]
    load: tuple[int, int, int] | None = None     # (intact, requests, not judged)
    error: str = ""
    notes: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)
    tolerances: dict = field(default_factory=dict, compare=False, repr=False)
    """The scenario's record and its file's calibrations, for a re-judge against another run."""


@dataclass(frozen=True)
class SpeedStart:
    """One pair start of ``--speed``: the "on" pair's settings, whether both pairs were stock
    (A/A), which started first (None: not recorded), its median paired TTFT ratio, each
    pair's median TTFT per prompt length (s), its decode throughput ratio, D's NIXL time ratio
    per paired round, and how many rounds' outputs were identical."""

    run: Run
    control: bool
    on_env: tuple[tuple[str, str], ...]
    on_first: bool | None
    ratio: float
    by_length: dict[str, dict[str, float]]
    tput_off_on: float | None
    xfer_on_off: tuple[float, ...]
    identical: str


def _run(path: Path, gpu: str) -> Run | None:
    m = FILE_NAME.fullmatch(path.name)
    if m is None:
        return None
    release = re.search(r"vLLM ([\w.]+)", gpu)
    geometry = re.search(r"model geometry ([\w.-]+)", gpu)
    return Run(m["run"], path.name, release[1] if release else "?",
               geometry[1] if geometry else GEOMETRY_OF.get(m["run"], "tiny"),
               gpu.split(",")[0].split(" (")[0], "prefix caching on" in gpu)


def _tp_of(side: str) -> int:
    m = re.search(r" TP(\d+)$", side)
    return int(m[1]) if m else 1


def _request(e: dict) -> Request:
    xfer = e.get("xfer_s")
    return Request(xfer * 1e3 if xfer else None, e.get("ms"), bool(e.get("error")),
                   e.get("intact"), e.get("same_as_stock"))


def _scenario(run: Run, i: int, r: dict, tolerances: dict) -> Scenario:
    backends = tuple(r.get("backends") or [r["P"].split(" TP")[0], r["D"].split(" TP")[0]])
    tp = tuple(r.get("tp") or [_tp_of(r["P"]), _tp_of(r["D"])])
    controls = {c: v.get("caught") for c, v in (r.get("controls") or {}).items()}
    load = r.get("load")
    notes = []
    if "salt_mismatch" in r:
        notes.append(f"cache_salt mismatch: pulled {r['salt_mismatch'].get('pulled')}")
    if "kill_p" in r:
        after = r["kill_p"]["after"]
        failed = sum(1 for n, v in r["kill_p"].items() if n != "after" and v.get("error"))
        notes.append(f"P killed: {failed} of {len(r['kill_p']) - 1} orphaned requests failed, "
                     f"D {'healthy' if after.get('healthy') else 'NOT healthy'} after")
    return Scenario(run, r["scenario"], i, bool(r["pdpatch"]), backends, tp,
                    {n: _request(e) for n, e in r["requests"].items()}, controls,
                    (load["intact"], load["requests"], load.get("unjudged", 0)) if load else None,
                    r.get("error") or "", tuple(notes), r, tolerances)


def _speed(run: Run, d: dict) -> SpeedStart:
    first = d.get("started_first")
    paired = d.get("paired") or {}
    return SpeedStart(run, bool(d.get("control")),
                      tuple(sorted((d.get("on_env") or SPEED_ENV_OF.get(run.letter, {})).items())),
                      None if first is None else first == "on", float(d["ratio_ttft_on_off"][0]),
                      d.get("ttft_s_by_length") or {},
                      d["ratio_tput_off_on"][0] if d.get("ratio_tput_off_on") else None,
                      tuple(paired.get("xfer_on_off") or ()), d.get("outputs_identical", ""))


@dataclass(frozen=True)
class Records:
    """Every scenario and every speed start of the raw files, in run order."""

    scenarios: tuple[Scenario, ...]
    starts: tuple[SpeedStart, ...]

    def runs(self) -> dict[str, list[str]]:
        """Each run's files."""
        out: dict[str, list[str]] = {}
        for r in [s.run for s in self.scenarios] + [s.run for s in self.starts]:
            if r.file not in out.setdefault(r.letter, []):
                out[r.letter].append(r.file)
        return dict(sorted(out.items(), key=lambda kv: run_order(kv[0])))


def load(folder: Path = GPU_DIR) -> Records:
    """Every ``gpu_pd.json`` and ``gpu_speed.json`` record in ``folder`` (other JSON there, the
    import sweeps and the chunk-pace bench, is not a run of the engines)."""
    scenarios: list[Scenario] = []
    starts: list[SpeedStart] = []
    for path in sorted(folder.glob("*.json")):
        d = json.loads(path.read_text())
        run = _run(path, d.get("gpu", "")) if isinstance(d, dict) else None
        if run is None:
            continue
        if "results" in d:
            scenarios += [_scenario(run, i, r, d.get("tolerances") or {})
                          for i, r in enumerate(d["results"])]
        elif "ratio_ttft_on_off" in d:
            starts.append(_speed(run, d))
    return Records(tuple(sorted(scenarios, key=lambda s: (*_made(s.run), s.position))),
                   tuple(sorted(starts, key=lambda s: _made(s.run))))


def _made(run: Run) -> tuple[tuple[int, str], str]:
    return run_order(run.letter), run.file
