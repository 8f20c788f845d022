#!/usr/bin/env bash
# The test command: lint; the do-no-harm gate (the installed vLLM's own NIXL connector tests,
# vLLM 0.34.0's in the test venv, with pdpatch disabled and enabled, compared test by test); then
# every test of ours: unit, real-NIXL and version-matrix tests on two pytest-xdist workers, one
# per core (each old release's tests on one worker, see tests/xdist_groups.py; four workers were
# no faster: 4 releases' tests took 646 s against 614 s), then the end-to-end engine tests alone
# (they start several vLLM servers and must not share the two cores with other tests).  Extra
# arguments replace the last two steps with one pytest run taking them (e.g. -m "not e2e").
# pytest's "no tests ran" (exit 5) fails.
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then   # the comment above, nothing run
  echo "usage: bash scripts/run_tests.sh [PYTEST-ARGS...]"
  sed -n '2,/^set /p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit 0
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
py=.venv/bin/python
"$py" -m ruff check pdpatch tests scripts sitecustomize lab || exit 1

rc=0
step() {  # run pytest with "$@"; fold its status into rc (exit 5, nothing collected, fails)
  "$py" -m pytest -ra -p no:cacheprovider --durations=20 "$@"
  local s=$?
  if [ "$s" -eq 5 ]; then
    echo "run_tests: pytest collected no tests ($*) - failing" >&2
    s=1
  fi
  [ "$s" -eq 0 ] || rc=1
}

# 848 of vLLM 0.34.0's 852 pass stock here: far fewer means the suite did not run
if ! "$py" -m scripts.upstream_suites --min-stock-passed 700; then
  echo "run_tests: the do-no-harm gate failed (vLLM's own connector tests, see above)" >&2
  rc=1
fi
if [ "$#" -gt 0 ]; then
  step "$@"
else
  step -n 2 --dist loadgroup -m "not e2e"
  step -m e2e
fi
exit "$rc"
