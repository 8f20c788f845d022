"""vLLM's own KV-connector unit tests, run with pdpatch disabled and enabled, side by side.

The do-no-harm gate: for one vLLM release, the NIXL connector's test files from that release's
sdist run twice on the same machine -- ``ENABLE_PDPATCH=false`` (stock) and ``true`` -- and the
outcomes are compared test by test.  pdpatch passes the gate when every test that passes stock
also passes with pdpatch, except the tests listed in ``docs/upstream_suites.md`` as deliberate
differences (a stock crash that pdpatch turns into a clean per-request failure), each with its
reason.

Where the code comes from:

* the tests: the release's sdist, fetched from the package index pip is configured with and
  checked against the index's sha256 (``pip download`` of an sdist would build its metadata,
  which needs CUDA); only ``tests/`` and ``pyproject.toml`` are kept;
* the vLLM code: the installed vLLM for the venv's own release; for an older release the
  ``.py`` tree of its wheel (``scripts/fetch_vllm_sources.sh``), first on ``PYTHONPATH`` with a
  distribution record of the release, as ``tests/versions_harness.py`` runs it; each with the
  CPU-platform settings of its release (``lab/cpu_platform.py``);
* model configs: a fake offline Hugging Face cache holding the public ``config.json`` of the
  models the tests name (``lab/upstream/hf_configs/``); no weights are read by these tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from lab import cpu_platform, release_files
from lab.env import cache_dir, path_var
from lab.fetch_vllm_sources import dist_info_dir

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

CACHE = cache_dir()
TESTS_ROOT = CACHE / "vllm-tests"
HF_HOME = CACHE / "hf-home"
SOURCES_ROOT = path_var("PDLAB_VLLM_SOURCES", CACHE / "vllm-src")
OLD_DEPS = CACHE / "old-vllm-deps"
DIFFERENCES = REPO / "docs" / "upstream_suites.md"
UNIT = "tests/v1/kv_connector/unit"

# The NIXL connector's own test files (every release that has them), and the scheduler-side
# files that drive the default NixlConnector through the suite's helpers.  `*rocm*` needs ROCm.
NAMED = ("test_kv_load_failure_recovery.py", "test_tp_mapping.py",
         "test_transfer_topology_sharded.py", "test_handshake_pp_aggregation.py",
         "test_remote_prefill_lifecycle.py", "test_remote_decode_lifecycle.py",
         "test_invalid_blocks_correctness.py", "test_bidirectional_kv_transfer.py")
OUTCOMES = ("passed", "failed", "error", "skipped")
SNAPSHOT = "0" * 40


# ----------------------------------------------------------------------------- fetching


def fetch_tests(version: str) -> Path:
    """The release's ``tests/`` tree (and ``pyproject.toml``), fetched once into the cache."""
    root = TESTS_ROOT / version
    if (root / ".complete").exists():
        return root
    sdist = f"vllm-{version}.tar.gz"
    _, url, sha256 = release_files.release_file("vllm", lambda n: n == sdist)
    with tempfile.TemporaryDirectory() as tmp:
        archive = release_files.download(url, Path(tmp) / sdist, sha256)
        prefix = f"vllm-{version}/"
        keep = (prefix + "tests/", prefix + "pyproject.toml")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        with tarfile.open(archive) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(keep) and (m.isfile() or m.isdir()):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            tar.extractall(root, members=members, filter="data")
    (root / ".complete").touch()
    return root


def helper_releases() -> list[str]:
    """The listed releases whose own unit-test helpers (``tests/v1/kv_connector/unit/utils.py``:
    their real scheduler, requests and runner outputs) the scenario tests load: those of
    ``hma_failed_recv``'s range (``tests/test_hma_failed_recv.py``), which holds vllm#42895's
    (``tests/test_ssm_prefix.py``).  Fetched at setup: without them those tests skip."""
    from lab.site_fingerprints import listed_releases
    from pdpatch.patches.hma_failed_recv import PATCH

    return [v for v in listed_releases() if Version(v) in PATCH.versions]


def hf_home() -> Path:
    """A Hugging Face cache with only the config.json of the models the suites name."""
    for src in sorted((HERE / "hf_configs").glob("*.json")):
        org, name = src.stem.split("--", 1)
        repo = HF_HOME / "hub" / f"models--{org}--{name}"
        target = repo / "snapshots" / SNAPSHOT / "config.json"
        if not target.exists() or target.read_bytes() != src.read_bytes():
            target.parent.mkdir(parents=True, exist_ok=True)
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(SNAPSHOT)
            shutil.copyfile(src, target)
    return HF_HOME


