"""``params_check``: the rules for a decode-side request's ``kv_transfer_params`` (pure), and
that its target resolves and wraps on every release.  The end-to-end proof against a real decode
engine is ``tests/e2e/test_robustness_e2e.py``."""

from __future__ import annotations

import pytest
import robust_matrix

from pdpatch.patches.params_check import problems

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
        "remote_request_id": "req-1", "remote_host": "10.0.0.2", "remote_port": 5600,
        "remote_block_ids": [[3, 4]], "tp_size": 1, "remote_num_tokens": 140,
        "remote_blocks_expiry_time": 1234.5}


def check(**changes):
    params = {**GOOD, **changes}
    for k, v in changes.items():
        if v is ...:
            del params[k]
    return problems(params, max_blocks=2048, max_groups=2)


def test_well_formed_params_pass():
    assert check() == []
    assert problems(None, 2048, 2) == []
    # P-side (prefill) and plain requests carry nothing to check.
    assert problems({"do_remote_decode": True, "remote_engine_id": None}, 2048, 2) == []


@pytest.mark.parametrize("changes, needle", [
    ({"remote_block_ids": ...}, "remote_block_ids must be a non-empty list"),
    ({"remote_block_ids": []}, "remote_block_ids must be a non-empty list"),
    ({"remote_block_ids": "abc"}, "remote_block_ids must be a non-empty list"),
    ({"remote_block_ids": [3, 4]}, "group 0 is 3"),
    ({"remote_block_ids": [[0.5, 1.5]]}, "group 0 holds 0.5"),
    ({"remote_block_ids": [[True]]}, "group 0 holds True"),
    ({"remote_block_ids": [[-1]]}, "group 0 holds -1"),
    ({"remote_block_ids": [[[1]]]}, "group 0 holds [1]"),
    ({"remote_block_ids": [list(range(3000))]}, "group 0 has 3000 blocks; at most 2048"),
    ({"remote_block_ids": [[0]] * 3}, "3 groups; this model has at most 2"),
    ({"remote_engine_id": ...}, "remote_engine_id must be a non-empty string"),
    ({"remote_engine_id": 12345}, "remote_engine_id must be a non-empty string"),
    ({"remote_request_id": None}, "remote_request_id must be a non-empty string"),
    ({"remote_host": 7}, "remote_host must be a non-empty string"),
    ({"remote_port": "abc"}, "remote_port must be an integer in 1..65535"),
    ({"remote_port": 70000}, "remote_port must be an integer in 1..65535"),
    ({"remote_port": -1}, "remote_port must be an integer in 1..65535"),
    ({"tp_size": 0}, "tp_size must be a positive integer"),
    ({"tp_size": "two"}, "tp_size must be a positive integer"),
    ({"tp_size": 10**6}, "tp_size must be a positive integer"),
    ({"remote_num_tokens": -100}, "remote_num_tokens must be a non-negative integer"),
    ({"remote_num_tokens": "many"}, "remote_num_tokens must be a non-negative integer"),
    ({"remote_blocks_expiry_time": "soon"}, "remote_blocks_expiry_time must be a number"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill must be true or false"),
])
def test_malformed_params_named(changes, needle):
    found = check(**changes)
    assert found and any(needle in f for f in found), found


def test_not_an_object():
    assert problems([1, 2], 2048, 2) == ["must be an object, got list"]


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_params_check_target_wraps_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    targets = robust_matrix.report(ver)["targets"]["params_check"]
    assert targets == {"vllm.v1.engine.input_processor:InputProcessor._validate_params":
                       ["wrapped", ""]}, targets


def test_params_check_target_wraps_on_0_33(fresh_pdpatch):
    import importlib

    states = fresh_pdpatch.install()
    importlib.import_module("vllm.v1.engine.input_processor")
    [ts] = states["params_check"].targets
    assert ts.status == "wrapped", ts
