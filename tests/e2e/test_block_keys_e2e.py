"""``block_keys`` end to end: real engines of the installed vLLM doing P/D over real NIXL on CPU.

P and D hash with ``--prefix-caching-hash-algo xxhash_cbor`` and ``PYTHONHASHSEED`` **unset**,
vLLM's default: each EngineCore draws its NONE_HASH from ``os.urandom``, so P and D name every
block differently in their own prefix caches.  Stock vLLM transfers correctly there -- the KV
does not depend on the names -- and so must pdpatch: it compares canonical keys, which do not
depend on the engines' seeds.  pdpatch is active on both.

* same request: D loads P's KV over NIXL, logs that the keys matched (and, once, that the
  engines name blocks differently), and its output equals a local computation of the prompt;
* a true mismatch -- D's request carries another ``cache_salt`` than the one P prefilled --:
  D refuses P's KV (no external prefix-cache hit), warns with the cause ``cache_salt``,
  computes the prompt itself, and its output still equals the local computation.

D's ``/metrics`` counts each (pdpatch's ``metrics`` patch): the first as pulled, the second as
recomputed for a key mismatch, with a ``block_keys`` refusal.

The reference output comes from P computing the prompt locally (no ``kv_transfer_params``).
"""

from __future__ import annotations

import random
import re
import time

from lab.rig import proxy
from lab.rig.model import tiny_config
from lab.rig.servers import EngineGroup, EngineSpec

MAX_TOKENS = 12
ALGO = ("--prefix-caching-hash-algo", "xxhash_cbor")
UNSET = {"PYTHONHASHSEED": None}

RIG_SPECS = [
    EngineSpec("P", "kv_producer", pdpatch=True, extra_args=ALGO, extra_env=UNSET),
    EngineSpec("D", "kv_consumer", pdpatch=True, extra_args=ALGO, extra_env=UNSET),
]
RIG_WARMUP = [("P", "D")]

PULLED = 'pdpatch:kv_requests_total{cause="",outcome="pulled"}'
MISMATCH = 'pdpatch:kv_requests_total{cause="key_mismatch",outcome="recomputed"}'
REFUSED = 'pdpatch:refusals_total{patch="block_keys"}'
FINGERPRINT = re.compile(r"block-key fingerprint of this engine \(kv_role=(\w+)\): (.*?) \[")


def prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, tiny_config()["vocab_size"]) for _ in range(n)]


def counted(engine, before: dict[str, float], wait_s: float = 10.0) -> dict[str, float]:
    """What pdpatch's counters on ``engine``'s ``/metrics`` moved by since ``before`` (they
    arrive with the engine's next scheduler stats: polled until they moved)."""
    deadline = time.monotonic() + wait_s
    while True:
        after = engine.pdpatch_metrics()
        delta = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        if delta or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


def fingerprint(engine) -> str:
    found = FINGERPRINT.findall(engine.log_text())
    assert len(found) == 1, (engine.spec.name, found)
    return found[0][1]


def test_each_engine_has_its_own_random_none_hash(rig: EngineGroup) -> None:
    p, d = fingerprint(rig["P"]), fingerprint(rig["D"])
    assert "algo=xxhash_cbor seed=random" in p and "seed=random" in d
    nh = re.compile(r"none_hash_id=(\w+)")
    assert nh.search(p).group(1) != nh.search(d).group(1)


def test_same_request_loads_remote_kv_whatever_the_seeds(rig: EngineGroup) -> None:
    p, d = rig["P"], rig["D"]
    ids = prompt(1)
    want = proxy.stream(p, ids, MAX_TOKENS)            # local computation
    before = d.pdpatch_metrics()
    assert MISMATCH in before and REFUSED in before, before     # on /metrics from the start
    res = proxy.pd_request(p, d, ids, MAX_TOKENS)
    assert res.decode.error is None
    assert res.decode.token_ids == want.token_ids
    assert res.decode.logprobs == want.logprobs
    assert res.transfer is not None and res.transfer.external_hit_tokens > 0, res.transfer
    log = d.log_text()
    assert "block keys of P engine" in log and "match D's" in log
    assert "name blocks differently in their own prefix caches (seed)" in log
    assert "do not match" not in log
    assert counted(d, before) == {PULLED: 1.0}


def test_different_cache_salt_computes_locally_and_warns(rig: EngineGroup) -> None:
    p, d = rig["P"], rig["D"]
    ids = prompt(2)
    before = d.pdpatch_metrics()
    res = proxy.pd_request(p, d, ids, MAX_TOKENS, decode_body={"cache_salt": "tenant-b"})
    want = proxy.stream(p, ids, MAX_TOKENS)            # local computation on P
    assert res.decode.error is None
    assert res.decode.token_ids == want.token_ids
    assert res.decode.logprobs == want.logprobs
    assert res.transfer is not None and res.transfer.external_hit_tokens == 0, res.transfer
    log = d.log_text()
    assert "do not match D's: cache_salt" in log
    assert "computing it locally instead of loading P's KV" in log
    assert counted(d, before) == {MISMATCH: 1.0, REFUSED: 1.0}
