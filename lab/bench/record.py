"""A CPU benchmark's raw result file: what ran, on what, under what load, every sample.

Each bench of ``scripts/bench_*.py`` takes ``--json PATH`` (write the record there) or
``--record`` (write it to ``docs/bench/<bench>-<date>-<n>.json``, the next free ``n`` of that
bench and day: the files ``python -m lab.report`` pools into the Benchmarks table of
``docs/proof.md``).  A record holds:

* ``bench``, ``command`` (as typed, from the checkout root), ``args`` (every option, parsed),
  ``started`` / ``finished`` (UTC) and ``seconds``;
* ``vllm`` (the installed release), ``python``, ``machine`` (cores, CPU model, memory, kernel);
* ``load``: the load averages (1, 5, 15 min) ``before`` and ``after`` the bench, and the 1-minute
  load ``during`` it, read every :data:`LOAD_EVERY_S` seconds (other work on a shared machine
  slows both sides of a bench's ratio, not always alike);
* ``env``: the environment variables that change what a bench measures (:data:`ENV_KEYS`);
* ``code``: the commit, the measured code's uncommitted changes (``dirty``), and a digest of the
  measured files as they were (``sha256`` over :data:`CODE` of the bench: pdpatch's code the bench
  runs, the harness it builds on and the bench itself), so the report can tell runs of the same
  code from runs of changed code (``lab/report/bench_epochs.json``);
* ``samples``: every timed sample, as the bench took them (seconds or ms, named in the key);
* ``derived``: the run's figures as the bench prints them (name -> number), each computed from
  the samples of this run only (a ratio against the baseline measured in the same run).

``note`` (``--note``): what the operator wants said with the run (what else ran, say).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "docs" / "bench"
FORMAT = 1
LOAD_EVERY_S = 10.0
FILE_NAME = re.compile(r"(?P<bench>[a-z_]+)-(?P<date>\d{4}-\d\d-\d\d)-(?P<n>\d+)\.json")
ENV_KEYS = re.compile(r"PYTHON(DONTWRITEBYTECODE|HASHSEED|OPTIMIZE|MALLOC)|OMP_NUM_THREADS"
                      r"|MKL_NUM_THREADS|VLLM_TARGET_DEVICE|VLLM_CPU_\w+|ENABLE_PDPATCH"
                      r"|PDPATCH_\w+|UCX_\w+|NIXL_\w+|CUDA_VISIBLE_DEVICES")
"""Environment variables that can change what a bench measures (bytecode caching, hash seed,
threads, pdpatch's and the transport's settings)."""

CODE: dict[str, tuple[str, ...]] = {
    "activation": ("pdpatch", "lab/bench/activation.py"),
    "block_keys": ("pdpatch/hashing", "lab/bench/block_keys.py"),
    "descriptors": ("pdpatch/kv", "lab/kv_reference.py", "lab/bench/descriptors.py"),
    "chunked": ("pdpatch/kv", "lab/bench/descriptors.py", "lab/bench/chunked.py"),
    "first_contact": ("pdpatch", "tests/robust_worker.py", "tests/test_kv_segments_harness.py",
                      "tests/versions_harness.py", "lab/bench/first_contact.py"),
    "pd": ("pdpatch", "lab/rig", "lab/paired.py", "lab/bench/pd.py"),
}
"""Per bench, the code it measures (pdpatch's code on its path, the harness, the bench): a
change in any of it is a change the report's epochs table must review."""
SOURCE_SUFFIXES = (".py", ".pth", ".c", ".h", ".json", ".txt", ".sh")
OUTPUT_ONLY = frozenset({"json", "record", "note", "profile", "log_dir"})
"""Options that change where a bench writes, never what it measures."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The raw-record options every bench takes."""
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--json", type=Path, metavar="PATH",
                     help="write the raw record (every sample, the machine, its load) here")
    out.add_argument("--record", action="store_true",
                     help="write the raw record to docs/bench/<bench>-<date>-<n>.json (the "
                          "files python -m lab.report pools)")
    ap.add_argument("--note", default="", help="said with the run in its record")