def suite_files(tests_root: Path) -> list[str]:
    """The gate's test files in this release's tree (relative to its root)."""
    unit = tests_root / UNIT
    found = sorted(p.name for p in unit.glob("test_nixl_*.py") if "rocm" not in p.name)
    found += [n for n in NAMED if (unit / n).exists()]
    return [f"{UNIT}/{n}" for n in found]


# ------------------------------------------------------------------------------ running


def installed_release() -> str:
    import importlib.metadata as md

    return md.version("vllm").split("+")[0]


def _pythonpath(version: str) -> list[str]:
    """Where an older release's code comes from (see the module docstring); its wheel's
    source tree is fetched when missing."""
    if version == installed_release():
        return []
    tree = SOURCES_ROOT / version
    if not (tree / ".complete").exists():
        subprocess.run(["bash", str(REPO / "scripts" / "fetch_vllm_sources.sh"), version],
                       check=True, stdout=subprocess.DEVNULL)
    path = [str(tree), str(dist_info_dir(version))]
    if (OLD_DEPS / ".complete").exists():
        path.append(str(OLD_DEPS))
    return path


@dataclass
class SuiteRun:
    mode: str                                    # stock | pdpatch
    outcomes: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    returncode: int = 0
    log: Path | None = None
    applied: list[str] = field(default_factory=list)   # pdpatch mode: the patches in force
    settings: dict[str, str] = field(default_factory=dict)  # pdpatch mode: what it was given

    def ids(self, outcome: str) -> set[str]:
        return {t for t, o in self.outcomes.items() if o == outcome}

    def counts(self) -> dict[str, int]:
        return {o: len(self.ids(o)) for o in OUTCOMES}


def parse_junit(path: Path) -> dict[str, str]:
    """test id -> outcome from pytest's junit XML (file path + test name, as pytest prints)."""
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        parts = classname.split(".")
        # classname is "tests.v1....test_file[.Class]"; rebuild "path.py::[Class::]name"
        idx = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
        test_id = "/".join(parts[:idx + 1]) + ".py::" + "::".join([*parts[idx + 1:], name])
        tags = {child.tag for child in case}
        if "error" in tags:
            outcome = "error"
        elif "failure" in tags:
            outcome = "failed"
        elif "skipped" in tags:
            outcome = "skipped"
        else:
            outcome = "passed"
        if out.get(test_id) in ("failed", "error"):     # a teardown error after a failure
            continue
        out[test_id] = outcome
    return out


def start_suite(version: str, mode: str, files: Sequence[str], tests_root: Path,
                work: Path, port: int, timeout: int, settings: Mapping[str, str] | None = None
                ) -> tuple[subprocess.Popen, Path, Path]:
    """Launch one pytest run of ``files`` (stock or pdpatch, with ``settings`` on top: pdpatch's
    own ``PDPATCH_*`` and the gate plugin's ``PDLAB_GATE_*``) and return it unwaited."""
    junit, log = work / f"{version}-{mode}.xml", work / f"{version}-{mode}.log"
    status_file(work, version, mode).unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("PDPATCH_", "PDLAB_GATE_"))
                   or k in ("ENABLE_PDPATCH", "PYTHONPATH"))}
    # HERE: the gate's pytest plugin (``-p gate_plugin``).  Only this directory: the checkout
    # root on the child's path would put pdpatch's own ``tests`` and ``pdpatch`` in vLLM's run.
    path = [*_pythonpath(version), str(HERE)]
    env.update({
        "ENABLE_PDPATCH": "true" if mode == "pdpatch" else "false",
        "HF_HOME": str(hf_home()), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
        "TOKENIZERS_PARALLELISM": "false", "PYTHONDONTWRITEBYTECODE": "1",
        "PDLAB_GATE_STATUS": str(status_file(work, version, mode)),
    })
    env.update(settings or {})
    cpu_platform.apply(env, version)
    env["PYTHONPATH"] = os.pathsep.join(path)
    cmd = [sys.executable, "-m", "pytest", *files, "-p", "gate_plugin", "-p", "no:cacheprovider",
           "-q",
           "-o", "addopts=", "--timeout", str(timeout), f"--junitxml={junit}",
           "-W", "ignore::DeprecationWarning"]
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=tests_root, env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
    return proc, junit, log


def status_file(work: Path, version: str, mode: str) -> Path:
    return work / f"{version}-{mode}.status.json"


def applied_patches(path: Path) -> list[str]:
    """The patches pdpatch had in force in a run (the gate plugin's record; none if absent)."""
    try:
        return list(json.loads(path.read_text())["active"])
    except (OSError, ValueError, KeyError):
        return []


