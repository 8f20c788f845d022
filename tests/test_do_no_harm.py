"""Do no harm, on each release's real NIXL worker code: where stock vLLM works, or fails with
its own error, it does exactly the same with pdpatch installed.  The scenarios are
``tests/harmless_scenarios.py``; vLLM's own connector tests are the wider oracle
(``scripts/upstream_suites.py``, ``docs/upstream_suites.md``).  The installed release runs in
process, older releases in the robustness matrix's subprocess per release
(``tests/robust_matrix.py``)."""

from __future__ import annotations

import harmless_scenarios as hs
import pytest
import robust_matrix


@pytest.fixture(scope="module")
def report_installed() -> dict:
    from pdpatch import installer

    installer.uninstall()
    try:
        stock = {name: fn() for name, fn in hs.SCENARIOS.items()}
        installer.install()
        patched = {name: fn() for name, fn in hs.SCENARIOS.items()}
    finally:
        installer.uninstall()
    return {"stock": stock, "patched": patched}


def _releases() -> list[str]:
    return [str(robust_matrix.INSTALLED), *robust_matrix.OLD_RELEASES]


def _phases(ver: str, report_installed: dict, name: str) -> tuple[dict, dict]:
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    if ver == str(robust_matrix.INSTALLED):
        return report_installed["stock"][name], report_installed["patched"][name]
    return (robust_matrix.scenario(ver, "stock", name),
            robust_matrix.scenario(ver, "patched", name))


@pytest.mark.parametrize("ver", _releases())
@pytest.mark.parametrize("name", list(hs.SCENARIOS))
def test_pdpatch_changes_nothing_stock_vllm_does(ver, name, report_installed):
    stock, patched = _phases(ver, report_installed, name)
    differing = {k: {"stock": stock.get(k), "pdpatch": patched.get(k)}
                 for k in sorted(set(stock) | set(patched)) if stock.get(k) != patched.get(k)}
    assert differing == {}


@pytest.mark.parametrize("ver", _releases())
def test_the_scenarios_exercise_what_they_claim(ver, report_installed):
    """The comparisons above would pass on empty observations: check they are not."""
    stand_in, _ = _phases(ver, report_installed, "stand_in")
    # Errors of the release's own code on `None` arguments (ValueError: its ZMQ path check).
    assert len(stand_in) >= 10 and all(v.startswith(("returned", "AttributeError",
                                                       "TypeError", "AssertionError",
                                                       "ValueError"))
                                       for v in stand_in.values()), stand_in
    meta, _ = _phases(ver, report_installed, "metadata")
    assert meta["fields"]["num_blocks"] == meta["num_blocks"] == 32
    assert meta["registered"] and meta["dlists"]
    padded, _ = _phases(ver, report_installed, "metadata_padded")
    assert padded.get("fields", {}).get("num_blocks") == 32 or "error" in padded, padded
    tp, _ = _phases(ver, report_installed, "hetero_tp")
    assert tp["errors"] == [] and tp["crash"] is None, tp
    assert tp["results"]["done_recving"] == ["r"] and len(tp["reads"]) == 2, tp
