"""A decode engine whose KV tensors are over-allocated views (the CPU stand-in for kvcached)
receives KV from a stock prefill engine over real NIXL and decodes exactly the baseline.

D runs the installed release's own allocator, wrapped by ``kvc_overalloc/sitecustomize.py``
(test-only, switched on by ``KVC_E2E_OVERALLOCATE``) so every layer's view holds 2.5x the
planned blocks over one larger buffer -- what kvcached's virtual reservation looks like to
vLLM.  Stock vLLM (the installed release) cannot register such views
(``test_num_blocks_worker.py`` shows the "cannot be partitioned" failure on the real worker);
with pdpatch on D, the views are sliced to the plan, registered exactly, and the pair works.
P is stock (no pdpatch), as is the single-engine baseline.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from lab.rig.demo import demo_prompts, run_case
from lab.rig.engine_env import engine_env
from lab.rig.model import tiny_config
from lab.rig.servers import EngineGroup, EngineSpec

MAX_TOKENS = 16
CPU_BLOCK_SIZE = 128
FACTOR = "2.5"
CASES = demo_prompts(CPU_BLOCK_SIZE, tiny_config()["vocab_size"])[:3]
SITE_DIR = Path(__file__).with_name("kvc_overalloc")


def _specs() -> list[EngineSpec]:
    overlay_path = engine_env(pdpatch=True, side_channel_port=0)["PYTHONPATH"]
    return [
        EngineSpec("P", "kv_producer", pdpatch=False),
        EngineSpec("D", "kv_consumer", pdpatch=True, extra_env={
            "PYTHONPATH": overlay_path + os.pathsep + str(SITE_DIR),
            "KVC_E2E_OVERALLOCATE": FACTOR,
        }),
        EngineSpec("baseline", None, pdpatch=False),
    ]


RIG_SPECS = _specs
RIG_WARMUP = [("P", "D")]


def test_decode_engine_really_holds_over_allocated_views(rig: EngineGroup) -> None:
    log = rig["D"].log_text()
    m = re.search(r"\[kvc-e2e\] pid \d+: over-allocated KV cache: planned (\d+) blocks, "
                  r"views hold (\d+)", log)
    assert m, "the over-allocation stand-in did not run in D"
    planned, virtual = int(m.group(1)), int(m.group(2))
    assert virtual > planned
    # pdpatch's num_blocks patch found them and registered the plan
    assert re.search(rf"pdpatch num_blocks: \d+ of \d+ KV tensors hold {virtual} blocks; "
                     rf"sliced to the planned {planned}", log), log[-3000:]
    assert "[kvc-e2e]" not in rig["P"].log_text()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_over_allocated_decode_equals_baseline(rig: EngineGroup, case) -> None:
    res = run_case(rig["P"], rig["D"], rig["baseline"], case, MAX_TOKENS)
    assert len(res.base.token_ids) == MAX_TOKENS
    assert res.pd.decode.token_ids == res.base.token_ids
    assert res.pd.decode.logprobs == res.base.logprobs
    t = res.pd.transfer
    assert t is not None and t.failed == 0 and t.transfers >= 1
    assert t.external_hit_tokens > 0
