"""Run vLLM's own NIXL connector tests with pdpatch disabled and enabled, and compare.

    .venv/bin/python -m scripts.upstream_suites                 # the installed release (the gate)
    .venv/bin/python -m scripts.upstream_suites 0.30.0 0.32.0   # older releases, their own tests
    .venv/bin/python -m scripts.upstream_suites --all --record  # every fetched tree 0.19-0.32,
                                                                # results into docs/

Exit status 0 when every release passes: pdpatch applied at least one patch there, and every
test that passes stock also passes with pdpatch, except the deliberate differences listed in
docs/upstream_suites.md.  A release where pdpatch applied nothing (every patch off there)
compared nothing and fails; ``--force`` applies the patches unverified instead.  See
lab/upstream/suites.py for where the tests and the code come from.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from lab.upstream import suites


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("releases", nargs="*", help="vLLM releases (default: the installed one)")
    ap.add_argument("--all", action="store_true",
                    help="every release pdpatch supports whose source tree is fetched, "
                         "below the installed one")
    ap.add_argument("--work", type=Path, default=suites.CACHE / "upstream-runs",
                    help="where junit XML and logs go")
    ap.add_argument("--record", action="store_true",
                    help="write the results into the table of docs/upstream_suites.md")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    ap.add_argument("--timeout", type=int, default=300, help="per-test timeout (s)")
    ap.add_argument("--min-stock-passed", type=int, default=1,
                    help="fail a release whose stock run passes fewer tests (a gate that ran "
                         "nothing must not pass)")
    ap.add_argument("--fetch-only", action="store_true",
                    help="fetch the releases' tests (and the model configs) and stop")
    ap.add_argument("--helpers", action="store_true",
                    help="with --fetch-only: also the old releases whose unit-test helpers "
                         "the scenario tests load (suites.helper_releases)")
    ap.add_argument("--force", action="store_true",
                    help="on a release newer than pdpatch verified, apply every patch whose "
                         "range reaches it, changed code or not (PDPATCH_ALLOW_UNTESTED_VLLM=1)")
    args = ap.parse_args(argv)
    settings = {"PDPATCH_ALLOW_UNTESTED_VLLM": "1"} if args.force else {}

    installed = suites.installed_release()
    releases = list(args.releases)
    if args.all:
        releases += [v for v in suites.fetched_releases() if v != installed]
    releases = releases or [installed]
    if args.fetch_only:
        suites.hf_home()
        if args.helpers:
            releases += [v for v in suites.helper_releases() if v not in releases]
        for release in releases:
            print(suites.fetch_tests(release))
        return 0
    differences = suites.read_differences()
    rows, ok = [], True
    for release in releases:
        runs = suites.run_release(release, args.work, timeout=args.timeout, settings=settings)
        verdict = suites.compare(release, runs["stock"], runs["pdpatch"], differences)
        print(suites.describe(verdict), flush=True)
        passed = len(runs["stock"].ids("passed"))
        if passed < args.min_stock_passed:
            print(f"  FAIL: stock passed {passed} tests, fewer than --min-stock-passed "
                  f"{args.min_stock_passed}: the suite did not run", flush=True)
            ok = False
        ok &= verdict.ok
        rows.append(suites.as_row(verdict, datetime.date.today().isoformat()))
        if args.json:                                # after each release: a long run that
            args.json.write_text(json.dumps(rows, indent=2))     # stops keeps what it did
        if args.record:
            suites.record(rows[-1:])
            print(f"recorded vLLM {release} in {suites.DIFFERENCES}", flush=True)
    print(f"upstream suites: {'PASS' if ok else 'FAIL'} ({len(releases)} release(s))")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
