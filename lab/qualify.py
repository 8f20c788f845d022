"""Qualify a vLLM release for pdpatch in one command: what each patch would do there, and whether
it does harm.

    python -m scripts.qualify 0.35.0                  # a release newer than pdpatch verified
    python -m scripts.qualify 0.34.0 --against 0.33.0 # as on the day 0.34.0 appeared

For each patch, against its newest verified release (``--against``: as if that release were the
newest pdpatch verified, with the patch as declared there):

* **targets**: each target the patch wraps there, looked up in the new release's sources: it
  wraps, its target is missing, or its signature changed;
* **sites**: the fingerprint of every site the patch rests on (:mod:`pdpatch.verified`): a patch
  whose sites are all identical applies by itself on the new release; a diff of each changed
  site's code (comments and docstrings left out) is in the report;
* **tests lost**: vLLM's own connector tests of the new release (its sdist), stock and with
  pdpatch's patches forced on as declared for the reference release, compared test by test; a
  test lost with pdpatch is attributed to the patch that loses it alone;
* **scenarios**: pdpatch's per-release tests run on the new release's code (the patches forced
  on), each failing test named under the patch it belongs to.

The report goes to ``docs/qualify/<release>.md`` when every step ran, and only then (the bad
inputs -- no version, a local build, a release the index lacks, no NIXL connector tests, a
network failure -- stop it first, exit status 2, with what is missing).  Exit status 1 when the
release does not qualify clean.  A release that qualifies clean needs one line changed to be
supported: ``SUPPORTED`` in ``pdpatch/vllm_sites.py``.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from lab import fetch_vllm_sources
from lab.env import cache_dir, path_var
from lab.upstream import suites
from pdpatch import verified
from pdpatch.patches import all_patches
from pdpatch.registry import Patch
from pdpatch.site_sources import SourceTree, canonical, readable
from pdpatch.versions import release_of, vllm_version
from pdpatch.vllm_sites import NEWEST_SUPPORTED, newer_than_verified

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "qualify"
SOURCES_ROOT = path_var("PDLAB_VLLM_SOURCES", cache_dir() / "vllm-src")
WORK = cache_dir() / "qualify"
QUALIFY_VAR = "PDLAB_QUALIFY_RELEASE"
# Per-release test modules whose name does not contain the patch they check.
SCENARIO_PATCHES = {
    "test_do_no_harm": ("(every patch)",),
    "test_release_matrix": ("(every patch)",),
    "test_kvcached_matrix": ("layout", "num_blocks"),
    "test_robustness_full_hit": ("handshake_failure_guard",),
    "test_robustness_handshake": ("handshake_failure_guard",),
    "test_robustness_rejected": ("params_guard", "readback_guard"),
    "test_robustness_peer": ("peer_check",),
    "test_robustness_division": ("division_checks",),
    "test_robustness_spec": ("spec_classify",),
    "test_robustness_params": ("params_check",),
    "test_robustness_block_ids": ("block_ids_bound",),
    "test_robustness_lease": ("lease_guard",),
    "test_robustness_side_channel": ("side_channel_listen",),
}


class BadInput(Exception):
    """What the command cannot qualify, and why: exit status 2, nothing written."""


@dataclass
class SiteResult:
    label: str
    status: str                      # identical | changed | missing
    diff: str = ""


@dataclass
class PatchResult:
    name: str
    reference: Version | None        # the release it is compared against (None: not applicable)
    note: str = ""                   # why it is not applicable
    targets: list[tuple[str, str]] = field(default_factory=list)   # (label, wraps|...)
    sites: list[SiteResult] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    scenarios: list[str] = field(default_factory=list)

    @property
    def by_itself(self) -> bool:
        return self.reference is not None and all(s.status == "identical" for s in self.sites)

    @property
    def clean(self) -> bool:
        return self.reference is None or (
            all(status == "wraps" for _, status in self.targets)
            and not self.lost and not self.scenarios)


def check_release(text: str) -> str:
    """The release to qualify, as the package index names it; BadInput otherwise."""
    try:
        version = Version(text.strip())
    except InvalidVersion:
        raise BadInput(f"{text!r} is not a vLLM release (e.g. 0.35.0)") from None
    if version.local:
        raise BadInput(f"{text} is a local build ('+{version.local}'); qualify the release it "
                       f"was built from, {version.public}, as the package index has it")
    return str(version)


def fetch(release: str) -> tuple[Path, Path]:
    """(its source tree's root, its sdist's tests) -- BadInput where the index has neither."""
    try:
        fetch_vllm_sources.fetch(SOURCES_ROOT, release)
        tests = suites.fetch_tests(release)
    except LookupError as exc:
        raise BadInput(f"vLLM {release}: {exc} (no wheel or sdist of it on the index)") from None
    except OSError as exc:
        raise BadInput(f"vLLM {release}: fetching from the package index failed: {exc}") from None
    if not suites.suite_files(tests):
        raise BadInput(f"vLLM {release}'s sdist has no NIXL connector tests under {suites.UNIT}")
    return SOURCES_ROOT / release, tests


def tree_of(release: Version) -> Path:
    """The source root of a verified release: its fetched tree, or the venv's own vLLM."""
    installed = vllm_version()
    if installed is not None and release_of(installed) == release:
        return verified.installed_root()
    tree = SOURCES_ROOT / str(release)
    if not (tree / "vllm" / "__init__.py").exists():
        raise BadInput(f"no source tree of vLLM {release} under {SOURCES_ROOT}: run "
                       f"scripts/fetch_vllm_sources.sh {release}")
    return tree


