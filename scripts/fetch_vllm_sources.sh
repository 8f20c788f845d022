#!/usr/bin/env bash
# Real source trees of older vLLM releases (the .py and .json files of each wheel), for tests
# that check pdpatch's version gates and patches against the code each release really shipped.
# Only the wheels' source members are transferred (lab/fetch_vllm_sources.py).
# Harness variables (lab/env.py): PDLAB_VLLM_SOURCES, PDLAB_PYTHON.
# Usage: scripts/fetch_vllm_sources.sh [VERSION...] (default: lab/vllm_releases.txt and the
# block-key library's older releases, scripts/block_key_releases.txt); prints the root directory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
root="$(realpath -m "${PDLAB_VLLM_SOURCES:-$HOME/.cache/pdpatch/vllm-src}")"
py="${PDLAB_PYTHON:-python3}"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || mapfile -t versions < <(grep -hv '^#' "$here/lab/vllm_releases.txt" \
  "$here/scripts/block_key_releases.txt")
mkdir -p "$root"
(cd "$here" && "$py" -m lab.fetch_vllm_sources "$root" "${versions[@]}") >&2
echo "$root"