def run_release(version: str, work: Path, *, timeout: int = 300,
                modes: Iterable[str] = ("stock", "pdpatch"),
                settings: Mapping[str, str] | None = None,
                tests: Sequence[str] | None = None) -> dict[str, SuiteRun]:
    """Both modes of one release, concurrently (distinct NIXL side-channel ports); the pdpatch
    mode with ``settings`` (see :func:`start_suite`).  ``tests``: only these test ids."""
    tests_root = fetch_tests(version)
    files = list(tests) if tests else suite_files(tests_root)
    if not files:
        raise LookupError(f"vLLM {version}'s sdist has no NIXL connector tests under {UNIT}")
    work.mkdir(parents=True, exist_ok=True)
    started = {}
    for i, mode in enumerate(modes):
        t0 = time.monotonic()
        given = dict(settings or {}) if mode == "pdpatch" else {}
        started[mode] = (t0, given, *start_suite(version, mode, files, tests_root, work,
                                                 21000 + 1000 * i, timeout, given))
    runs = {}
    for mode, (t0, given, proc, junit, log) in started.items():
        rc = proc.wait()
        outcomes = parse_junit(junit) if junit.exists() else {}
        runs[mode] = SuiteRun(mode, outcomes, time.monotonic() - t0, rc, log,
                              applied_patches(status_file(work, version, mode)), given)
    return runs


# ---------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class Difference:
    release: str          # a release, or "*" for every release
    test: str             # test id as pytest prints it, relative to the sdist root
    reason: str


def read_differences(path: Path = DIFFERENCES) -> list[Difference]:
    """The table of deliberate differences in ``docs/upstream_suites.md``: the rows under the
    heading ``## Deliberate differences`` (``| release | test | reason |``)."""
    if not path.exists():
        return []
    rows, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            inside = line.strip() == "## Deliberate differences"
            continue
        if not inside or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("release", "") or set(cells[0]) <= {"-", ":"}:
            continue
        rows.append(Difference(cells[0], cells[1].strip("`"), cells[2]))
    return rows


@dataclass
class Verdict:
    release: str
    stock: SuiteRun
    pdpatch: SuiteRun
    lost: list[str]                  # passed stock, not with pdpatch, not a listed difference
    deliberate: list[str]            # passed stock, not with pdpatch, listed
    gained: list[str]                # passed with pdpatch only

    @property
    def compared(self) -> bool:
        """Whether the pdpatch run had any patch in force: a run without one is stock again."""
        return bool(self.pdpatch.applied)

    @property
    def ok(self) -> bool:
        stock_pass = len(self.stock.ids("passed")) - len(self.deliberate)
        return (self.compared and not self.lost
                and len(self.pdpatch.ids("passed")) >= stock_pass
                and bool(self.stock.outcomes) and bool(self.pdpatch.outcomes))


def compare(release: str, stock: SuiteRun, pdpatch: SuiteRun,
            differences: Sequence[Difference]) -> Verdict:
    listed = {d.test for d in differences if d.release in (release, "*")}
    dropped = sorted(stock.ids("passed") - pdpatch.ids("passed"))
    return Verdict(release, stock, pdpatch,
                   lost=[t for t in dropped if t not in listed],
                   deliberate=[t for t in dropped if t in listed],
                   gained=sorted(pdpatch.ids("passed") - stock.ids("passed")))


def describe(v: Verdict) -> str:
    """The printed report of one release."""
    s, p = v.stock.counts(), v.pdpatch.counts()
    given = " ".join(f"{k}={val}" for k, val in sorted(v.pdpatch.settings.items()))
    lines = [f"vLLM {v.release}: {len(v.stock.outcomes)} tests",
             f"  pdpatch applied {len(v.pdpatch.applied)} patch(es)"
             + (f" with {given}" if given else "") + ": "
             + (", ".join(v.pdpatch.applied) or
                "none -- NOTHING WAS COMPARED (every patch off on this release; "
                "--force applies them unverified)"),
             f"  stock   : {s['passed']} passed, {s['failed']} failed, {s['error']} errors, "
             f"{s['skipped']} skipped ({v.stock.seconds:.0f} s)",
             f"  pdpatch : {p['passed']} passed, {p['failed']} failed, {p['error']} errors, "
             f"{p['skipped']} skipped ({v.pdpatch.seconds:.0f} s)"]
    for title, ids in (("passing stock, failing with pdpatch", v.lost),
                       ("deliberate differences (docs/upstream_suites.md)", v.deliberate),
                       ("passing only with pdpatch", v.gained)):
        if ids:
            lines.append(f"  {title}: {len(ids)}")
            lines += [f"    {t}" for t in ids]
    stock_only_fail = sorted((v.stock.ids("failed") | v.stock.ids("error"))
                             & (v.pdpatch.ids("failed") | v.pdpatch.ids("error")))
    if stock_only_fail:
        lines.append(f"  failing in both modes: {len(stock_only_fail)}")
        lines += [f"    {t}" for t in stock_only_fail]
    lines.append(f"  verdict: {'PASS' if v.ok else 'FAIL'}"
                 + ("" if v.compared else " (nothing compared)"))
    return "\n".join(lines)


