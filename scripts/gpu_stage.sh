#!/usr/bin/env bash
# Build .gpu_stage/vllm-0.25.1/: real vLLM 0.25.1 GPU engines, NIXL and the packages vLLM needs,
# small enough to travel to the device machine in one run (see lab/gpu/stage.py).  Checks the
# size of what a run carries and fails when it is over the limit.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m lab.gpu.stage "$@"