def reference_of(patch: Patch, release: Version, against: Version | None) -> tuple[Version | None,
                                                                                  str]:
    """The release ``patch`` is compared against on ``release``, or None and why not."""
    if against is not None:
        if against in patch.versions:
            return against, ""
        return None, f"not in force on {against} ({patch.versions})"
    if not newer_than_verified(patch.versions, release):
        why = f": {patch.why_version}" if patch.why_version else ""
        return None, f"range {patch.versions} ends before {release}{why}"
    return verified.newest_verified(patch), ""


def _signature(tree: SourceTree, module: str, qualname: str) -> str | None:
    node = tree.node(module, qualname)
    args = getattr(node, "args", None)
    return canonical(args) if args is not None else None


def static_result(patch: Patch, reference: Version, old: SourceTree, new: SourceTree
                  ) -> PatchResult:
    """Targets and sites of ``patch`` as declared for ``reference``, in the new tree."""
    result = PatchResult(patch.name, reference)
    for target in patch.targets(reference):
        label = verified.label(target.module, target.qualname)
        if new.node(target.module, target.qualname) is None:
            status = "target missing"
        elif _signature(old, target.module, target.qualname) != \
                _signature(new, target.module, target.qualname):
            status = "signature changed"
        else:
            status = "wraps"
        result.targets.append((label, status))
    for module, qualname in patch.sites(reference):
        label = verified.label(module, qualname)
        before, after = old.fingerprint(module, qualname), new.fingerprint(module, qualname)
        if after is None:
            result.sites.append(SiteResult(label, "missing"))
        elif before == after:
            result.sites.append(SiteResult(label, "identical"))
        else:
            diff = difflib.unified_diff(
                (readable(module, qualname, old) or "").splitlines(),
                (readable(module, qualname, new) or "").splitlines(),
                str(reference), "new", lineterm="", n=2)
            result.sites.append(SiteResult(label, "changed", "\n".join(diff)))
    return result


def gate_settings(against: Version | None) -> dict[str, str]:
    """The gate's pdpatch run reads the reference release as the installed one: every patch in
    force there applies, with its targets and version facts as declared for it -- what pdpatch
    would do if it took the new release for the reference (``PDLAB_GATE_PRETEND_VLLM``)."""
    return {"PDLAB_GATE_PRETEND_VLLM": str(against or NEWEST_SUPPORTED)}


