"""P/D with pdpatch active on both engines gives exactly the single-engine baseline's output.

Three real vLLM servers of the venv's release (CPU kernels: see
lab/rig/engine_env.py):
P (kv_producer) and D (kv_consumer) with NixlConnector and ENABLE_PDPATCH=true, and a plain
baseline engine without any connector or pdpatch.  The model has seeded random weights whose
outputs depend on the KV cache (see lab/rig/model.py), so equality is meaningful; and
``test_decode_uses_the_transferred_kv`` shows D really decodes from the KV it pulled, not from
a local recomputation.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from lab.rig import proxy
from lab.rig.demo import PromptCase, demo_prompts, run_case
from lab.rig.model import tiny_config
from lab.rig.servers import EngineGroup, EngineSpec
from pdpatch.patches.block_keys import wrappers as block_keys
from pdpatch.versions import vllm_version

MAX_TOKENS = 24
CPU_BLOCK_SIZE = 128  # what the CPU platform forces; checked against the engine below
CASES = demo_prompts(CPU_BLOCK_SIZE, tiny_config()["vocab_size"])


RIG_SPECS = [
    EngineSpec("P", "kv_producer", pdpatch=True),
    EngineSpec("D", "kv_consumer", pdpatch=True),
    EngineSpec("baseline", None, pdpatch=False),
]
RIG_WARMUP = [("P", "D")]


def test_engines_run_real_vllm_with_pdpatch_active(rig: EngineGroup) -> None:
    import json
    import urllib.request

    for eng in rig:
        with urllib.request.urlopen(eng.url + "/version", timeout=10) as r:
            assert json.loads(r.read())["version"] == str(vllm_version()), eng.spec.name
    assert rig["P"].block_size() == CPU_BLOCK_SIZE

    for name in ("P", "D"):
        lines = rig[name].pdpatch_lines()
        summary = re.compile(rf"pdpatch: pid=\d+ role=(\S+) vllm={re.escape(str(vllm_version()))}"
                             r" ready=\[")
        roles = set(summary.findall("\n".join(lines)))
        # The NixlConnector worker half runs in the worker process, the scheduler half in
        # EngineCore: pdpatch must be installed in both.
        assert "engine-core" in roles, (name, lines)
        assert any(r.startswith("worker") for r in roles), (name, lines)
    assert rig["baseline"].pdpatch_lines() == []


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_pd_decode_equals_baseline(rig: EngineGroup, case: PromptCase) -> None:
    res = run_case(rig["P"], rig["D"], rig["baseline"], case, MAX_TOKENS)
    dec, base = res.pd.decode, res.base
    assert len(base.token_ids) == MAX_TOKENS
    assert dec.token_ids == base.token_ids
    assert dec.logprobs == base.logprobs  # exact: same kernels, same KV bytes
    t = res.pd.transfer
    assert t is not None
    assert t.failed == 0
    assert t.transfers >= 1
    # Every prompt token's KV on D came either from P over NIXL or from D's own prefix cache
    # (only the shared-prefix case has local hits), never from recomputing the prompt.
    assert t.external_hit_tokens > 0
    assert t.external_hit_tokens + t.local_hit_tokens == len(case.ids), t


def _mismatched_pair(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    vocab = tiny_config()["vocab_size"]
    a = [rng.randrange(3, vocab) for _ in range(200)]
    b = [rng.randrange(3, vocab) for _ in range(200)]
    return a, b


def test_decode_uses_the_transferred_kv(rig: EngineGroup) -> None:
    """Negative control: hand D the KV of a *different* prompt of the same length.

    If D ignored the pulled KV and recomputed the prompt, it would still match the baseline;
    it must not.  P's ``block_keys`` entry is dropped from the params (what a P without pdpatch
    sends), so D's block-key check has nothing to compare and D loads what it is given.  (This
    poisons D's prefix cache for prompt ``b`` only, which no other test uses.)
    """
    a, b = _mismatched_pair(99)
    p, d, base = rig["P"], rig["D"], rig["baseline"]
    want = proxy.stream(base, b, MAX_TOKENS)
    pre = proxy.complete(p, a, 1, kv_transfer_params=dict(proxy.PREFILL_KV_PARAMS))
    assert pre.kv_transfer_params and block_keys.PARAMS_KEY in pre.kv_transfer_params
    params = {k: v for k, v in pre.kv_transfer_params.items() if k != block_keys.PARAMS_KEY}
    got = proxy.stream(d, b, MAX_TOKENS, kv_transfer_params=params)
    assert len(got.token_ids) == MAX_TOKENS
    assert got.logprobs != want.logprobs
    assert got.token_ids != want.token_ids


def test_block_keys_refuse_kv_of_another_prompt(rig: EngineGroup) -> None:
    """The same swap with P's block keys intact: D's ``block_keys`` check sees that P prefilled
    another prompt, computes ``b`` locally (baseline output) and says so in its log."""
    a, b = _mismatched_pair(98)
    p, d, base = rig["P"], rig["D"], rig["baseline"]
    want = proxy.stream(base, b, MAX_TOKENS)
    pre = proxy.complete(p, a, 1, kv_transfer_params=dict(proxy.PREFILL_KV_PARAMS))
    got = proxy.stream(d, b, MAX_TOKENS, kv_transfer_params=pre.kv_transfer_params)
    assert got.error is None
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert re.search(r"block keys of request \S+ from P engine \S+ do not match D's: prompt",
                     d.log_text())


def test_d_log_reports_successful_nixl_transfers(rig: EngineGroup) -> None:
    """vLLM's own periodic stats line on D (logged every ~10 s while there is activity)."""
    d = rig["D"]
    run_case(rig["P"], d, rig["baseline"], PromptCase("log-probe", list(range(5, 45))), 4)
    pat = re.compile(
        r"KV Transfer metrics: Num successful transfers=(\d+).*?Num failed transfers=(\d+)"
    )
    deadline = time.monotonic() + 30
    while True:
        text = d.log_text()
        found = pat.findall(text)
        if found or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert found, "D never logged KV Transfer metrics"
    assert sum(int(ok) for ok, _ in found) > 0
    assert all(int(failed) == 0 for _, failed in found)
    rates = [float(x) for x in re.findall(r"External prefix cache hit rate: ([\d.]+)%", text)]
    assert rates and max(rates) > 0.0
