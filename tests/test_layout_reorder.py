"""vLLM's receive-side reorder (``enable_permute_local_kv``: head-major blocks of a stock
prefill engine into a token-major decode cache, kvcached's layout) on each release's own
function, as its worker calls it.  0.26-0.31 reshape the cache's logical view, head-major
``(N, H, bs, 2D)``, instead of its token-major bytes: the blocks come out scrambled with no
error (GPU engines, run cc: vLLM 0.30 with a kvcached decode engine and the flag vLLM's own
handshake error advises, 0/6 answers intact).  The layout patch hands that function the memory-
order view (``reorder_in_memory_order``).  0.32 rewrote it to read memory order itself, and
there the release's code runs untouched.  Real code: ``robust_worker.scenario_receive_reorder``.
"""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import vllm_sites

BLOCKS = [1, 2, 3]
RELEASES = [v for v in robust_matrix.OLD_RELEASES
            if v == "<none>" or Version(v) >= Version("0.26")]


def _observed(ver: str, fresh_pdpatch) -> tuple[dict, dict, dict]:
    """Stock and patched observations, and the patch states, on ``ver`` (0.33: in process)."""
    if ver == "0.33.0":
        stock = rw.scenario_receive_reorder()
        status = {n: s.status for n, s in fresh_pdpatch.install().items()}
        return stock, rw.scenario_receive_reorder(), status
    stock, patched = robust_matrix.stock_and_patched(ver, "receive_reorder", "layout")
    return stock, patched, robust_matrix.report(ver)["status"]


@pytest.mark.parametrize("ver", [*RELEASES, "0.33.0"])
def test_token_major_blocks_hold_the_peers_values(ver: str, fresh_pdpatch) -> None:
    stock, patched, status = _observed(ver, fresh_pdpatch)
    assert status["layout"] == "active"
    assert patched["right"] == BLOCKS and patched["others_untouched"], patched
    assert stock["others_untouched"], stock
    if Version(ver) in vllm_sites.RECEIVE_PERMUTE_SCRAMBLES:
        assert stock["function"] == "kv_postprocess_layout_on_receive"
        assert stock["right"] == [], stock          # every block scrambled, no error
    else:
        assert stock["function"] == "kv_postprocess_blksize_and_layout_on_receive"
        assert stock["right"] == BLOCKS, stock


@pytest.mark.parametrize("ver", ["0.31.0", "0.32.0", "0.33.0"])
def test_the_wrapper_targets_exactly_the_releases_that_scramble(ver: str) -> None:
    site = vllm_sites.lookup(vllm_sites.RECEIVE_PERMUTE, Version(ver))
    assert (site is not None) == (Version(ver) in vllm_sites.RECEIVE_PERMUTE_SCRAMBLES)
