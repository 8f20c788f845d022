"""``kv_segments`` in the real P/D rig (the venv's vLLM servers, real NIXL over UCX on loopback).

What the CPU engines allow: the installed release's CPU platform always selects ``CPU_ATTN``
for this (non-MLA) model (any other ``--attention-backend`` is logged as "Cannot use ...
backend on CPU" and replaced), and from 0.26 every backend packs K|V per token, so P and D
cannot be given different K/V segment layouts or different backend names here.  Those pairs
are proven on real vLLM workers (``tests/test_kv_segments_workers.py``: 0.19/0.20/0.22
conversions, 0.25, 0.28, 0.33 and the installed release mixed names).

What this rig proves is the wire side of the patch in production conditions: P runs pdpatch and
adds ``pdpatch_kv_geometry`` to the handshake metadata it serves; D is **stock vLLM** (pdpatch
off).  D's real ``_nixl_handshake`` decodes P's metadata with vLLM's own ``NixlAgentMetadata``
(the unknown field is ignored), pulls the prompt KV over NIXL, and decodes exactly what a plain
single engine produces.  (Both sides patched is ``test_pd_baseline.py``, where kv_segments is
active on P and D.)
"""

from __future__ import annotations

import re

import pytest

from lab.rig.demo import PromptCase, demo_prompts, run_case
from lab.rig.model import tiny_config
from lab.rig.servers import EngineGroup, EngineSpec
from pdpatch.versions import vllm_version

MAX_TOKENS = 16
CPU_BLOCK_SIZE = 128
CASES = [c for c in demo_prompts(CPU_BLOCK_SIZE, tiny_config()["vocab_size"])
         if c.name in ("short", "block+1", "long")]

RIG_SPECS = [
    EngineSpec("P", "kv_producer", pdpatch=True, extra_env={"PDPATCH_LOG_LEVEL": "DEBUG"}),
    EngineSpec("D-stock", "kv_consumer", pdpatch=False),
    EngineSpec("baseline", None, pdpatch=False),
]
RIG_WARMUP = [("P", "D-stock")]


def test_prefill_advertises_its_geometry_and_decode_is_stock(rig: EngineGroup) -> None:
    p_lines = "\n".join(rig["P"].pdpatch_lines())
    release = re.escape(str(vllm_version()))
    summaries = re.findall(rf"role=(\S+) vllm={release} ready=\[([^\]]*)\]", p_lines)
    assert any(role.startswith("worker") and "kv_segments" in ready
               for role, ready in summaries), p_lines
    adv = re.findall(r"pdpatch kv_segments: advertising (.*)", rig["P"].log_text())
    assert adv and "packed(layers=" in adv[0] and "segments=[KV@0+" in adv[0], adv
    assert rig["D-stock"].pdpatch_lines() == []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stock_decode_of_an_advertising_prefill_equals_baseline(
        rig: EngineGroup, case: PromptCase) -> None:
    res = run_case(rig["P"], rig["D-stock"], rig["baseline"], case, MAX_TOKENS)
    dec, base = res.pd.decode, res.base
    assert dec.error is None
    assert len(base.token_ids) == MAX_TOKENS
    assert dec.token_ids == base.token_ids
    assert dec.logprobs == base.logprobs
    t = res.pd.transfer
    assert t is not None and t.failed == 0 and t.transfers >= 1
    assert t.external_hit_tokens > 0
    assert "NIXL compatibility hash mismatch" not in rig["D-stock"].log_text()
