"""Issue 7, bug 4.  The StopIteration of PR #40731's review (``UniformTypeKVCacheSpecs``
wrapping MLA specs classified by ``type()``) shipped in no release: 0.21.0, the first with the
plan-based code, already unwraps it (``get_representative_spec_type``).  What ships in
0.21-0.34 is the ``next()`` without a default that finds the attention group in
``_build_fa_remote`` / ``_build_local_splits_from_plan``: a worker with no attention group fails
every handshake with an empty ``StopIteration``.  ``spec_classify`` makes that a clear error;
0.19/0.20 have no such lookup and the patch is skipped there with the reason."""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch.patches import spec_classify

WITH_LOOKUP = [v for v in robust_matrix.OLD_RELEASES
               if v != "<none>" and Version(v) >= Version("0.21")]
WITHOUT_LOOKUP = [v for v in robust_matrix.OLD_RELEASES
                  if v != "<none>" and Version(v) < Version("0.21")]


def assert_bare_stop(obs: dict) -> None:
    assert obs["crash"] is None, obs
    assert set(obs["handshake_errors"]) == {"StopIteration: "}, obs
    assert "r1" in obs["results"]["done_recving"], obs


def assert_clear(obs: dict) -> None:
    assert obs["crash"] is None, obs
    [err] = set(obs["handshake_errors"])
    assert err.startswith("NoAttentionGroup: pdpatch: NIXL _build_fa_remote needs an attention "
                          "KV-cache group but this worker's groups are ['MambaSpec']"), err
    assert "r1" in obs["results"]["done_recving"], obs


def test_uniform_type_mla_classified_as_attention_on_installed():
    """The DeepSeek-V4 case of the review: the shipped classifier unwraps the wrapper."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import _is_attention_spec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import (
        get_representative_spec_type,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=512, dtype=torch.bfloat16)
    wrapped = UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs={"a": mla, "b": mla})
    assert _is_attention_spec(get_representative_spec_type(wrapped))


def test_stock_installed_bare_stop_iteration(fresh_pdpatch):
    assert_bare_stop(rw.scenario_spec_types())


def test_spec_classify_installed_clear_error(fresh_pdpatch):
    assert fresh_pdpatch.install()["spec_classify"].status == "active"
    assert_clear(rw.scenario_spec_types())


@pytest.mark.parametrize("ver", WITH_LOOKUP or ["<none>"])
def test_spec_types_on_old_release(ver):
    stock, patched = robust_matrix.stock_and_patched(ver, "spec_types", "spec_classify")
    assert_bare_stop(stock)
    assert_clear(patched)


@pytest.mark.parametrize("ver", WITHOUT_LOOKUP or ["<none>"])
def test_spec_classify_skipped_before_0_21(ver):
    if ver == "<none>":
        pytest.skip("no 0.19/0.20 source tree extracted (scripts/fetch_vllm_sources.sh)")
    rep = robust_matrix.report(ver)
    assert rep["status"]["spec_classify"] == "skipped"
    assert (f"spec_classify (vLLM {ver} outside {spec_classify.PATCH.versions}: 0.19/0.20 "
            "predate the plan-based transfer") in rep["summary"], rep["summary"]
