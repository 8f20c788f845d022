"""`pdpatch doctor`: reports ways in, settings and per-patch verdicts; exit 1 when broken."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from newer_release import NEXT, newer_release
from venvs import DEPS, bare_venv, clean_env, site_packages

ROOT = Path(__file__).resolve().parents[1]
PULL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
READ = "NixlPullConnectorWorker._read_blocks_for_req"


def doctor(python: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pdpatch", "doctor", *args], env=clean_env(**env),
                          capture_output=True, text=True, timeout=300)


def test_healthy_install_reports_ways_in_and_patch_targets():
    out = doctor(sys.executable, ENABLE_PDPATCH="1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "pdpatch_autoload.pth" in out.stdout
    assert "entry point: pdpatch -> pdpatch.bootstrap.plugin:load" in out.stdout
    assert "patch read_guard: would apply (default)" in out.stdout
    assert "NixlPullConnectorWorker._read_blocks_for_req: present" in out.stdout
    assert "block-key encoder: compiled" in out.stdout
    assert f"pdpatch package: {ROOT / 'pdpatch'} (vllm-pdpatch " in out.stdout
    assert f"(editable: {ROOT}))" in out.stdout
    # only what holds for this installation: vLLM's own import warnings stay out
    assert "Failed to import from vllm._C" not in out.stdout + out.stderr


def test_json_output_and_toggle_reason():
    out = doctor(sys.executable, "--json", "--no-import", ENABLE_PDPATCH="1",
                 PDPATCH_READ_GUARD="0")
    data = json.loads(out.stdout)
    assert data["patches"]["read_guard"] == {"status": "skipped",
                                             "reason": "toggled off (PDPATCH_READ_GUARD=0)"}
    assert data["problems"] == []
    assert data["c_encoder"] is True


def test_patch_options_are_reported_with_their_values():
    out = doctor(sys.executable, "--no-import", ENABLE_PDPATCH="1",
                 PDPATCH_KV_STAGING_MIB="64")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "  option PDPATCH_KV_STAGING_MIB=64" in out.stdout
    assert "  option PDPATCH_BLOCK_KEYS_ON_MISMATCH: not set (default recompute)" in out.stdout


@pytest.mark.parametrize("var,raw,accepted", [
    ("ENABLE_PDPATCH", "maybe", "1/true/yes/on or 0/false/no/off"),
    ("PDPATCH_KV_STAGING_MIB", "abc", "0-65536 MiB"),
    ("PDPATCH_KV_STAGING_MIB", "-1", "0-65536 MiB"),
    ("PDPATCH_KV_GAP_KIB", "-5", "0-1048576 KiB, or `auto`"),
])
def test_invalid_setting_is_a_problem(var, raw, accepted):
    out = doctor(sys.executable, "--no-import", **{var: raw})
    assert out.returncode == 1, out.stdout
    assert f"PROBLEM: invalid setting: {var}={raw!r} is not a valid value; accepted: " \
        f"{accepted}" in out.stdout


def test_vllm_plugins_allowlist_without_pdpatch_is_reported():
    out = doctor(sys.executable, "--no-import", VLLM_PLUGINS="lora_filesystem_resolver")
    assert "does not list 'pdpatch': the plugin path is off" in out.stdout


def test_enabled_without_any_way_in_exits_non_zero(tmp_path):
    # pdpatch importable from a checkout but not installed: no .pth, no dist-info (so no entry
    # point); only its own dependencies are visible.
    deps = tmp_path / "deps"
    deps.mkdir()
    for entry in Path(DEPS).iterdir():
        if entry.name.split("-")[0].split(".")[0] in ("wrapt", "packaging", "cbor2", "_cbor2",
                                                     "xxhash", "numpy"):
            (deps / entry.name).symlink_to(entry)
    venv = bare_venv(tmp_path / "v", ROOT)
    (site_packages(venv) / "000-deps.pth").write_text(f"{deps}\n{ROOT}\n")
    out = doctor(str(venv / "bin" / "python"), "--no-import", ENABLE_PDPATCH="1")
    assert out.returncode == 1, out.stdout
    assert "no way in is visible to this interpreter" in out.stdout


def test_a_newer_vllm_whose_code_changed_is_a_problem_naming_the_patches_off(tmp_path):
    """An operator who upgrades vLLM past what pdpatch verified must not lose fixes unwarned:
    a patch whose vLLM code changed is named with what changed, and the opt-in; a patch whose
    code is unchanged applies.  (The newer release: the installed one's real modules with one
    line added to the read path, as doctor reads them without importing vLLM.)"""
    newer_release(tmp_path, (PULL, READ), "_pdpatch_edit = 1")
    info = tmp_path / f"vllm-{NEXT}.dist-info"           # what the distribution reports
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {NEXT}\n")
    env = {"ENABLE_PDPATCH": "1", "PYTHONPATH": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = doctor(sys.executable, "--no-import", **env)
    assert out.returncode == 1, out.stdout
    [line] = [ln for ln in out.stdout.splitlines() if "newer than the releases" in ln]
    assert line.startswith(f"PROBLEM: vLLM {NEXT} is newer")
    assert "read_guard (NixlPullConnectorWorker._read_blocks_for_req)" in line
    assert "PDPATCH_ALLOW_UNTESTED_VLLM=1" in line
    assert "mla_notif" not in line                      # fixed upstream in 0.21: not "lost"
    assert "patch peer_check: would apply (vLLM" in out.stdout
    assert "identical to" in out.stdout
    opted_in = doctor(sys.executable, "--no-import", PDPATCH_ALLOW_UNTESTED_VLLM="1", **env)
    assert opted_in.returncode == 0, opted_in.stdout
    assert "patch read_guard: would apply" in opted_in.stdout
