"""pdpatch reaches every process: .pth hook, plugin entry point, fork/spawn/forkserver, -I."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pdpatch_child import run_json

from pdpatch.versions import vllm_version

HERE = Path(__file__).parent
CHILD = HERE / "activation_child.py"
SUMMARY = "[pdpatch] pdpatch: pid="
XDIST_SPREAD = True      # each test starts its own processes (tests/xdist_groups.py)


def run_child(mode: str, *, enable: bool, flags: tuple[str, ...] = ()) -> tuple[dict, str]:
    return run_json([*flags, str(CHILD), mode], enable=enable, cwd=HERE)


def summary_pids(stderr: str) -> list[int]:
    return [int(line.split("pid=")[1].split()[0]) for line in stderr.splitlines()
            if SUMMARY in line]


def test_enabled_process_is_patched_and_logs_one_summary_line():
    result, err = run_child("self", enable=True)
    assert result["wrapped"] and result["installed"]
    assert summary_pids(err) == [result["pid"]]
    assert f"role=main vllm={vllm_version()} ready=[" in err


def test_unset_switch_wraps_nothing_and_logs_nothing():
    result, err = run_child("self", enable=False)
    assert not result["wrapped"] and not result["installed"]
    assert SUMMARY not in err


def test_isolated_mode_still_runs_the_pth_hook():
    result, _ = run_child("self", enable=True, flags=("-I",))
    assert result["wrapped"]


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_children_of_every_start_method_are_patched(method):
    result, err = run_child(method, enable=True)
    child = result["child"]
    assert child["wrapped"] and child["installed"], result
    pids = summary_pids(err)
    assert result["parent"] in pids and child["pid"] in pids, err
    assert f"pid={child['pid']} role=worker-7" in err or method == "forkserver"


def test_switch_set_after_start_activates_through_the_plugin_entry_point():
    result, err = run_child("late-env", enable=False)
    assert not result["before"]["wrapped"]
    assert result["after"]["wrapped"] and result["after"]["installed"]
    assert len(summary_pids(err)) == 1


@pytest.mark.parametrize("setting", [{"ENABLE_PDPATCH": "maybe"},
                                     {"ENABLE_PDPATCH": "1", "PDPATCH_KV_STAGING_MIB": "-1"}],
                         ids=["switch", "option"])
def test_invalid_setting_fails_vllm_plugin_loading_with_a_clear_message(setting):
    """A patch's option too is checked at startup, not when the patch first reads it."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", **setting)
    out = subprocess.run(
        [sys.executable, "-c", "from vllm.plugins import load_general_plugins as f; f()"],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    var, raw = list(setting.items())[-1]
    assert f"{var}={raw!r} is not a valid value; accepted: " in out.stderr


def _site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def test_pth_costs_nothing_in_a_process_that_never_imports_vllm():
    """The ``.pth`` runs in every interpreter of the environment: it must not import wrapt
    (and with it asyncio and importlib.metadata, ~55 ms) until ``vllm`` is looked up."""
    code = ("import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0]"
            " in ('wrapt', 'pdpatch', 'asyncio', 'vllm'))))")
    env = dict(os.environ, ENABLE_PDPATCH="true")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == ["pdpatch", "pdpatch.bootstrap", "pdpatch.bootstrap.autoload"]


LAZY_CORES = """
import json, sys
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # wraps its methods
import pdpatch.installer
cores = ("pdpatch.hashing", "pdpatch.kv", "pdpatch.transport", "pdpatch.block_counts")
print(json.dumps({"installed": pdpatch.installer.status()["installed"],
                  "wrapped": hasattr(base_worker.NixlBaseConnectorWorker.add_remote_agent,
                                     "__wrapped__"),
                  "cores": sorted(m for m in sys.modules
                                  if m in cores or m.startswith(tuple(c + "." for c in cores)))}))
"""


def test_install_leaves_the_patch_cores_to_their_first_use():
    """install() runs inside every ``import vllm`` (API server, EngineCore, each worker): the
    hashing, descriptor-planning, transport and block-count cores (~15 ms of imports) are
    loaded by the first request or KV registration that needs them, not by wrapping."""
    result, _ = run_json(["-c", LAZY_CORES], enable=True)
    assert result["installed"] and result["wrapped"]
    assert result["cores"] == []


HOOK_ORDER = """
import json, sys
sys.path[:0] = [{root!r}, {site!r}]   # -S: the editable install's .pth did not run
order = []
def earlier(_m): order.append("earlier")
if {wrapt_first}:               # kvcached's .pth sorts first and registers its wrapt hook
    import wrapt
    wrapt.register_post_import_hook(earlier, "vllm")
import pdpatch.bootstrap.autoload as autoload
autoload.init()
autoload.init()                 # idempotent
if not {wrapt_first}:           # a hook registered after the .pth ran, before vllm is imported
    import wrapt
    wrapt.register_post_import_hook(earlier, "vllm")
import pdpatch.bootstrap.entry as entry
real = entry.activate
entry.activate = lambda **kw: (order.append("pdpatch"), real(**kw))
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from pdpatch.versions import vllm_version
print(json.dumps({{"order": order,
                   "wrapped": hasattr(base_worker.NixlBaseConnectorWorker.add_remote_agent,
                                      "__wrapped__")}}))
"""


@pytest.mark.parametrize("wrapt_first", [True, False])
def test_vllm_import_hook_fires_once_after_earlier_hooks(wrapt_first):
    """``-S``: no .pth runs, the test plays the site module's part in a controlled order."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPATCH_")}
    env.update(ENABLE_PDPATCH="true", VLLM_TARGET_DEVICE="cpu")
    code = HOOK_ORDER.format(root=str(HERE.parent), site=_site_packages(),
                            wrapt_first=wrapt_first)
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=HERE,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"order": ["earlier", "pdpatch"], "wrapped": True}, out.stderr[-2000:]
