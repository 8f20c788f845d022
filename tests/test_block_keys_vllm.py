"""Issue 4 part 2: the ``block_keys`` patch with the REAL scheduler-side objects of the installed
vLLM (0.34.0 in the test venv; older releases: ``test_block_keys_releases.py``).

Every exchange (``tests/block_keys_scenarios.py``) runs vLLM's own ``Scheduler`` and NIXL
connector scheduler half on both sides: P finishes a ``do_remote_decode`` request and its
``update_from_output`` returns the ``kv_transfer_params`` (JSON round trip); D schedules the
request with those params.  "Remote load proceeds" = D parks the request in
``WAITING_FOR_REMOTE_KVS`` with its blocks queued for the NIXL read; "computed locally" = D
schedules the whole prompt itself and queues a receive with no blocks, the notification that
frees P's blocks (stock vLLM's path for a full local prefix hit).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import block_keys_scenarios as sc

from pdpatch.patches.block_keys import wrappers as bk

V = sc.version_of()                 # the installed release


@pytest.fixture(scope="module", autouse=True)
def _keep_pythonhashseed():
    saved = os.environ.get("PYTHONHASHSEED")
    yield
    if saved is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = saved


@pytest.fixture
def patched(fresh_pdpatch):
    states = fresh_pdpatch.install()
    assert states[bk.NAME].status == "active"
    return states[bk.NAME]


def assert_remote_load(obs: dict) -> None:
    st = obs["steps"][0]
    assert obs["waiting_for_remote"], obs
    assert st["scheduled_tokens"] == 0 and st["recv_listed"] and st["recv_blocks"] > 0, obs


def assert_local_compute(obs: dict, prompt_len: int = sc.PROMPT_LEN) -> None:
    st = obs["steps"][0]
    assert not obs["waiting_for_remote"], obs
    assert st["status"] == "RUNNING" and st["scheduled_tokens"] == prompt_len, obs
    assert obs["frees_p"], obs           # P is told to free its blocks
    assert obs["remote_prefill_flag"] is False, obs   # one transfer decision per request


def warnings_of(obs: dict) -> list[str]:
    return [line for line in obs["log"] if line.startswith("WARNING")]


def strip(obs: dict) -> dict:
    return {k: v for k, v in obs.items() if k not in ("log", "stats", "sent", "sent_bytes")}


# ---------------------------------------------------------------------------- installation


def test_targets_are_the_defining_classes(patched):
    sc.install_patch()                          # imports the NIXL modules: hooks fire
    labels = {t.target.label: t.status for t in patched.targets}
    nx = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
    assert labels == {
        f"{nx}.connector:NixlBaseConnector.request_finished": "wrapped",
        f"{nx}.connector:NixlBaseConnector.request_finished_all_groups": "wrapped",
        f"{nx}.pull_scheduler:NixlPullConnectorScheduler.get_num_new_matched_tokens": "wrapped",
        f"{nx}.push_scheduler:NixlPushConnectorScheduler.get_num_new_matched_tokens": "wrapped",
        "vllm.v1.engine.core:EngineCore.__init__": "wrapped",
    }


def test_toggle_off_leaves_vllm_alone(fresh_pdpatch, monkeypatch):
    monkeypatch.setenv("PDPATCH_BLOCK_KEYS", "0")
    states = fresh_pdpatch.install()
    assert states[bk.NAME].status == "skipped"
    obs = sc.run_mismatch("prompt_tail")
    assert obs["sent"] is None
    assert_remote_load(obs)                     # stock: loads P's KV despite the mismatch


# ---------------------------------------------------------------------------- stock behaviour


def test_stock_vllm_loads_remote_kv_even_when_p_and_d_disagree(fresh_pdpatch):
    """The bug this patch exists for: stock D pulls P's blocks for a different prompt tail,
    LoRA adapter or cache salt, and caches them under its own keys."""
    for name in ("prompt_tail", "lora", "cache_salt"):
        obs = sc.run_mismatch(name)
        assert obs["sent"] is None
        assert_remote_load(obs)


# ---------------------------------------------------------------------------- match


@pytest.mark.parametrize("name", list(sc.MATCHES))
def test_match_remote_load_proceeds_unchanged(patched, name):
    obs = sc.run_match(name)
    assert_remote_load(obs)
    assert obs["stats"]["sent"] == 1 and obs["stats"]["matched"] == 1, obs["stats"]
    assert warnings_of(obs) == []
    assert any("match D's" in line for line in obs["log"]), obs["log"]
    sent = obs["sent"]
    p, d = sc.MATCHES[name]
    assert sent["efp"]["algo"] == p.algo and sent["fp"]["algo"] == "sha256_cbor"
    assert sent["n"] == len(p.prompt) // p.block_size
    assert obs["d_keys"] == len(d.prompt) // d.block_size
    naming = [line for line in obs["log"] if "name blocks differently" in line]
    if sc.NAMING.get(name):
        assert len(naming) == 1 and f"({', '.join(sc.NAMING[name])})" in naming[0], naming
        assert naming[0].startswith("INFO")
    else:
        assert naming == []


def test_match_is_exactly_stock_behaviour(fresh_pdpatch):
    stock = sc.run_match("default")
    fresh_pdpatch.install()
    assert strip(sc.run_match("default")) == strip(stock)


def test_params_are_small_hex_json(patched):
    obs = sc.run_match("default")
    sent = obs["sent"]
    assert obs["sent_bytes"] < 1024
    assert all(len(k) == 64 and int(k, 16) >= 0 for k in sent["keys"])
    long = replace(sc.BASE, prompt=tuple(range(3, 2003)))       # 125 blocks
    obs = sc.exchange(long, long)
    assert_remote_load(obs)
    assert obs["sent"]["n"] == 125 and obs["sent_bytes"] < 512
    assert "keys" not in obs["sent"] and "kd" not in obs["sent"]   # digests only, no chain


def test_a_long_prompt_that_differs_is_caught_from_the_digests(patched):
    """P computes no key chain for a prompt longer than MAX_HEX_KEYS blocks; D still finds
    a changed token in its last full block and names the cause."""
    long = replace(sc.BASE, prompt=tuple(range(3, 2003)))
    changed = replace(long, prompt=(*long.prompt[:1990], 0, *long.prompt[1991:]))
    obs = sc.exchange(long, changed)
    assert_local_compute(obs, len(changed.prompt))
    assert obs["stats"]["causes"] == {"prompt": 1}, obs["stats"]


def test_p_sends_canonical_keys_of_the_prompt(patched):
    """P's hex keys are the canonical keys of the prompt blocks at P's block size -- not
    vLLM's own ``request.block_hashes`` (P's first generated token may complete one more
    block: not part of the prompt, not sent)."""
    from pdpatch.hashing.verdict import RequestInputs

    obs = sc.run_match("default")
    canonical = RequestInputs(sc.BASE.prompt, {}).canonical(16).keys
    assert obs["sent"]["keys"] == [k.hex() for k in canonical]
    assert obs["sent"]["keys"] != obs["p_block_hashes"][:sc.PROMPT_LEN // 16]
    edge = replace(sc.BASE, prompt=tuple(range(7, 7 + 95)))    # token 96 completes block 6
    obs = sc.exchange(edge, edge)
    assert len(obs["p_block_hashes"]) == 6 and obs["sent"]["n"] == 5
    assert_remote_load(obs)


# ---------------------------------------------------------------------------- mismatch


@pytest.mark.parametrize("name", list(sc.MISMATCHES))
def test_each_mismatch_computes_locally_and_warns(patched, name):
    obs = sc.run_mismatch(name)
    causes = sc.MISMATCHES[name][3]
    assert_local_compute(obs, len(sc.MISMATCHES[name][1].prompt))
    st = obs["stats"]
    assert st["mismatched"] == 1 and st["matched"] == 0, st
    assert st["causes"] == dict.fromkeys(causes, 1), st
    warns = warnings_of(obs)
    assert len(warns) == len(causes), warns
    for cause, line in zip(causes, warns, strict=True):
        assert f"do not match D's: {cause} -- {bk.CAUSE_HINTS[cause]}" in line, line
        assert "computing it locally" in line


def test_one_warning_per_cause_not_per_request(patched):
    first = sc.exchange(*sc.MISMATCHES["prompt"][:2])
    more = [sc.exchange(*sc.MISMATCHES["prompt"][:2], reset=False) for _ in range(3)]
    other = sc.exchange(*sc.MISMATCHES["cache_salt"][:2], reset=False)
    for obs in (first, *more, other):
        assert_local_compute(obs)
    assert len(warnings_of(first)) == 1
    assert all(warnings_of(o) == [] for o in more)
    assert len(warnings_of(other)) == 1 and ": cache_salt --" in warnings_of(other)[0]
    assert other["stats"]["mismatched"] == 5
    assert other["stats"]["causes"] == {"prompt": 4, "cache_salt": 1}


def test_xxhash_without_pythonhashseed_loads_remote_kv(patched):
    """vLLM draws NONE_HASH from os.urandom per engine: P's and D's own keys never agree, the
    KV does -- and stock vLLM transfers it; so does pdpatch."""
    side = replace(sc.BASE, algo="xxhash_cbor", seed=None)
    obs = sc.exchange(side, side)
    assert_remote_load(obs)
    assert obs["stats"]["matched"] == 1 and obs["stats"]["causes"] == {}, obs["stats"]
    assert obs["sent"]["efp"]["seed"] == "reported" and warnings_of(obs) == []


def test_warn_policy_only_warns(patched, monkeypatch):
    monkeypatch.setenv(bk.ON_MISMATCH_ENV, "warn")
    obs = sc.run_mismatch("prompt_tail")
    assert_remote_load(obs)
    assert obs["stats"]["mismatched"] == 1
    assert "loading P's KV anyway" in warnings_of(obs)[0]


def test_decision_is_made_once_per_request(patched):
    """A request D could not place this step is asked again; it is judged (and counted)
    once, and stays computed locally."""
    obs = sc.run_mismatch("prompt_tail", steps=3)
    assert obs["stats"]["mismatched"] == 1
    assert obs["steps"][0]["scheduled_tokens"] == sc.PROMPT_LEN


def test_push_mode_mismatch_computes_locally_and_frees_p_when_done(patched):
    p = replace(sc.BASE, connector="NixlPushConnector")
    d = replace(p, salt="other")
    ok = sc.exchange(p, p)
    assert ok["waiting_for_remote"] and ok["stats"]["matched"] == 1, ok
    obs = sc.exchange(p, d, finish=True)
    first, last = obs["steps"][0], obs["steps"][-1]
    assert first["status"] == "RUNNING" and first["scheduled_tokens"] == sc.PROMPT_LEN, obs
    assert not first["recv_listed"]             # push: no registration sent to P
    assert obs["finished"] and last["recv_listed"] and last["recv_blocks"] == 0, obs
    assert obs["stats"]["causes"] == {"cache_salt": 1}


# ------------------------------------------------------- P stops short of the prompt's end


def test_stock_vllm_moves_the_prompt_less_its_last_token_on_mamba(fresh_pdpatch):
    """What the release does for a Mamba hybrid: P computes all but the last prompt token, D
    loads that prefix (pdpatch must hash exactly it on both sides)."""
    obs = sc.run_truncated("same_prompt")
    assert obs["sent"] is None and obs["p_computed"] == sc.PROMPT_LEN - 1
    assert_remote_load(obs)


@pytest.mark.parametrize("name", list(sc.TRUNCATED))
def test_p_stopping_short_is_judged_on_the_prefix_that_moves(patched, name):
    """Where P stops short (Mamba 0.19+, MTP 0.31+, bounded replay 0.32+), both sides hash the
    prefix P computed and D loads: the same request loads (it was a 'prompt' mismatch, and
    recomputed, before), a prompt that differs inside it does not, and the token D recomputes
    itself does not count."""
    p, d, causes = sc.TRUNCATED[name]
    obs = sc.run_truncated(name)
    assert obs["p_computed"] == len(p.prompt) - 1
    assert obs["sent"]["x"]["nt"] == len(p.prompt) - 1
    if not causes:
        assert_remote_load(obs)
        assert obs["stats"]["matched"] == 1 and obs["stats"]["causes"] == {}, obs["stats"]
        assert warnings_of(obs) == []
    else:
        assert_local_compute(obs, len(d.prompt))
        assert obs["stats"]["causes"] == dict.fromkeys(causes, 1), obs["stats"]


def test_a_request_whose_connector_answer_vllm_ignores_is_not_judged(patched):
    """0.31+: the scheduler drops the connector's hit for a request that reads no external KV
    (0.34.0 scheduler.py L1182-1183), and from 0.32 P does not cut such a request
    (base_scheduler.py L429): nothing is loaded, so nothing is judged or counted -- D would
    otherwise hash one token less than P and count a 'prompt' mismatch."""
    side = replace(sc.MAMBA, skip_prefix_cache=True)
    obs = sc.exchange(side, side)
    assert obs["p_computed"] == sc.PROMPT_LEN
    assert_local_compute(obs)
    stats = obs["stats"]
    assert stats["sent"] == 1 and stats["matched"] == stats["mismatched"] == 0, stats
    assert stats["causes"] == {} and warnings_of(obs) == []


def test_truncated_prompt_with_an_image_across_the_cut(patched):
    """P's release cuts its prompt (and, for a mixed prompt, not its embeddings) before the
    prefill; a multimodal item spanning the cut is clipped alike on P and D, so the digests P
    sends match D's prefix -- and still tell another image apart."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from pdpatch import vllm_sites
    from pdpatch.hashing.key_params import parse_params
    from pdpatch.hashing.verdict import build_p_params, judge

    def with_image(req, ident):
        req.mm_features = [MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident, mm_hash=ident,
            mm_position=PlaceholderRange(offset=sc.PROMPT_LEN - 30, length=30))]
        return req

    p_sched = sc.scheduler(sc.MAMBA, "kv_producer")
    d_sched = sc.scheduler(sc.MAMBA, "kv_consumer")
    p_req = with_image(sc.request(sc.MAMBA, p_sched, "p", {"do_remote_decode": True}, 1), "img")
    p_half = p_sched.connector.connector_scheduler
    vllm_sites.lookup(vllm_sites.P_PROMPT_TRUNCATION, V)   # the site exists for this release
    p_half.on_new_request(p_req)                           # the release cuts the prompt here
    assert p_req.num_prompt_tokens == sc.PROMPT_LEN - 1
    engine = bk._engine_keys_for(p_half, V)
    sent = parse_params(build_p_params(
        engine, bk._request_inputs(p_req, upto=p_req.num_prompt_tokens), bk.MAX_HEX_KEYS))
    d_half = d_sched.connector.connector_scheduler
    for ident, status in (("img", "match"), ("other", "mismatch")):
        d_req = with_image(sc.request(sc.MAMBA, d_sched, ident, {"do_remote_prefill": True}, 4),
                           ident)
        upto = vllm_sites.remote_prefill_tokens(d_half, d_req, V)
        assert upto == sc.PROMPT_LEN - 1
        verdict = judge(engine, bk._request_inputs(d_req, upto), sent)
        assert verdict.status == status, verdict
    # without the cut on D, the very same request would not match: what the fix is for
    assert judge(engine, bk._request_inputs(with_image(sc.request(
        sc.MAMBA, d_sched, "x", {"do_remote_prefill": True}, 4), "img")), sent).causes \
        == ("prompt", "mm")


