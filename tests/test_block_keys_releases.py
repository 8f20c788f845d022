"""The ``block_keys`` patch on every extracted OLD vLLM release (0.19-0.33), real code.

Each release runs ``block_keys_scenarios.release_report`` in a subprocess whose ``vllm`` is that
release's source tree (``tests/versions_harness.py``): its own ``Scheduler``, NIXL connector
(single-file ``nixl_connector.py`` in 0.19, the ``nixl`` package from 0.20, pull/push split from
0.24), ``Request`` and block hasher.  Stock first (no pdpatch), then with pdpatch installed.
The installed release (0.34 in the test venv) runs in process (``test_block_keys_vllm.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import block_keys_scenarios as sc
import pytest
from packaging.version import Version
from versions_harness import releases_in, run_in_release

from pdpatch import vllm_sites
from pdpatch.patches import block_keys

OLD_RELEASES = releases_in(block_keys.PATCH.versions)


@functools.cache
def report(version: str) -> dict[str, Any]:
    run = run_in_release(version, "import block_keys_scenarios as sc\n"
                                  "emit(sc.safe(sc.release_report))\n", timeout=1200)
    result = run.check()
    if "error" in result:
        raise AssertionError(f"scenarios could not run on vLLM {version}:\n{result['error']}")
    return result


def _release(ver: str) -> dict[str, Any]:
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    return report(ver)


def remote_load(obs: dict) -> bool:
    st = obs["steps"][0]
    return obs["waiting_for_remote"] and st["scheduled_tokens"] == 0 and st["recv_blocks"] > 0


def local_compute(obs: dict, prompt_len: int) -> bool:
    st = obs["steps"][0]
    return (not obs["waiting_for_remote"] and st["status"] == "RUNNING"
            and st["scheduled_tokens"] == prompt_len and obs["frees_p"])


@pytest.mark.parametrize("ver", OLD_RELEASES)
def test_hooks_wrap_the_defining_classes(ver):
    rep = _release(ver)
    v = Version(ver)
    assert rep["version"] == ver
    assert rep["install"]["status"] == "active", rep["install"]
    want = {f"{s.module}:{s.qualname}"
            for table in (vllm_sites.REQUEST_FINISHED, vllm_sites.REQUEST_FINISHED_ALL_GROUPS,
                          vllm_sites.GET_NUM_NEW_MATCHED_TOKENS, vllm_sites.ENGINE_CORE_INIT)
            for s in vllm_sites.lookup_all(table, v)}
    assert rep["install_after"] == dict.fromkeys(want, "wrapped"), rep["install_after"]
    # the site's hash block size is what that release's Scheduler uses
    assert rep["hash_block_size"] == {"16": 16, "32": 32}


@pytest.mark.parametrize("ver", OLD_RELEASES)
def test_stock_release_loads_despite_a_different_prompt(ver):
    rep = _release(ver)
    assert remote_load(rep["stock"]["match"])
    assert remote_load(rep["stock"]["prompt_tail"])    # the bug
    assert rep["stock"]["prompt_tail"]["sent"] is None


@pytest.mark.parametrize("ver", OLD_RELEASES)
def test_matches_load_remote_kv(ver):
    rep = _release(ver)
    for name in sc.MATCHES:
        obs = rep["patched"][f"match:{name}"]
        assert remote_load(obs), (name, obs)
        assert obs["stats"]["matched"] == 1 and obs["stats"]["sent"] == 1, (name, obs["stats"])
        assert obs["sent"]["efp"]["vllm"] == ver
        if name != "sha256_seed_unset":       # its naming depends on the release: below
            naming = [line for line in obs["log"] if "name blocks differently" in line]
            assert len(naming) == (1 if sc.NAMING.get(name) else 0), (name, obs["log"])


@pytest.mark.parametrize("ver", OLD_RELEASES)
def test_each_mismatch_computes_locally(ver):
    rep = _release(ver)
    for name, (_, d, _, causes) in sc.MISMATCHES.items():
        obs = rep["patched"][f"mismatch:{name}"]
        assert local_compute(obs, len(d.prompt)), (name, obs)
        assert obs["stats"]["causes"] == dict.fromkeys(causes, 1), (name, obs["stats"])
        assert sum(line.startswith("WARNING") for line in obs["log"]) == len(causes), obs["log"]


@pytest.mark.parametrize("ver", OLD_RELEASES)
def test_malformed_params_rejected_and_stock_p_unchecked(ver):
    rep = _release(ver)
    for name in sc.MALFORMED:
        obs = rep["patched"][f"malformed:{name}"]
        assert local_compute(obs, sc.PROMPT_LEN), (name, obs)
        assert obs["stats"]["rejected"] == 1 and obs["stats"]["errors"] == 0, (name, obs)
    for name in ("stock_p", "other_version"):
        obs = rep["patched"][name]
        assert remote_load(obs) and obs["stats"]["unchecked"] == 1, (name, obs)


@pytest.mark.parametrize("ver", OLD_RELEASES)
def test_unset_pythonhashseed_still_loads_remote_kv(ver):
    """vLLM's default: up to 0.28 every algorithm, and xxhash in every release, draws
    NONE_HASH from os.urandom in each engine; the canonical keys do not depend on it."""
    rep = _release(ver)
    for name in ("sha256_seed_unset", "xxhash_seed_unset"):
        obs = rep["patched"][f"match:{name}"]
        random = name == "xxhash_seed_unset" or Version(ver) < Version("0.29")
        assert obs["sent"]["efp"]["seed"] == ("reported" if random else "default"), obs
        assert any("name blocks differently" in line for line in obs["log"]) == random


@pytest.mark.parametrize("ver", OLD_RELEASES)
def test_p_stopping_short_is_judged_on_the_prefix_that_moves(ver):
    """Mamba hybrids (every release 0.19+): the release's P computes all but the prompt's last
    token and its D loads that prefix; pdpatch hashes exactly it on both sides, so the same
    request loads (it was a 'prompt' mismatch, recomputed on D, before) and a prompt that
    differs inside it does not."""
    rep = _release(ver)
    stock = rep["stock"]["truncated:same_prompt"]
    assert stock["p_computed"] == sc.PROMPT_LEN - 1 and remote_load(stock), stock
    for name, (p, d, causes) in sc.TRUNCATED.items():
        obs = rep["patched"][f"truncated:{name}"]
        assert obs["p_computed"] == len(p.prompt) - 1, (name, obs)
        assert obs["sent"]["x"]["nt"] == len(p.prompt) - 1, (name, obs["sent"])
        if causes:
            assert local_compute(obs, len(d.prompt)), (name, obs)
            assert obs["stats"]["causes"] == dict.fromkeys(causes, 1), (name, obs["stats"])
        else:
            assert remote_load(obs), (name, obs)
            assert obs["stats"]["matched"] == 1 and obs["stats"]["causes"] == {}, (name, obs)
            assert not any(line.startswith("WARNING") for line in obs["log"]), obs["log"]
