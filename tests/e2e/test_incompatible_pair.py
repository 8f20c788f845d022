"""A deliberately incompatible P/D pair fails fast and cleanly, never hangs.

D serves the tiny Llama with 3 layers, P with 2 (pdpatch enabled on both).  vLLM 0.34.0's
NixlConnector refuses the handshake: the compatibility hash covers the model path, dtype, KV
heads, head size and layer count ("NIXL compatibility hash mismatch").  What stock vLLM then
does, and what these tests pin down: the handshake failure marks the request's KV load as
failed, and with the default ``kv_load_failure_policy="fail"`` D finishes that one request with
an error instead of waiting for KV that will never arrive; D itself stays healthy and keeps
serving.
"""

from __future__ import annotations

import time
import urllib.error

from lab.rig import proxy
from lab.rig.model import model_dir
from lab.rig.servers import EngineGroup, EngineSpec

MAX_TOKENS = 8
BOUND_S = 60.0  # the whole failing request must be answered within this
#: P's lease on the blocks of a request whose handshake fails: no READ and no heartbeat ever
#: come, so P holds them the whole lease, and vLLM's scheduler steps without pause meanwhile
#: (1.8-1.9 of the CI machine's 2 cores, measured).  D's first local request, a cold one,
#: then crawls until the lease ends: 117 s under the rig's 120 s lease, against 5 s with P
#: idle.  Stock vLLM behaves the same; a short lease keeps this test about D, not the CPU.
LEASE_S = 10


def RIG_SPECS() -> list[EngineSpec]:
    return [
        EngineSpec("P", "kv_producer", pdpatch=True, kv_lease_s=LEASE_S),
        EngineSpec("D-3layers", "kv_consumer", pdpatch=True, kv_lease_s=LEASE_S,
                   model=model_dir(num_hidden_layers=3)),
    ]


def test_layer_mismatch_fails_the_request_cleanly(rig: EngineGroup) -> None:
    p, d = rig["P"], rig["D-3layers"]
    prompt = list(range(10, 150))
    # Up to 5 attempts, pausing as proxy.warm_up does: on a loaded machine a handshake can hit
    # vLLM's 5 s ZMQ timeout before the hash is ever compared, and such stalls come in bursts
    # (one CI run timed out three handshakes in a row, 20 s); each such attempt must fail
    # cleanly too.
    for attempt in range(1, 6):
        if attempt > 1:
            time.sleep(proxy.WARM_UP_BACKOFF_S * (attempt - 1))
        t0 = time.monotonic()
        try:
            res = proxy.pd_request(p, d, prompt, MAX_TOKENS, timeout_s=BOUND_S)
            error, tokens = res.decode.error, res.decode.token_ids
        except urllib.error.HTTPError as exc:  # a non-streaming client would get this instead
            error, tokens = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}", []
        elapsed = time.monotonic() - t0
        print(f"attempt {attempt}: error={error!r} tokens={tokens} after {elapsed:.1f}s")
        assert elapsed < BOUND_S
        assert error is not None and tokens == []
        if "NIXL compatibility hash mismatch" in d.log_text():
            break
    log = d.log_text()
    assert "NIXL compatibility hash mismatch" in log
    assert "due to KV load failure (failure_policy=fail" in log
    # D is not wedged: a plain local request still works.
    local = proxy.stream(d, prompt, MAX_TOKENS, timeout_s=BOUND_S)
    assert local.error is None and len(local.token_ids) == MAX_TOKENS
    assert d.healthy()


def test_p_unaffected(rig: EngineGroup) -> None:
    """P keeps serving after D rejected it."""
    out = proxy.stream(rig["P"], list(range(20, 40)), MAX_TOKENS)
    assert len(out.token_ids) == MAX_TOKENS
