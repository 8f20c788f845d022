#!/usr/bin/env bash
# Real source trees of older vLLM releases (the .py files of each wheel), for tests that check
# pdpatch's version gates and patches against the code each release really shipped.
# Usage: scripts/fetch_vllm_sources.sh [VERSION...]; prints the root directory.
set -euo pipefail
root="${PDPATCH_VLLM_SOURCES:-$HOME/.cache/pdpatch/vllm-src}"
py="${PDPATCH_PYTHON:-python3}"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.19.0 0.20.2 0.21.0 0.22.1 0.23.0 0.25.1 0.28.0 0.30.0 0.32.0)
mkdir -p "$root"
for v in "${versions[@]}"; do
  [ -f "$root/$v/.complete" ] && continue
  tmp=$(mktemp -d)
  pip download -q --no-deps "vllm==$v" -d "$tmp" 2>/dev/null
  rm -rf "$root/$v"; mkdir -p "$root/$v"
  "$py" - "$tmp"/vllm-*.whl "$root/$v" <<'PY'
import sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith("vllm/") and (name.endswith(".py") or name.endswith(".json")):
            z.extract(name, dest)
PY
  rm -rf "$tmp"
  touch "$root/$v/.complete"
done
echo "$root"
