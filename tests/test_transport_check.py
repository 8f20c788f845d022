"""The startup transport check: findings logged once per process after KV registration."""

from __future__ import annotations

import logging

import pytest
import robust_matrix
import torch

from pdpatch import installer
from pdpatch.patches.transport_check import wrappers as transport_check


class _Worker:
    kv_buffer_device = "cuda"


def test_gpu_kv_with_default_ucx_settings_warns_about_cuda_ipc_reads(monkeypatch, caplog):
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    installer.reset_state()
    caches = {"layer0": torch.zeros(4)}
    with caplog.at_level(logging.WARNING, logger="pdpatch"):
        register = transport_check.check_after_register
        out = register(lambda kv: "registered", _Worker(), (caches,), {})
        register(lambda kv: "registered", _Worker(), (caches,), {})
    assert out == "registered"
    warnings = [r.getMessage() for r in caplog.records if "cuda-ipc-get-auto" in r.getMessage()]
    assert len(warnings) == 1 and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on" in warnings[0]


def test_host_kv_buffers_have_no_findings(monkeypatch):
    worker = _Worker()
    worker.kv_buffer_device = "cpu"
    assert transport_check.findings_for(worker, {"layer0": torch.zeros(4)}) == []


@pytest.mark.parametrize(("role", "push", "finding"), [
    ("kv_consumer", False, False),   # D's READs into its own pool: runs z, ce, cn at cuda_ipc pace
    ("kv_producer", False, True),    # P's pool, read by D
    ("kv_both", False, True),
    ("kv_consumer", True, True),     # push mode: P WRITEs into D's pool
    ("kv_producer", True, False),
])
def test_vmm_memory_is_a_finding_only_where_peers_map_it(monkeypatch, role: str, push: bool,
                                                        finding: bool) -> None:
    """kvcached's pool (CUDA VMM without an IPC handle; faked: no VMM on this machine) on a
    worker of each role and transfer mode.  Before, a decode worker in pull mode logged an
    [error] saying its READs crossed TCP loopback, where they ran at stock pace."""
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    from pdpatch import transport

    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    monkeypatch.setattr(transport, "probe_memory", lambda ptr, label="": transport.MemoryFacts(
        transport.KIND_VMM, False, transport.HANDLE_POSIX_FD, label))
    cfg = KVTransferConfig(kv_connector="NixlConnector", kv_role=role)
    if push:        # the release's own push worker class, its state set as a test's
        worker = object.__new__(NixlPushConnectorWorker)
        worker.kv_buffer_device, worker.kv_transfer_config = "cuda", cfg
    else:
        worker = SimpleNamespace(kv_buffer_device="cuda", kv_transfer_config=cfg)
    codes = [f.code for f in transport_check.findings_for(worker, {"l0": torch.zeros(4)})]
    assert codes == (["vmm-no-ipc-handle"] if finding else [])


@pytest.mark.parametrize("extensible", [True, False, None])
def test_vmm_finding_names_vllms_extensible_cache_where_that_is_the_memory(
        monkeypatch, extensible: bool | None) -> None:
    """vLLM 0.34's own extensible KV cache is CUDA VMM memory; without a FABRIC handle (no
    IMEX channel, forced on with ``--enable-extensible-kv-cache``) peers cannot map it either.
    Where the engine's config says it is on (a real ``CacheConfig``; the memory faked: no VMM
    on this machine), the finding names it and its two settings, not kvcached; off or unset
    (resolved off), the kvcached wording stays."""
    from types import SimpleNamespace

    from vllm.config import CacheConfig, KVTransferConfig

    from pdpatch import transport, vllm_sites

    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    monkeypatch.setattr(transport, "probe_memory", lambda ptr, label="": transport.MemoryFacts(
        transport.KIND_VMM, False, 0, label))
    cfg = SimpleNamespace(cache_config=CacheConfig(enable_extensible_kv_cache=extensible))
    worker = SimpleNamespace(kv_buffer_device="cuda", vllm_config=cfg, kv_transfer_config=(
        KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer")))
    [finding] = transport_check.findings_for(worker, {"l0": torch.zeros(4)})
    assert finding.code == "vmm-no-ipc-handle"
    named = extensible is True and vllm_sites.running_release() in vllm_sites.EXTENSIBLE_KV_CACHE
    text = finding.line()
    assert ("extensible KV cache" in finding.message) is named
    assert ("--no-enable-extensible-kv-cache" in finding.fix) is named
    assert ("IMEX channel" in finding.fix) is True
    assert ("kvcached" in text) is not named


def _assert_warns_on_real_registration(stock: dict, patched: dict) -> None:
    assert stock["warnings"] == [], stock
    [line] = [w for w in patched["warnings"] if "ucx-tls-no-cuda-ipc" in w]
    assert "UCX_TLS='tcp' leaves out cuda_ipc" in line and "add cuda_ipc to UCX_TLS" in line


def test_real_registration_warns_on_the_installed_release(fresh_pdpatch):
    import robust_worker as rw

    stock = rw.scenario_transport()
    fresh_pdpatch.install()
    _assert_warns_on_real_registration(stock, rw.scenario_transport())


@pytest.mark.parametrize("ver", robust_matrix.OLD_RELEASES)
def test_real_registration_warns_on_old_release(ver):
    if ver == "<none>":
        pytest.skip("no old vLLM source tree extracted (scripts/fetch_vllm_sources.sh)")
    _assert_warns_on_real_registration(robust_matrix.scenario(ver, "stock", "transport"),
                                       robust_matrix.scenario(ver, "patched", "transport"))
