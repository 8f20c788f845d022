#!/usr/bin/env bash
# Real source trees of older vLLM releases (the .py and .json files of each wheel), for tests
# that check pdpatch's version gates and patches against the code each release really shipped.
# Only the wheels' source members are transferred (lab/fetch_vllm_sources.py).
# Usage: scripts/fetch_vllm_sources.sh [VERSION...]; prints the root directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="${PDPATCH_VLLM_SOURCES:-$HOME/.cache/pdpatch/vllm-src}"
py="${PDPATCH_PYTHON:-python3}"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.19.0 0.20.2 0.21.0 0.22.1 0.23.0 0.25.1 0.28.0 0.30.0 0.32.0)
mkdir -p "$root"
"$py" "$here/lab/fetch_vllm_sources.py" "$root" "${versions[@]}" >&2
echo "$root"
