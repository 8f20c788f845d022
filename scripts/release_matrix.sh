#!/usr/bin/env bash
# The per-release tests on every fetched vLLM release (the test command runs them on the
# oldest, the newest and every release where a version-keyed fact of pdpatch changes; see
# tests/versions_harness.py: change_points).  Appends a dated row to docs/release_matrix.md.
# ~55 min on a 2-core machine.  Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
log=$(mktemp)
PDLAB_FULL_MATRIX=1 .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup \
  -m "not e2e" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1 | tr -d '=')
releases=$(cd tests && ../.venv/bin/python -c "import versions_harness as h; print(' '.join(h.available_versions()))")
printf '| %s | %s | %s | %s | %s min | %s |\n' "$(date -u +%F)" "$(git rev-parse --short HEAD)" \
  "$releases" "$summary" "$(( ($(date +%s) - start) / 60 ))" "$([ "$rc" -eq 0 ] && echo pass || echo FAIL)" \
  >> docs/release_matrix.md
exit "$rc"