def as_row(v: Verdict, when: str) -> Mapping[str, object]:
    s, p = v.stock.counts(), v.pdpatch.counts()
    return {"release": v.release, "tests": len(v.stock.outcomes), "stock": s, "pdpatch": p,
            "applied": v.pdpatch.applied, "settings": v.pdpatch.settings,
            "lost": v.lost, "deliberate": v.deliberate, "gained": v.gained, "ok": v.ok,
            "run": when}


# ----------------------------------------------------------------------------- recording

RESULTS_HEADING = "## Results"
RESULTS_HEADER = ("| vLLM | tests | patches applied | stock passed | pdpatch passed | "
                  "lost with pdpatch | deliberate | gained with pdpatch | verdict | last run |\n"
                  "|---|---|---|---|---|---|---|---|---|---|")


def fetched_releases() -> list[str]:
    """The newest fetched release of each minor pdpatch supports (``scripts/
    fetch_vllm_sources.sh`` also fetches older trees for the block-key library, whose NIXL
    connectors pdpatch does not patch, and a leftover older patch release must not run twice),
    oldest first."""
    from packaging.version import Version

    from pdpatch.vllm_sites import SUPPORTED

    if not SOURCES_ROOT.is_dir():
        return []
    found = sorted(Version(d.name) for d in SOURCES_ROOT.iterdir()
                   if (d / ".complete").exists() and Version(d.name) in SUPPORTED)
    newest = {v.release[:2]: v for v in found}
    return [str(v) for v in newest.values()]


def _row(r: Mapping[str, object]) -> str:
    s, p = r["stock"], r["pdpatch"]
    return (f"| {r['release']} | {r['tests']} | {len(r['applied'])} | {s['passed']} | "
            f"{p['passed']} | "
            f"{len(r['lost'])} | {len(r['deliberate'])} | {len(r['gained'])} | "
            f"{'pass' if r['ok'] else 'FAIL'} | {r['run']} |")


NOT_RECORDED = "not recorded"
"""The cell of a column a kept row's run did not record (the column came later)."""


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def record(rows: Sequence[Mapping[str, object]], path: Path = DIFFERENCES) -> None:
    """Put ``rows`` into the results table of ``path`` (one row per release, newest run
    wins), keeping every other part of the file.

    A kept row is rewritten under :data:`RESULTS_HEADER`, cell by column name, so a table
    recorded before a column was added stays one table: the new column's cell in the old rows
    says :data:`NOT_RECORDED`.  A kept row whose cells do not match its table's header, or a
    table column the header no longer has, is an error rather than a table that cannot be
    read."""
    from packaging.version import Version

    text = path.read_text()
    start = text.index(RESULTS_HEADING)
    end = text.find("\n## ", start + len(RESULTS_HEADING))
    end = len(text) if end < 0 else end + 1
    section = text[start:end]
    columns = _cells(RESULTS_HEADER.splitlines()[0])
    old_columns = columns
    table: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = _cells(line)
        if cells[0] == columns[0]:
            old_columns = cells
            dropped = set(old_columns) - set(columns)
            if dropped:
                raise ValueError(f"{path}: the results table has columns the header no "
                                 f"longer has: {sorted(dropped)}")
        elif cells[0][:1].isdigit():
            if len(cells) != len(old_columns):
                raise ValueError(f"{path}: {len(cells)} cells under a header of "
                                 f"{len(old_columns)}: {line}")
            by_name = dict(zip(old_columns, cells, strict=True))
            table[cells[0]] = "| " + " | ".join(by_name.get(c, NOT_RECORDED)
                                                for c in columns) + " |"
    for r in rows:
        table[str(r["release"])] = _row(r)
    intro = section.split("\n|", 1)[0].rstrip("\n")
    body = "\n".join(table[k] for k in sorted(table, key=Version))
    text = text[:start] + f"{intro}\n\n{RESULTS_HEADER}\n{body}\n\n" + text[end:]
    path.write_text(text)