# ---------------------------------------------------------------------------- untrusted input


@pytest.mark.parametrize("name", list(sc.MALFORMED))
def test_malformed_params_are_rejected_cleanly(patched, name):
    marker = "/tmp/pdpatch-block-keys-pwned"
    if os.path.exists(marker):
        os.remove(marker)
    obs = sc.run_malformed(name)
    assert_local_compute(obs)
    assert obs["stats"]["rejected"] == 1 and obs["stats"]["errors"] == 0, obs["stats"]
    warns = warnings_of(obs)
    assert len(warns) == 1 and "rejected the block-key params" in warns[0], warns
    assert len(warns[0]) < 600                  # the peer's data is not echoed unbounded
    assert not os.path.exists(marker)


@pytest.mark.parametrize(("name", "why"), [
    ("stock_p", "sends no block keys"),
    ("other_version", "sends block-key params version 2, this pdpatch reads version 3"),
])
def test_unchecked_peer_is_loaded_with_one_info_line(patched, name, why):
    obs = sc.run_unchecked(name)
    assert_remote_load(obs)
    assert obs["stats"]["unchecked"] == 1 and warnings_of(obs) == []
    info = [line for line in obs["log"] if why in line]
    assert len(info) == 1 and info[0].startswith("INFO"), obs["log"]


