"""pdpatch's version gates (``VersionRange``) answer exactly as packaging's ``SpecifierSet``
does (``contains(release_of(v), prereleases=True)``, what the gates used before), on every
range pdpatch declares and on random ones."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.patches import all_patches
from pdpatch.versions import VersionRange, release_of

SUFFIXES = ("", "rc1", ".post1", ".dev3", "+cpu", "+cu129", "a2")
VERSIONS = [Version(f"0.{minor}{patch}{suffix}")
            for minor, patch, suffix in itertools.product(
                range(17, 37), ("", ".0", ".1", ".2.3"), SUFFIXES)] + [Version("1.0"),
                                                                        Version("0")]


def declared_ranges() -> list[VersionRange]:
    found = [p.versions for p in all_patches()]
    for value in vars(vllm_sites).values():
        if isinstance(value, VersionRange):
            found.append(value)
        elif isinstance(value, tuple):
            for item in value:
                if isinstance(item, vllm_sites.Site):
                    found.append(item.versions)
                elif isinstance(item, tuple) and item and isinstance(item[0], VersionRange):
                    found.append(item[0])
    return found


def stock_answer(spec: str, version: Version) -> bool:
    return SpecifierSet(spec).contains(release_of(version), prereleases=True)


def test_every_declared_range_answers_like_specifierset():
    ranges = declared_ranges()
    assert len(ranges) > 30          # patches, sites and the per-release tables
    for r in ranges:
        assert str(r) == str(SpecifierSet(str(r)))
        for v in VERSIONS:
            assert (v in r) == stock_answer(str(r), v), (str(r), v)


CLAUSE = st.tuples(st.sampled_from([">=", "<=", ">", "<", "==", "!="]),
                   st.lists(st.integers(0, 40), min_size=1, max_size=3))


@given(st.lists(CLAUSE, min_size=1, max_size=3))
@example([(">=", [0]), (">=", [0, 0])])      # equal bounds written two ways: one clause
@example([("<", [1, 0]), ("<", [1])])
def test_random_ranges_answer_like_specifierset(clauses):
    spec = ",".join(op + ".".join(map(str, parts)) for op, parts in clauses)
    r = VersionRange(spec)
    assert str(r) == str(SpecifierSet(spec))
    for v in VERSIONS[::3]:
        assert (v in r) == stock_answer(spec, v), (spec, v)


@pytest.mark.parametrize("spec", ["~=0.19", "==0.19.*", ">=0.19rc1", "===0.19", ">=0.19,",
                                  "0.19", ">= x"])
def test_what_specifierset_means_differently_is_refused_when_declared(spec):
    with pytest.raises(ValueError, match="version range"):
        VersionRange(spec)


def test_release_parsing_and_bounds():
    from packaging.version import InvalidVersion

    from pdpatch.versions import parse_release

    for text in ("0.33.0", "v0.33", " 0.33.0+cpu ", Version("0.33"), "0.33.0.1"):
        assert parse_release(text) == Version("0.33.0"), text
    assert parse_release("0.34.0rc1") == Version("0.34.0")
    with pytest.raises(InvalidVersion):
        parse_release("latest")
    assert (VersionRange(">=0.19,<0.34").lower(), VersionRange("<0.34").lower()) == \
        (Version("0.19"), None)


def test_newest_supported_is_the_last_release_of_supported(monkeypatch):
    from pdpatch import versions

    newest = vllm_sites.NEWEST_SUPPORTED
    upper = vllm_sites.SUPPORTED.upper()
    assert newest in vllm_sites.SUPPORTED
    assert upper == Version(f"{newest.major}.{newest.minor + 1}")
    assert str(vllm_sites.supported_until("0.21")) == "<0.21,>=0.19"
    monkeypatch.setattr(versions, "vllm_version", lambda: None)
    assert vllm_sites.running_release() == newest
    monkeypatch.setattr(versions, "vllm_version", lambda: Version("0.25.1"))
    assert vllm_sites.running_release() == Version("0.25.1")
