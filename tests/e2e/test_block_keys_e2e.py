"""``block_keys`` end to end: real vLLM 0.33 engines doing P/D over real NIXL on CPU.

P and D hash with ``--prefix-caching-hash-algo xxhash_cbor`` and ``PYTHONHASHSEED=0``; a second
decode engine ``D-seed1`` has ``PYTHONHASHSEED=1`` (the classic misconfiguration: its NONE_HASH,
and so every block key, differs).  pdpatch is active on all three.

* matching pair: D loads P's KV over NIXL, logs that the keys matched, and its output equals a
  local computation of the same prompt;
* mismatched pair: D-seed1 refuses P's KV (no external prefix-cache hit), warns with the cause
  ``seed``, computes the prompt itself -- and its output still equals the local computation.

The reference output comes from an engine that computes the prompt locally (no
``kv_transfer_params``), the other decode engine, which has never seen that prompt.
"""

from __future__ import annotations

import random
import re

from pdpatch.rig import proxy
from pdpatch.rig.model import tiny_config
from pdpatch.rig.servers import EngineGroup, EngineSpec

MAX_TOKENS = 12
ALGO = ("--prefix-caching-hash-algo", "xxhash_cbor")

RIG_SPECS = [
    EngineSpec("P", "kv_producer", pdpatch=True, extra_args=ALGO,
               extra_env={"PYTHONHASHSEED": "0"}),
    EngineSpec("D", "kv_consumer", pdpatch=True, extra_args=ALGO,
               extra_env={"PYTHONHASHSEED": "0"}),
    EngineSpec("D-seed1", "kv_consumer", pdpatch=True, extra_args=ALGO,
               extra_env={"PYTHONHASHSEED": "1"}),
]
RIG_WARMUP = [("P", "D"), ("P", "D-seed1")]

FINGERPRINT = re.compile(r"block-key fingerprint of this engine \(kv_role=(\w+)\): (.*?) \[")


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, tiny_config()["vocab_size"]) for _ in range(n)]


def fingerprint(engine) -> str:
    found = FINGERPRINT.findall(engine.log_text())
    assert len(found) == 1, (engine.spec.name, found)
    return found[0][1]


def test_each_engine_logs_its_fingerprint(rig: EngineGroup) -> None:
    p, d, bad = (fingerprint(rig[n]) for n in ("P", "D", "D-seed1"))
    assert "algo=xxhash_cbor seed=PYTHONHASHSEED" in p
    assert p == d                                 # the operator's diff: identical
    assert bad != p
    nh = re.compile(r"none_hash_id=(\w+)")
    assert nh.search(bad).group(1) != nh.search(p).group(1)


def test_matching_keys_load_remote_kv(rig: EngineGroup) -> None:
    p, d, other = rig["P"], rig["D"], rig["D-seed1"]
    ids = prompt(1)
    want = proxy.stream(other, ids, MAX_TOKENS)        # local computation, never seen by D
    res = proxy.pd_request(p, d, ids, MAX_TOKENS)
    assert res.decode.error is None
    assert res.decode.token_ids == want.token_ids
    assert res.decode.logprobs == want.logprobs
    assert res.transfer is not None and res.transfer.external_hit_tokens > 0, res.transfer
    assert "block keys of P engine" in d.log_text() and "match D's" in d.log_text()
    assert "do not match" not in d.log_text()


def test_mismatched_seed_computes_locally_and_warns(rig: EngineGroup) -> None:
    p, d, bad = rig["P"], rig["D"], rig["D-seed1"]
    ids = prompt(2)
    res = proxy.pd_request(p, bad, ids, MAX_TOKENS)
    want = proxy.stream(d, ids, MAX_TOKENS)            # local computation on D
    assert res.decode.error is None
    assert res.decode.token_ids == want.token_ids
    assert res.decode.logprobs == want.logprobs
    assert res.transfer is not None and res.transfer.external_hit_tokens == 0, res.transfer
    log = bad.log_text()
    assert "do not match D's: seed" in log
    assert "computing it locally instead of loading P's KV" in log
    assert len(re.findall(r"do not match D's: seed", log)) <= 2   # warm-up + this, at most
