"""pdpatch.transport: slow-transport findings from environment and memory facts (pure), and
the driver probe's behaviour without CUDA.  The GPU side of probe_memory (cudaMalloc ->
device, kvcached -> vmm) is exercised by scripts/gpu_kv_bench.py on the GPU machine."""

from __future__ import annotations

import numpy as np
import pytest

from pdpatch import transport as tp
from pdpatch.transport import (
    HANDLE_FABRIC,
    HANDLE_POSIX_FD,
    KIND_DEVICE,
    KIND_VMM,
    MemoryFacts,
    check_transport,
    engine_config_tls,
    format_findings,
    tls_allows_cuda_ipc,
)

GOOD = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def codes(findings) -> list[str]:
    return [f.code for f in findings]


@pytest.mark.parametrize(("value", "allowed"), [
    (None, True), ("", True), ("all", True), ("cuda_ipc,cuda_copy,tcp", True),
    ("cuda,tcp", True), ("rc,cuda_copy,cuda_ipc:aux", True), ("^cuda_ipc", False),
    ("^cuda", False), ("^tcp", True), ("tcp,cuda_copy", False), ("rc,ud,sm", False),
    (" ^ib,tcp ", True),
])
def test_tls_parsing(value, allowed) -> None:
    assert tls_allows_cuda_ipc(value) is allowed


def test_engine_config_tls() -> None:
    assert engine_config_tls("RCACHE_ENABLE=n,TLS=^cuda_ipc") == "^cuda_ipc"
    assert engine_config_tls("TLS=^cuda_ipc,tcp,RCACHE_ENABLE=n") == "^cuda_ipc,tcp"
    assert engine_config_tls("RCACHE_ENABLE=n") is None
    assert engine_config_tls(None) is None


def test_healthy_cudamalloc_setup_has_no_findings() -> None:
    mem = [MemoryFacts(KIND_DEVICE, True, 0, "layer0")]
    assert check_transport(GOOD, memory=mem) == []
    assert "no known slow path" in format_findings([])


@pytest.mark.parametrize("value", [None, "auto", "try"])
def test_pull_mode_warns_when_cuda_ipc_get_may_be_off(value) -> None:
    env = {} if value is None else {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": value}
    f = check_transport(env)
    assert codes(f) == ["cuda-ipc-get-auto"] and f[0].level == tp.WARN
    assert f[0].fix == "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on"
    assert check_transport(env, pull=False) == []  # WRITE (push) uses put, not get


@pytest.mark.parametrize("value", ["n", "no", "off", "0"])
def test_pull_mode_errors_when_cuda_ipc_get_is_off(value) -> None:
    f = check_transport({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": value})
    assert codes(f) == ["cuda-ipc-get-off"] and f[0].level == tp.ERROR


def test_tls_without_cuda_ipc() -> None:
    f = check_transport({"UCX_TLS": "tcp,cuda_copy", **GOOD})
    assert codes(f) == ["ucx-tls-no-cuda-ipc"]
    assert "UCX_TLS" in f[0].fix
    f = check_transport({"UCX_TLS": "^cuda_ipc"})  # GET_ZCOPY moot once cuda_ipc is gone
    assert codes(f) == ["ucx-tls-no-cuda-ipc"]


def test_sleep_mode_engine_config() -> None:
    f = check_transport(GOOD, engine_config="RCACHE_ENABLE=n,TLS=^cuda_ipc")
    assert codes(f) == ["engine-config-no-cuda-ipc"]
    assert "sleep" in f[0].fix


def test_vmm_memory_without_handles() -> None:
    kvc = MemoryFacts(KIND_VMM, False, 0, "kvcached pool")
    f = check_transport(GOOD, memory=[kvc])
    assert codes(f) == ["vmm-no-ipc-handle"] and f[0].level == tp.ERROR
    assert "kvcached pool" in f[0].message and "cudaMalloc" in f[0].fix
    posix = MemoryFacts(KIND_VMM, False, HANDLE_POSIX_FD)
    assert "POSIX_FD" in check_transport(GOOD, memory=[posix])[0].message
    fabric = MemoryFacts(KIND_VMM, False, HANDLE_FABRIC | HANDLE_POSIX_FD)
    assert fabric.cuda_ipc_exportable and check_transport(GOOD, memory=[fabric]) == []
    assert MemoryFacts(tp.KIND_UNKNOWN).cuda_ipc_exportable is None
    # memory no peer maps (a decode worker's READs land in it): no finding
    assert check_transport(GOOD, memory=[kvc], peers_map_memory=False) == []


def test_vllms_extensible_cache_without_a_fabric_handle() -> None:
    """vLLM 0.34's extensible KV cache is VMM memory too: the finding names it and what to set
    (an IMEX channel, or the cache off), not kvcached; with a FABRIC handle (an IMEX channel
    where vLLM allocated it) cuda_ipc maps it and there is nothing to say."""
    pages = MemoryFacts(KIND_VMM, False, 0, "kv_caches")
    [f] = check_transport(GOOD, memory=[pages], extensible_kv_cache=True)
    assert f.code == "vmm-no-ipc-handle" and f.level == tp.ERROR
    assert "vLLM's extensible KV cache" in f.message and "kvcached" not in f.line()
    assert "IMEX channel" in f.fix and "--no-enable-extensible-kv-cache" in f.fix
    fabric = MemoryFacts(KIND_VMM, False, HANDLE_FABRIC)
    assert check_transport(GOOD, memory=[fabric], extensible_kv_cache=True) == []
    assert check_transport(GOOD, memory=[pages], extensible_kv_cache=True,
                           peers_map_memory=False) == []


def test_everything_at_once_and_host_buffers() -> None:
    env = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "off"}
    f = check_transport(env, memory=[MemoryFacts(KIND_VMM, False, 0)])
    assert codes(f) == ["cuda-ipc-get-off", "vmm-no-ipc-handle"]
    text = format_findings(f)
    assert text.count("\n") == 1 and "[error] cuda-ipc-get-off" in text
    assert check_transport(env, kv_buffer_device="cpu") == []


def test_probe_memory_of_host_memory() -> None:
    """Real driver path: on a machine without CUDA the answer is "unknown", with CUDA a plain
    host buffer is "host"; neither claims cuda_ipc."""
    buf = np.zeros(16, dtype=np.uint8)
    facts = tp.probe_memory(int(buf.ctypes.data), label="x")
    assert facts.kind in (tp.KIND_UNKNOWN, tp.KIND_HOST) and facts.label == "x"
    assert facts.cuda_ipc_exportable is None
    assert check_transport(GOOD, memory=[facts]) == []


def test_agent_created_before_a_cuda_context() -> None:
    f = check_transport(GOOD, cuda_context_at_agent=False)
    assert codes(f) == ["nixl-agent-before-cuda-context"] and f[0].level == tp.WARN
    assert "before the NIXL agent" in f[0].fix
    assert check_transport(GOOD, cuda_context_at_agent=True) == []
    assert check_transport(GOOD, cuda_context_at_agent=None) == []
    if tp._driver() is None:  # this CPU machine: the probe cannot tell
        assert tp.cuda_context_current() is None
