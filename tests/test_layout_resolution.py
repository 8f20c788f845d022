"""Layout override on the installed vLLM (0.29+: 0.34 in the test venv): the EngineCore path
(``resolve_kv_cache_layout``).

kvcached cannot run without CUDA, so "kvcached runs in this engine" is its module globals stood in
by a module object under kvcached's real module name (what :mod:`pdpatch.kvcached` reads); the
forced path needs no stand-in at all.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import kvc_harness as h
import pytest

from pdpatch import kvcached

pytestmark = pytest.mark.filterwarnings("ignore")

TOKEN_MAJOR, HEAD_MAJOR = "LBNHC", "LBHNC"
CUDA_LIKE = [["LBNHC", "LBHNC", "BLNHC", "BLHNC"]]   # what FLASH_ATTN-class workers report
CPU_ATTN = [["LBHNC"]]                               # head-major only


@pytest.fixture
def kvcached_running(monkeypatch):
    mod = types.ModuleType(kvcached.INTERFACES_MODULE)
    mod._kvcached_initialized = True     # set by kvcached's EngineCore.__init__ patch
    mod._is_worker = False
    mod._contiguous_layout = False
    mod._created_kv_tensor_capacity = {}
    monkeypatch.setitem(sys.modules, kvcached.INTERFACES_MODULE, mod)
    return mod


@pytest.fixture
def patched(fresh_pdpatch, monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    fresh_pdpatch.install()              # a fresh state for every patch
    yield fresh_pdpatch


def resolve(cfg, supported=CUDA_LIKE):
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    return resolve_kv_cache_layout(cfg, supported, []).name


def cfg(**kw):
    return h.vllm_config(layout=None, **kw)


def test_without_pdpatch_nixl_gets_head_major(fresh_pdpatch, kvcached_running):
    assert resolve(cfg()) == HEAD_MAJOR


def test_kvcached_running_makes_it_token_major(patched, kvcached_running):
    c = cfg()
    assert resolve(c) == TOKEN_MAJOR
    assert c.cache_config.kv_cache_layout == TOKEN_MAJOR
    assert patched.status()["patches"]["layout"]["runtime"] == "layout=token-major(checked)"


def test_without_kvcached_vllms_choice_stands(patched):
    assert resolve(cfg()) == HEAD_MAJOR
    assert patched.status()["patches"]["layout"]["runtime"] == "layout=vllm"


def test_forced_by_extra_config(patched):
    assert resolve(cfg(extra={"pdpatch": {"layout_force": True}})) == TOKEN_MAJOR


def test_forced_by_environment(fresh_pdpatch, monkeypatch):
    monkeypatch.setenv("PDPATCH_LAYOUT_FORCE", "1")
    fresh_pdpatch.install()              # the settings accept the variable the patch declares
    assert resolve(cfg()) == TOKEN_MAJOR
    monkeypatch.setenv("PDPATCH_LAYOUT_FORCE", "0")
    assert resolve(cfg()) == HEAD_MAJOR


def test_switched_off_by_extra_config(patched, kvcached_running):
    assert resolve(cfg(extra={"pdpatch": {"layout": False}})) == HEAD_MAJOR


def test_engine_core_binding_is_the_wrapped_one(patched, kvcached_running):
    """EngineCore calls the name it imported; both bindings carry the check."""
    from vllm.v1.engine import core

    c = cfg()
    assert core.resolve_kv_cache_layout(c, CUDA_LIKE, []).name == TOKEN_MAJOR


def test_push_connector_answers_token_major_too(patched, kvcached_running):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlPullConnector,
        NixlPushConnector,
    )

    c = cfg()
    assert NixlPushConnector.get_required_kvcache_layout(c) == TOKEN_MAJOR
    assert NixlPullConnector.get_required_kvcache_layout(c) == TOKEN_MAJOR


def test_head_major_only_backend_fails_naming_the_backend(patched, kvcached_running):
    from pdpatch.patches.layout.wrappers import LayoutForcedError

    with pytest.raises(LayoutForcedError,
                       match=r"LBHNC is in force, but this engine needs LBNHC \(kvcached "
                             r"initialised.*the attention backend supports only \['LBHNC'\]"):
        resolve(cfg(), CPU_ATTN)


def test_multiconnector_sibling_fails_naming_the_sibling(patched, kvcached_running):
    from pdpatch.patches.layout.wrappers import LayoutForcedError

    c = cfg(kv_connector="MultiConnector", kv_role="kv_both", extra={"connectors": [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
    ]})
    with pytest.raises(LayoutForcedError,
                       match=r"MultiConnector sibling OffloadingConnector requires LBHNC; "
                             r"remove it"):
        resolve(c)


def test_env_override_fails_naming_the_variable(patched, kvcached_running, monkeypatch):
    from pdpatch.patches.layout.wrappers import LayoutForcedError

    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    with pytest.raises(LayoutForcedError, match="VLLM_KV_CACHE_LAYOUT=HND is set"):
        resolve(cfg())


def test_mla_is_left_alone(patched, kvcached_running, monkeypatch):
    from pdpatch.patches.layout.wrappers import decide

    c = cfg()
    monkeypatch.setattr(type(c.model_config), "use_mla", property(lambda self: True))
    assert decide(c) == (False, "MLA model: the layout does not matter, vLLM's choice stands")


@pytest.mark.parametrize(("role", "permute", "env", "level", "text"), [
    ("kv_consumer", False, "1", logging.INFO, "its NIXL workers run with enable_permute_local_kv"),
    ("kv_consumer", True, "1", logging.INFO, "its NIXL workers run with enable_permute_local_kv"),
    ("kv_consumer", False, "0", logging.WARNING, "set kv_transfer_config.enable_permute_local_kv"
                                                 "=true on this decode engine (PDPATCH_LAYOUT"),
    ("kv_producer", False, "1", logging.WARNING, "rejects a token-major prefill"),
])
def test_operator_is_told_about_a_head_major_peer(patched, kvcached_running, monkeypatch, role,
                                                 permute, env, level, text):
    monkeypatch.setenv("PDPATCH_LAYOUT_PERMUTE", env)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("pdpatch").addHandler(handler)
    try:
        resolve(cfg(kv_role=role, permute=permute))
    finally:
        logging.getLogger("pdpatch").removeHandler(handler)
    hints = [r for r in records if "stock" in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == level and text in hints[0].getMessage()


def test_active_in_a_fresh_engine_process_through_the_real_bootstrap(tmp_path):
    """A new interpreter with ENABLE_PDPATCH=true (the .pth hook, as in an EngineCore process)
    resolves token-major through EngineCore's own binding."""
    script = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import kvc_harness as h
from vllm.v1.engine import core
c = h.vllm_config(layout=None, extra={{"pdpatch": {{"layout_force": True}}}})
from pdpatch import installer
print(json.dumps({{"layout": core.resolve_kv_cache_layout(c, {CUDA_LIKE!r}, []).name,
                  "summary": installer.summary_line()}}))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPATCH_")}
    env.update(ENABLE_PDPATCH="true", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["layout"] == TOKEN_MAJOR
    assert "layout" in result["summary"].split("ready=[")[1].split("]")[0]
