#!/usr/bin/env bash
# The test command: lint, then every test (unit, real-NIXL, version matrix, e2e engines).
# Extra arguments go to pytest (e.g. -m "not e2e").  pytest's "no tests ran" (exit 5) fails.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"
py=.venv/bin/python
"$py" -m ruff check pdpatch tests scripts sitecustomize || exit 1
"$py" -m pytest -ra -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests - failing" >&2
  exit 1
fi
exit "$rc"
