"""Patch ``spec_classify``: no attention KV-cache group is a clear handshake error, not a bare
``StopIteration``.

Background.  During review of vLLM PR #40731 (plan-based NIXL transfers) the
group classification used ``type(group.kv_cache_spec)``, which misses a
``UniformTypeKVCacheSpecs`` wrapping MLA specs; DeepSeek-V4's handshake then died in
``next(i for i, t in enumerate(self._group_spec_types) if _is_attention_spec(t))`` with
``StopIteration``.  That form never shipped: the first release with the refactor, 0.21.0,
already unwraps the wrapper (``nixl/utils.py::get_representative_spec_type``, L52; classes tested
with ``issubclass``, ``tp_mapping.py`` L31), and so does every release through 0.34 (0.34.0
``utils.py`` L58, ``tp_mapping.py`` L32-33).  0.19 and 0.20 predate the refactor and have no
such lookup (they classify with ``isinstance`` checks).

What remains in 0.21-0.34 is the ``next()`` itself, with no default, in
``_build_local_splits_from_plan`` (0.33 ``base_worker.py`` L295, 0.34.0 L301-303) and
``_build_fa_remote`` (0.33 L2207, 0.34.0 L2286-2288): a worker whose groups hold no attention
spec (a pure-SSM model; from 0.33 also the HiSparse-only specs, which are neither attention nor
Mamba: 0.34.0 ``kv_cache_interface.py`` L490, L527) fails every handshake with
``StopIteration()`` -- an empty message -- or, inside the generator, "generator raised
StopIteration".  This patch lets the release's builder run and, where it raised that
StopIteration and the worker's groups indeed hold no attention spec (checked with the release's
own ``_is_attention_spec``), raises a ``ValueError`` naming the group types instead.  The
handshake still fails (the release cannot build descriptors without an attention group), but
the error says why; every other outcome, errors included, is the release's own.
"""

from __future__ import annotations

from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.registry import Patch, Target, lazy_from

NAME = "spec_classify"
_code = lazy_from(f"{__name__}.wrappers")


def _targets(version: Version) -> list[Target]:
    out = []
    for table in (vllm_sites.BUILD_FA_REMOTE, vllm_sites.BUILD_LOCAL_SPLITS):
        site = vllm_sites.lookup(table, version)
        if site is not None:
            out.append(Target(site.module, site.qualname,
                              _code("make_check", site.module, version)))
    return out


PATCH = Patch(
    name=NAME,
    summary="a worker without an attention KV group fails the handshake with a clear error",
    versions=vllm_sites.supported_from("0.21"),
    why_version=("0.19/0.20 predate the plan-based transfer and have no next() lookup of the "
                 "attention group; the UniformTypeKVCacheSpecs StopIteration of PR #40731 was "
                 "fixed before 0.21.0 shipped"),
    targets=_targets,
    relies_on=(vllm_sites.SPEC_CLASSIFIERS,),
)
