"""How each vLLM release's CPU platform is run by the harness on this x86 machine without
triton-cpu: the one place for those facts (``versions_harness``, the upstream gate, the test
session, the rig's engines).

* Up to 0.33 a CPU run needs no Triton; releases up to 0.24 pick their platform from the
  distribution's version string, so a release run from its source tree is recorded as
  ``<release>+cpu`` (``lab.fetch_vllm_sources.dist_info_dir``).
* From 0.34 ``CpuPlatform.check_and_update_config`` refuses an x86 CPU without Triton.  Unit code
  (vLLM's connector tests, pdpatch's in-process tests) gets the CUDA ``triton`` wheel of the venv
  with ``CUDA_VISIBLE_DEVICES=""``: vLLM's own lenient branch for a distributed environment
  (``vllm/triton_utils/importing.py``) then reports Triton present, as the issue that moved the
  venv to 0.34 measured (848 of 852 connector tests pass stock).  A ``+cpu`` version would send
  that check down its triton-cpu branch instead, which disables Triton: those releases are
  recorded plain.  Engines cannot run Triton kernels here; they take vLLM's standalone CPU runner
  (``lab/rig/cpu_runner``) and never see the variable.
* Releases before 0.34 must not see ``CUDA_VISIBLE_DEVICES=""``: their checks would report a
  Triton that cannot run.
"""

from __future__ import annotations

from packaging.version import Version

TRITON_FROM = Version("0.34")


def needs_triton(release: str | Version) -> bool:
    return Version(str(release).split("+")[0]) >= TRITON_FROM


def local_version(release: str) -> str:
    """The version a release run from its source tree is recorded as."""
    return release if needs_triton(release) else f"{release}+cpu"


def unit_env(release: str | Version) -> dict[str, str | None]:
    """What a process running ``release``'s unit code sets (a value) or drops (None)."""
    return {"CUDA_VISIBLE_DEVICES": "" if needs_triton(release) else None}


def apply(env: dict[str, str], release: str | Version) -> dict[str, str]:
    """``env`` with :func:`unit_env` applied, in place; returns it."""
    for name, value in unit_env(release).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env
