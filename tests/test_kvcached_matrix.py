"""The kvcached-compatibility checks against the real source of each vLLM release (subprocesses;
see ``kvc_matrix.py`` for what each check does and how old releases are loaded)."""

from __future__ import annotations

import kvc_matrix as m
import pytest
from packaging.version import Version
from versions_harness import releases_in

from pdpatch.patches import layout, num_blocks

RELEASES = [v for v in releases_in(layout.PATCH.versions) if v in
            releases_in(num_blocks.PATCH.versions)] + [m.INSTALLED]


def variants(version: str) -> list[str]:
    """kvcached's memory forms each release's own descriptor code can address: K/V-first
    tensors (FlashAttention's (2, N, ...), 0.19-0.22) only split-half, blocks-first ones
    (0.23-0.25) K|V interleaved per block, packed pages (0.26+) per layer, and
    layer-interleaved rows once per-region block strides exist (0.29+)."""
    v = Version(version)
    if v < Version("0.23"):
        return ["split-half"]
    if v < Version("0.26"):
        return ["kv-interleaved"]
    if v < Version("0.29"):
        return ["per-layer"]
    return ["per-layer", "layer-interleaved"]


def expected_checks(version: str) -> set[str]:
    names = {"installed", "under_allocated_fails_clearly", "layout_classmethod",
             "layout_in_force", "layout_forced_failure_names_component"}
    for variant in variants(version):
        names |= {f"stock_rejects_over_allocation[{variant}]",
                  f"over_allocated_registers_the_plan[{variant}]",
                  f"peer_descriptors_resolve[{variant}]"}
    if Version(version) < Version("0.20"):
        names |= {"hetero_tp_token_major_rejected", "stock_accepts_hetero_tp_token_major"}
    return names | {"under_allocated_without_kvcached_is_the_releases_own"}


def _run(version: str, order: str | None = None) -> dict[str, str]:
    if version != m.INSTALLED and m.source_tree(version) is None:
        pytest.skip(f"no vLLM {version} source tree under {m.SOURCES} "
                    f"(run scripts/fetch_vllm_sources.sh)")
    try:
        return m.run(version, order)
    except RuntimeError as exc:
        if "No module named 'gguf'" in str(exc):
            pytest.skip(f"vLLM {version} imports gguf; install it or put it in {m.OLD_DEPS}")
        raise


@pytest.mark.parametrize("version", RELEASES)
def test_release(version):
    results = _run(version)
    failed = {k: v for k, v in results.items() if not v.startswith("ok")}
    assert not failed, failed
    assert set(results) == expected_checks(version)


@pytest.mark.parametrize("order", ["kvcached-first", "pdpatch-first"])
def test_with_kvcacheds_real_nixl_patch(order):
    """kvcached 0.1.6's own nixl_compat.py (pure Python) applied before or after pdpatch:
    alone it cannot register over-allocated views on the installed release; with pdpatch,
    exactly the plan is registered and advertised, and pdpatch's reconciliation is the one in
    effect."""
    if not m.kvcached_available():
        pytest.skip(f"kvcached 0.1.6 source not at {m.KVCACHED_SRC}")
    results = _run(m.INSTALLED, order)
    failed = {k: v for k, v in results.items() if not v.startswith("ok")}
    assert not failed, failed
    expected = {"installed", "under_allocated_fails_clearly", "pdpatch_in_charge",
                "layout_with_kvcached_patch"}
    for variant in variants(m.INSTALLED):
        expected |= {f"over_allocated_registers_the_plan[{variant}]",
                     f"peer_descriptors_resolve[{variant}]"}
    if order == "kvcached-first":
        expected |= {"kvcached_patch_alone_refused", "kvcached_layout_patch_alone"}
    assert set(results) == expected