def run_gate(release: str, settings: dict[str, str], applied: list[str]
             ) -> tuple[suites.Verdict, dict[str, list[str]]]:
    """vLLM's connector tests stock vs pdpatch; each lost test re-run with each patch alone."""
    runs = suites.run_release(release, WORK / release / "gate", settings=settings)
    verdict = suites.compare(release, runs["stock"], runs["pdpatch"], suites.read_differences())
    by_patch: dict[str, list[str]] = {}
    if verdict.lost:
        for name in runs["pdpatch"].applied or applied:
            alone = {**settings, "PDPATCH_DISABLE": "*", f"PDPATCH_{name.upper()}": "1"}
            run = suites.run_release(release, WORK / release / f"alone-{name}",
                                     modes=("pdpatch",), settings=alone,
                                     tests=verdict.lost)["pdpatch"]
            failing = sorted(t for t in verdict.lost if run.outcomes.get(t) != "passed")
            if failing:
                by_patch[name] = failing
    return verdict, by_patch


def run_scenarios(release: str) -> tuple[int, dict[str, list[str]]]:
    """pdpatch's per-release tests on ``release``: (tests run, failing ids by test module)."""
    junit = WORK / release / "scenarios.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, QUALIFY_VAR: release}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-m", "not e2e",
         "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", "tests"],
        cwd=ROOT, env=env, capture_output=True, text=True)
    if not junit.exists():
        raise RuntimeError(f"the per-release tests did not run (rc {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    outcomes = suites.parse_junit(junit)
    failing: dict[str, list[str]] = {}
    for test, outcome in outcomes.items():
        if outcome in ("failed", "error"):
            module = test.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
            failing.setdefault(module, []).append(test)
    return len(outcomes), failing


def scenario_owner(module: str, names: list[str]) -> list[str]:
    """The patches a per-release test module checks ([] where no patch is named: the hashing
    library's release tests, say)."""
    named = SCENARIO_PATCHES.get(module)
    if named == ("(every patch)",):
        return names
    if named is not None:
        return [n for n in named if n in names]
    return [n for n in names if n in module]


def qualify(release: str, against: str | None, scenarios: bool = True) -> tuple[str, bool]:
    """The report (markdown) and whether the release qualifies clean."""
    started = time.monotonic()
    version = Version(release)
    ref_version = Version(against) if against else None
    new_root, _ = fetch(release)
    new = SourceTree(new_root)
    trees: dict[Version, SourceTree] = {}
    results = []
    for patch in all_patches():
        reference, note = reference_of(patch, version, ref_version)
        if reference is None:
            results.append(PatchResult(patch.name, None, note))
            continue
        if reference not in trees:
            trees[reference] = SourceTree(tree_of(reference))
        results.append(static_result(patch, reference, trees[reference], new))
    applicable = [r.name for r in results if r.reference is not None]
    settings = gate_settings(ref_version)
    verdict, lost_by = run_gate(release, settings, applicable)
    for r in results:
        r.lost = lost_by.get(r.name, [])
    unattributed = sorted(set(verdict.lost) - {t for ts in lost_by.values() for t in ts})
    ran, failing = 0, {}
    installed = vllm_version()
    scenario_note = ""
    if not scenarios:
        scenario_note = "not run (--no-scenarios)"
    elif installed is not None and release_of(installed) == version:
        scenario_note = (f"vLLM {release} is the venv's own release: its per-release tests are "
                         "the in-process tests every CI run makes, with the current code")
    else:
        ran, failing = run_scenarios(release)
        for module, tests in failing.items():
            owners = scenario_owner(module, applicable)
            if not owners:
                unattributed += tests
            for r in results:
                if r.name in owners:
                    r.scenarios += tests
    clean = verdict.ok and not unattributed and all(r.clean for r in results) \
        and not (scenarios and not scenario_note and not ran)
    report = render(release, against, results, verdict, settings, unattributed, ran,
                    scenario_note, time.monotonic() - started, clean)
    return report, clean


def render(release: str, against: str | None, results: list[PatchResult],
           verdict: suites.Verdict, settings: dict[str, str], unattributed: list[str],
           scenarios_run: int, scenario_note: str, seconds: float, clean: bool) -> str:
    """The report as markdown: one table row per patch, then what changed in each site."""
    s, p = verdict.stock.counts(), verdict.pdpatch.counts()
    given = ", ".join(f"`{k}={v}`" for k, v in sorted(settings.items()))
    lines = [
        f"# Qualification of vLLM {release}",
        "",
        f"`python -m scripts.qualify {release}" + (f" --against {against}`" if against else "`")
        + f" ({seconds / 60:.0f} min).  Each patch against "
        + (f"vLLM {against}, as if that were the newest release pdpatch verified, with the patch "
           "as declared there." if against else "its newest verified release."),
        "",
        f"**Verdict: {'qualifies clean' if clean else 'does NOT qualify clean'}.**",
        "",
        f"vLLM's own connector tests ({len(verdict.stock.outcomes)}): stock {s['passed']} passed, "
        f"pdpatch {p['passed']} passed with {len(verdict.pdpatch.applied)} patch(es) in force "
        f"({given}); lost with pdpatch: {len(verdict.lost)}"
        + ".",
        "",
        "Failing, no single patch named: "
        + (", ".join(f"`{t}`" for t in unattributed) if unattributed else "none") + ".",
        "",
        "Per-release scenarios: " + (scenario_note or f"{scenarios_run} tests run on {release}."),
        "",
        "| patch | against | applies by itself | targets | sites changed | tests lost | "
        "scenarios failing |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.reference is None:
            lines.append(f"| `{r.name}` | — | no: {r.note} | — | — | — | — |")
            continue
        targets = ", ".join(sorted({status for _, status in r.targets})) or "none"
        changed = [x for x in r.sites if x.status != "identical"]
        lines.append(
            f"| `{r.name}` | {r.reference} | {'yes' if r.by_itself else 'no'} | {targets} | "
            + (", ".join(f"`{x.label.rsplit(':', 1)[1]}` ({x.status})" for x in changed)
               or "none")
            + f" | {len(r.lost) or 'none'} | {len(r.scenarios) or 'none'} |")
    for r in results:
        detail = [t for t in r.lost] + [t for t in r.scenarios]
        changed = [x for x in r.sites if x.status != "identical"]
        bad_targets = [(label, st) for label, st in r.targets if st != "wraps"]
        if not (detail or changed or bad_targets):
            continue
        lines += ["", f"## `{r.name}`", ""]
        lines += [f"* target `{label}`: {st}" for label, st in bad_targets]
        lines += [f"* lost with this patch alone: `{t}`" for t in r.lost]
        lines += [f"* scenario failing: `{t}`" for t in r.scenarios]
        for x in changed:
            lines += ["", f"`{x.label}` ({x.status}):"]
            if x.diff:
                lines += ["", "```diff", x.diff, "```"]
    return "\n".join(lines) + "\n"


def write_report(release: str, text: str) -> Path:
    """All at once, at the end: an interrupted run leaves the docs as they were."""
    DOCS.mkdir(parents=True, exist_ok=True)
    out = DOCS / f"{release}.md"
    with tempfile.NamedTemporaryFile("w", dir=DOCS, suffix=".tmp", delete=False) as fh:
        fh.write(text)
    Path(fh.name).replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release", help="the vLLM release to qualify, as on the package index")
    ap.add_argument("--against", help="qualify as if this release were the newest pdpatch "
                                      "verified (the patches as declared for it)")
    ap.add_argument("--no-scenarios", action="store_true",
                    help="skip pdpatch's per-release tests (static checks and the gate only)")
    ap.add_argument("--no-write", action="store_true", help="print the report only")
    args = ap.parse_args(argv)
    try:
        release = check_release(args.release)
        against = check_release(args.against) if args.against else None
        if against is not None and Version(against) >= Version(release):
            raise BadInput(f"--against {against} is not older than {release}")
        report, clean = qualify(release, against, scenarios=not args.no_scenarios)
    except BadInput as exc:
        print(f"qualify: {exc}", file=sys.stderr)
        return 2
    print(report)
    if not args.no_write:
        print(f"wrote {write_report(release, report)}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
