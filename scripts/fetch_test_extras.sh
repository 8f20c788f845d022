#!/usr/bin/env bash
# Extra real code the version-matrix tests need, kept outside the venv:
#  * old-vllm-deps/: third-party modules vLLM releases <=0.23 import at `import vllm` (gguf,
#    diskcache) that the 0.33 venv no longer has;
#  * kvcached-src/0.1.6/: kvcached 0.1.6's pure-Python tree (its own NixlConnector patch), from its
#    sdist.  The sdist's metadata step imports torch's CUDA build helpers, so pip reads it with a
#    stand-in `torch` on PYTHONPATH (only for that step; nothing is built or installed).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${PDLAB_CACHE_DIR:-$HOME/.cache/pdpatch}"
pip="${1:-$here/.venv/bin/pip}"   # setup_env.sh passes the venv it is building
[ -x "$pip" ] || pip="pip"

deps="$cache/old-vllm-deps"
if [ ! -f "$deps/.complete" ]; then
  "$pip" install -q --no-deps --target "$deps" gguf==0.19.0 diskcache==5.6.3
  touch "$deps/.complete"
fi

kv="$cache/kvcached-src/0.1.6"
if [ ! -f "$kv/kvcached/integration/vllm/nixl_compat.py" ]; then
  tmp=$(mktemp -d)
  mkdir -p "$tmp/stub/torch/utils" "$tmp/dl"
  cat > "$tmp/stub/torch/__init__.py" <<'PY'
__version__ = "2.11.0"
version = type("version", (), {"cuda": "13.0", "hip": None})()
class cuda:
    @staticmethod
    def is_available():
        return False
class _C:
    _GLIBCXX_USE_CXX11_ABI = True
PY
  : > "$tmp/stub/torch/utils/__init__.py"
  cat > "$tmp/stub/torch/utils/cpp_extension.py" <<'PY'
from setuptools import Extension
from setuptools.command.build_ext import build_ext as BuildExtension
CUDA_HOME, ROCM_HOME = "/usr/local/cuda", None
def CUDAExtension(name, sources, *a, **k): return Extension(name, sources=[])
def CppExtension(name, sources, *a, **k): return Extension(name, sources=[])
def include_paths(*a, **k): return []
def library_paths(*a, **k): return []
PY
  PYTHONPATH="$tmp/stub" "$pip" download -q --no-deps --no-binary :all: --no-build-isolation \
      kvcached==0.1.6 -d "$tmp/dl"
  tar -xzf "$tmp"/dl/kvcached-0.1.6.tar.gz -C "$tmp"
  rm -rf "$kv"; mkdir -p "$kv"
  cp -r "$tmp/kvcached-0.1.6/kvcached" "$kv/"
  rm -rf "$tmp"
fi
