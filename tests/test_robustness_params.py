"""``params_check``: the rules for a decode-side request's ``kv_transfer_params`` (pure), and
that its target resolves and wraps on every release.  The end-to-end proof against a real decode
engine is ``tests/e2e/test_robustness_e2e.py``."""

from __future__ import annotations

import pytest
import robust_matrix
import robust_worker as rw
from packaging.version import Version

from pdpatch import vllm_sites
from pdpatch.patches.params_check.wrappers import EVERY_RELEASE, problems

GOOD = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
        "remote_request_id": "req-1", "remote_host": "10.0.0.2", "remote_port": 5600,
        "remote_block_ids": [[3, 4]], "tp_size": 1, "remote_num_tokens": 140,
        "remote_blocks_expiry_time": 1234.5}


def check(reads=EVERY_RELEASE, **changes):
    params = {**GOOD, **changes}
    for k, v in changes.items():
        if v is ...:
            del params[k]
    return problems(params, max_blocks=2048, max_groups=2, reads=reads)


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
    ({"pp_size": "two"}, "pp_size must be a positive integer"),
    ({"dcp_size": 0}, "dcp_size must be a positive integer"),
    ({"remote_num_tokens": -100}, "remote_num_tokens must be a non-negative integer"),
    ({"remote_num_tokens": "many"}, "remote_num_tokens must be a non-negative integer"),
    ({"remote_num_tokens": 31.0}, "remote_num_tokens must be a non-negative integer"),
    ({"remote_num_tokens": 2049}, "of at most max_model_len (2048), got 2049"),
    ({"remote_blocks_expiry_time": "soon"}, "remote_blocks_expiry_time must be a number"),
    ({"remote_registration_generation": None}, "remote_registration_generation must be a"),
    ({"remote_registration_generation": "2"}, "remote_registration_generation must be a"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill must be true or false"),
])
def test_malformed_params_named(changes, needle):
    found = check(**changes)
    assert found and any(needle in f for f in found), found


def test_not_an_object():
    assert problems([1, 2], 2048, 2) == ["must be an object, got list"]


@pytest.mark.parametrize(("field", "value", "first"), [
    ("pp_size", "two", "0.26"), ("dcp_size", "two", "0.29"),
    ("remote_blocks_expiry_time", "soon", "0.26"), ("remote_num_tokens", "many", "0.30"),
    ("remote_registration_generation", "2", "0.33")])
def test_a_field_is_checked_only_where_the_release_reads_it(field, value, first):
    """Do no harm: a release that ignores a field serves the request whatever it holds."""
    before = vllm_sites.recv_params_read(Version(f"0.{Version(first).minor - 1}.0"))
    since = vllm_sites.recv_params_read(Version(first))
    assert check(reads=before, **{field: value}) == []
    assert check(reads=since, **{field: value}) != []
    assert check(reads=vllm_sites.recv_params_read(robust_matrix.INSTALLED),
                 **{field: value}) != []


def test_fields_no_release_reads_are_left_alone():
    """``remote_tp_size``, ``remote_dcp_size`` and ``remote_pp_size`` are read by no release's
    NIXL code from the params (only ``tp_size``, ``dcp_size``, ``pp_size``)."""
    assert check(remote_tp_size="x", remote_dcp_size=0, remote_pp_size=[1]) == []
    read = {name for name, _ in vllm_sites.RECV_PARAMS_READ}
    assert not read & {"remote_tp_size", "remote_dcp_size", "remote_pp_size"}


@pytest.mark.parametrize(("field", "value"), [
    ("remote_num_tokens", "31"), ("remote_num_tokens", 31.0),
    ("remote_registration_generation", None), ("remote_registration_generation", "2")])
def test_the_installed_release_crashes_on_what_params_check_refuses(field, value):
    """Each value refused above is one the installed release's own read path crashes on:
    a P/D block-size ratio read (the rig's P blocks are half D's), stock vLLM, no pdpatch."""
    if field == "remote_num_tokens" and \
            robust_matrix.INSTALLED < vllm_sites.PAIRS_BY_LAST_TOKEN_FROM:
        pytest.skip("the installed release does not pair blocks from remote_num_tokens")
    case = {"r": ([], [1, 2], [10, 11, 12, 13])}
    tokens = {"r": (value if field == "remote_num_tokens" else 31, 31)}
    extra = {"r": {field: value}} if field != "remote_num_tokens" else None
    obs = rw._block_id_run(case, rw.BLOCK_SIZE // 2, tokens, extra)
    assert obs["crash"] is not None and obs["crash"].startswith("TypeError"), obs
    assert check(**{field: value}) != []


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_params_check_target_wraps_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    targets = robust_matrix.report(ver)["targets"]["params_check"]
    assert targets == {"vllm.v1.engine.input_processor:InputProcessor._validate_params":
                       ["wrapped", ""]}, targets


def test_params_check_target_wraps_on_installed(fresh_pdpatch):
    import importlib

    states = fresh_pdpatch.install()
    importlib.import_module("vllm.v1.engine.input_processor")
    [ts] = states["params_check"].targets
    assert ts.status == "wrapped", ts


def test_the_wrapper_checks_what_its_release_reads():
    """The wrapper on ``InputProcessor._validate_params`` judges with its release's fields: a
    malformed ``remote_num_tokens`` is a 400 where the release reads it, not on 0.29."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from pdpatch.patches.params_check.wrappers import make_check

    processor = SimpleNamespace(model_config=None, vllm_config=None)
    params = SamplingParams(extra_args={"kv_transfer_params": {**GOOD,
                                                               "remote_num_tokens": "many"}})
    assert make_check(Version("0.29.0"))(lambda p: "ok", processor, (params,), {}) == "ok"
    with pytest.raises(VLLMValidationError, match="remote_num_tokens must be a non-negative"):
        make_check(robust_matrix.INSTALLED)(lambda p: "ok", processor, (params,), {})


def test_a_readback_with_no_integer_token_count_kills_the_scheduler_and_is_a_400():
    """A readback's params (``do_remote_decode`` with P's block ids and address, 0.21+) reach
    the pull scheduler's ``min(remote_num_tokens or 0, num_prompt_tokens)`` in EngineCore,
    queued or not: a string raises there, stock, and the engine core dies.  params_check refuses
    exactly that (an integer, and params of no readback shape, stay the release's own)."""
    bad = {**rw.READBACK_PARAMS, "remote_num_tokens": "100"}
    half = rw.scheduler_half("kv_consumer", None)
    with pytest.raises(TypeError):
        half.get_num_new_matched_tokens(rw.engine_request("r-bad", bad), 0)
    assert problems(bad, 2048, 32) == ["remote_num_tokens must be an integer, got '100'"]
    assert problems(rw.READBACK_PARAMS, 2048, 32) == []
    assert problems({"do_remote_decode": True, "remote_num_tokens": "100"}, 2048, 32) == []
    assert problems(bad, 2048, 32, readback=False) == []       # 0.19-0.20: no readback
