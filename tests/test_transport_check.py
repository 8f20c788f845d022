"""The startup transport check: findings logged once per process after KV registration."""

from __future__ import annotations

import logging

import torch

from pdpatch.patches import transport_check


class _Worker:
    kv_buffer_device = "cuda"


def test_gpu_kv_with_default_ucx_settings_warns_about_cuda_ipc_reads(monkeypatch, caplog):
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    monkeypatch.setattr(transport_check, "_reported", False)
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