def code_files(paths: Iterable[str], root: Path = ROOT) -> list[Path]:
    """The source files under ``paths`` (files or folders of the checkout), sorted; build
    outputs and caches left out."""
    out: set[Path] = set()
    for p in paths:
        full = root / p
        if full.is_file():
            out.add(full)
        elif full.is_dir():
            out |= {f for f in full.rglob("*") if f.is_file() and f.suffix in SOURCE_SUFFIXES
                    and "__pycache__" not in f.parts}
    return sorted(out)


def code_digest(paths: Iterable[str], root: Path = ROOT) -> tuple[str, int]:
    """sha256 over the measured files (path and bytes, in order) as they are on disk, and how
    many files that is."""
    h = hashlib.sha256()
    files = code_files(paths, root)
    for f in files:
        data = f.read_bytes()
        h.update(f"{f.relative_to(root).as_posix()}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest(), len(files)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.rstrip("\n")
    except (OSError, subprocess.SubprocessError):
        return ""


def code_state(bench: str) -> dict[str, Any]:
    paths = CODE[bench]
    digest, files = code_digest(paths)
    dirty = [line[3:] for line in _git("status", "--porcelain", "--", *paths).splitlines()]
    return {"commit": _git("rev-parse", "HEAD").strip(), "paths": list(paths), "files": files,
            "sha256": digest, "dirty": dirty}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    mem_kib = 0
    try:
        info = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        cpu = m[1].strip() if m else cpu
        mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        mem_kib = int(mem[1]) if mem else 0
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_kib / 2**20, 1),
            "system": f"{platform.system()} {platform.release()}"}


def vllm_release() -> str:
    from pdpatch.versions import vllm_version

    v = vllm_version()
    return str(v) if v else "none"


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Recorder:
    """One run's record, started when the bench starts and written when it ends (only when
    ``--json`` or ``--record`` asked for it; otherwise the bench prints as it always did)."""

    def __init__(self, bench: str, args: argparse.Namespace, argv: list[str] | None = None):
        if bench not in CODE:
            raise ValueError(f"no measured code declared for the bench {bench!r}")
        self.bench = bench
        self.path: Path | None = args.json or (next_path(bench) if args.record else None)
        argv = sys.argv[1:] if argv is None else argv
        self.data: dict[str, Any] = {
            "format": FORMAT, "bench": bench,
            "command": shlex.join(["python", "-m", f"scripts.bench_{bench}", *argv]),
            "args": {k: _plain(v) for k, v in sorted(vars(args).items())},
            "note": getattr(args, "note", ""),
            "started": _now(), "vllm": vllm_release(), "python": platform.python_version(),
            "machine": machine(),
            "env": {k: v for k, v in sorted(os.environ.items()) if ENV_KEYS.fullmatch(k)},
            "code": code_state(bench), "load": {"before": _load(), "during": []},
            "samples": {}, "derived": {},
        }
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._poll = threading.Thread(target=self._watch_load, daemon=True,
                                      name="bench-load-watch")
        if self.path is not None:
            self._poll.start()

    def _watch_load(self) -> None:
        while not self._stop.wait(LOAD_EVERY_S):
            self.data["load"]["during"].append(_load()[0])

    @property
    def samples(self) -> dict[str, Any]:
        return self.data["samples"]

    @property
    def derived(self) -> dict[str, Any]:
        return self.data["derived"]

    def finish(self) -> Path | None:
        """Writes the record (where one was asked for) and says where."""
        if self.path is None:
            return None
        self._stop.set()
        self._poll.join(timeout=1)
        self.data["load"]["after"] = _load()
        self.data["finished"] = _now()
        self.data["seconds"] = round(time.monotonic() - self._t0, 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=_plain) + "\n")
        print(f"raw record: {self.path}")
        return self.path


def next_path(bench: str, folder: Path = BENCH_DIR, day: dt.date | None = None) -> Path:
    """``<bench>-<date>-<n>.json`` with the next free ``n`` (from 1) of that bench and day."""
    day = day or dt.datetime.now(dt.timezone.utc).date()
    taken = [int(m["n"]) for p in folder.glob(f"{bench}-{day}-*.json")
             if (m := FILE_NAME.fullmatch(p.name)) and m["bench"] == bench]
    return folder / f"{bench}-{day}-{max(taken, default=0) + 1}.json"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _plain(v: Any) -> Any:
    """JSON's types for what argparse and numpy hand over."""
    if isinstance(v, Path):
        return str(v)
    if hasattr(v, "item") and callable(v.item):
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v