def test_stock_p_info_line_once_per_p(patched):
    sc.run_unchecked("stock_p")
    again = sc.exchange(sc.BASE, sc.BASE, sc._drop_params, reset=False)
    assert_remote_load(again)
    assert again["stats"]["unchecked"] == 2
    assert not any("sends no block keys" in line for line in again["log"])  # once per P


# ---------------------------------------------------------------------------- engine start


def test_engine_start_logs_its_fingerprint(patched, caplog):
    """The EngineCore post-hook on the installed release's real Scheduler (EngineCore itself
    needs a model executor; the hook reads only ``request_block_hasher`` and ``scheduler``)."""
    sched = sc.scheduler(sc.BASE, "kv_consumer")
    sc.init_hashing(sc.BASE)
    hook = bk.make_engine_hook(V)
    fake_core = SimpleNamespace(request_block_hasher=object(), scheduler=sched)
    lg = logging.getLogger("pdpatch")
    lg.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="pdpatch"):
            hook(lambda: None, fake_core, (), {})
    finally:
        lg.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "fingerprint" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    line = lines[0]
    for part in ("kv_role=kv_consumer", "algo=sha256", "seed=PYTHONHASHSEED",
                 "none_hash_id=", "hash_block_size=16", f"vllm={V}"):
        assert part in line, line
    # engines with different seeds log different lines: the operator's diff shows it
    os.environ["PYTHONHASHSEED"] = "1"
    sc.init_hashing(replace(sc.BASE, seed="1"))
    other = bk._engine_keys_for(sched, V).describe()
    assert other != line.split(": ", 1)[1].split(" [block_keys")[0]


def test_hash_block_size_site_matches_the_scheduler():
    for bs in (16, 32):
        sched = sc.scheduler(replace(sc.BASE, block_size=bs), "kv_consumer")
        from pdpatch import vllm_sites

        assert vllm_sites.hash_block_size(sched.vllm_config, sched.kv_cache_config, V) \
            == sched.hash_block_size == bs
