"""Say when NIXL/UCX will move KV over a slow transport, and what to set instead.

Why: UCX picks its transport silently.  Measured on an H200 with NIXL 1.5.1's bundled UCX:
a peer cannot map CUDA-VMM memory without an exportable handle (kvcached's pages) over the
same-node ``cuda_ipc`` path, so READs *of* such memory fell back to TCP loopback at about
0.5 GB/s -- some 4000x below a device copy -- and UCX's default
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto`` switched cuda_ipc off for GETs, which is vLLM's pull
(READ) mode, even for cudaMalloc memory.  Nothing fails; KV transfer just becomes the
bottleneck.  Only the memory a peer maps matters: the initiator copies into or out of its own
memory in its own process, so a decode engine's READs *into* its kvcached pool ran at cuda_ipc
pace on GPU engines (2 GB in 14 ms; docs/gpu_results.md, runs z, ce, cn).

:func:`check_transport` is pure (an environment mapping and facts in, findings out), so
``pdpatch doctor`` can run it anywhere; :func:`probe_memory` reads a pointer's CUDA attributes
through the driver (ctypes, no torch) for the facts, and answers ``kind="unknown"`` where there
is no CUDA driver.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger("pdpatch.transport")

# CUmemAllocationHandleType bits (cuda.h)
HANDLE_POSIX_FD = 0x1
HANDLE_FABRIC = 0x8

KIND_DEVICE = "device"  # cudaMalloc: legacy CUDA IPC works
KIND_VMM = "vmm"  # cuMemCreate/cuMemMap (kvcached, vLLM 0.34's extensible KV cache) or a
#                   stream-ordered pool: no legacy IPC
KIND_HOST = "host"
KIND_UNKNOWN = "unknown"

ERROR = "error"
WARN = "warn"

_OFF = {"n", "no", "off", "0", "false", "disable", "disabled"}
_ON = {"y", "yes", "on", "1", "true", "enable", "enabled"}
_CUDA_IPC_NAMES = {"cuda_ipc", "cuda"}  # "cuda" is UCX's alias for cuda_copy,cuda_ipc,gdr_copy


@dataclass(frozen=True)
class MemoryFacts:
    """What CUDA says about one KV allocation (see :func:`probe_memory`)."""

    kind: str
    legacy_ipc: bool | None = None  # CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
    handle_types: int | None = None  # CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES bitmask
    label: str = ""

    @property
    def cuda_ipc_exportable(self) -> bool | None:
        """Whether UCX's cuda_ipc can hand this memory to a peer process: legacy IPC
        (cudaMalloc) or a FABRIC handle (VMM with IMEX); POSIX_FD handles are not used."""
        if self.kind == KIND_DEVICE or self.legacy_ipc:
            return True
        if self.kind == KIND_VMM:
            return bool((self.handle_types or 0) & HANDLE_FABRIC)
        return None

    @property
    def vmm_without_ipc(self) -> bool:
        """CUDA VMM memory cuda_ipc cannot hand to a peer (kvcached's pools): UCX moves a
        peer's same-node transfers of it over TCP loopback."""
        return self.kind == KIND_VMM and self.cuda_ipc_exportable is False


@dataclass(frozen=True)
class Finding:
    """One problem: ``code`` is stable (for tests and doctor's JSON), ``fix`` is what to set."""

    code: str
    level: str
    message: str
    fix: str

    def line(self) -> str:
        return f"[{self.level}] {self.code}: {self.message} -> {self.fix}"


def _tls_tokens(value: str) -> tuple[bool, set[str]]:
    """(exclude?, names) of a UCX_TLS value; ``aux`` suffixes are dropped."""
    value = value.strip()
    exclude = value.startswith("^")
    names = {t.split(":")[0].strip().lower() for t in value.lstrip("^").split(",") if t.strip()}
    return exclude, names


def tls_allows_cuda_ipc(value: str | None) -> bool:
    """Whether a UCX_TLS value leaves cuda_ipc enabled (unset and ``all`` do)."""
    if value is None or not value.strip():
        return True
    exclude, names = _tls_tokens(value)
    if exclude:
        return not (names & _CUDA_IPC_NAMES)
    return "all" in names or bool(names & _CUDA_IPC_NAMES)


_TLS_IN_CONFIG = re.compile(r"(?:^|[,;\s])TLS=(.*?)(?=[,;\s][A-Z][A-Z0-9_]*=|$)")


def engine_config_tls(engine_config: str | None) -> str | None:
    """The ``TLS=`` value inside a NIXL UCX backend ``engine_config`` string, if any
    (vLLM's sleep mode passes ``RCACHE_ENABLE=n,TLS=^cuda_ipc``)."""
    if not engine_config:
        return None
    m = _TLS_IN_CONFIG.search(engine_config)
    return m.group(1).strip() if m else None


def check_transport(
    env: Mapping[str, str] | None = None,
    *,
    memory: Sequence[MemoryFacts] = (),
    pull: bool = True,
    engine_config: str | None = None,
    kv_buffer_device: str = "cuda",
    cuda_context_at_agent: bool | None = None,
    peers_map_memory: bool = True,
    extensible_kv_cache: bool = False,
) -> list[Finding]:
    """Findings for one worker's NIXL/UCX setup (empty when nothing is known to be slow).

    ``env``: the process environment (``os.environ``), read for UCX variables.  ``memory``:
    facts about the registered KV allocations, when known (startup summary).  ``pull``: the
    decode side READs (vLLM's default) rather than the prefill side WRITEs.  ``engine_config``:
    the UCX backend's engine_config string if the connector sets one.  ``kv_buffer_device``:
    ``"cpu"`` means KV moves through host buffers and none of this applies.
    ``cuda_context_at_agent``: whether the process had a current CUDA context when its NIXL
    agent was created (:func:`cuda_context_current` just before creating it); ``False`` is a
    finding: measured on an H200, such an agent's first peer connection ran over TCP loopback
    (0.55 GB/s; 4.65 GB/s for the same transfer with the context made first).
    ``peers_map_memory``: whether peers transfer *this* worker's KV memory (a prefill worker
    in pull mode, a decode worker in push mode, ``kv_both``); only then does memory cuda_ipc
    cannot export slow the transfers.  ``extensible_kv_cache``: the KV memory is vLLM's own
    extensible cache (0.34+, :func:`pdpatch.vllm_sites.extensible_kv_cache_on`), whose pages
    carry a FABRIC handle only where the engine has an IMEX channel; the finding then names it
    and its settings instead of kvcached's.
    """
    env = env or {}
    findings: list[Finding] = []
    if kv_buffer_device != "cuda":
        return findings
    tls = env.get("UCX_TLS")
    ipc_env = tls_allows_cuda_ipc(tls)
    cfg_tls = engine_config_tls(engine_config)
    ipc_cfg = tls_allows_cuda_ipc(cfg_tls)
    if not ipc_env:
        findings.append(Finding(
            "ucx-tls-no-cuda-ipc", ERROR,
            f"UCX_TLS={tls!r} leaves out cuda_ipc, so KV between GPUs of one node goes through "
            "a slower transport (TCP loopback or host staging)",
            "add cuda_ipc to UCX_TLS (or unset UCX_TLS)"))
    if not ipc_cfg:
        findings.append(Finding(
            "engine-config-no-cuda-ipc", ERROR,
            f"the NIXL UCX backend is configured with TLS={cfg_tls!r} (vLLM does this in sleep "
            "mode), so same-node KV cannot use cuda_ipc",
            "run P/D workers without sleep mode (enable_sleep_mode=False)"))
    if pull and ipc_env and ipc_cfg:
        get = env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY")
        val = (get or "").strip().lower()
        if val in _OFF:
            findings.append(Finding(
                "cuda-ipc-get-off", ERROR,
                f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={get!r} turns cuda_ipc off for READ, vLLM's pull "
                "mode: same-node KV falls back to TCP loopback",
                "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on"))
        elif val not in _ON:
            findings.append(Finding(
                "cuda-ipc-get-auto", WARN,
                "UCX_CUDA_IPC_ENABLE_GET_ZCOPY is "
                + (f"{get!r}" if get else "unset (auto)")
                + ": on an H200 VM auto turned cuda_ipc off for READ (vLLM's pull mode), so "
                "same-node KV went over TCP loopback",
                "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on"))
    if cuda_context_at_agent is False:
        findings.append(Finding(
            "nixl-agent-before-cuda-context", WARN,
            "the NIXL agent was created before this process had a CUDA context: UCX then "
            "moved its first peer's KV over TCP loopback (measured 0.55 GB/s vs 4.65 GB/s)",
            "create the CUDA context first (torch.cuda.set_device(dev) and a first allocation) "
            "before the NIXL agent"))
    for m in memory if peers_map_memory else ():
        if m.vmm_without_ipc:
            what = f"KV memory {m.label} " if m.label else "KV memory "
            posix = " (its POSIX_FD handle does not help)" if (
                (m.handle_types or 0) & HANDLE_POSIX_FD) else ""
            slow = (": peers cannot map it over cuda_ipc, so UCX moves their same-node "
                    "transfers of it over TCP loopback (measured ~0.5 GB/s on an H200, ~4000x "
                    "below a device copy)")
            if extensible_kv_cache:
                findings.append(Finding(
                    "vmm-no-ipc-handle", ERROR,
                    what + "is vLLM's extensible KV cache (CUDA VMM) without a FABRIC handle"
                    + posix + " -- vLLM allocates one only where the engine can open an IMEX "
                    "channel and the device supports FABRIC handles" + slow,
                    "give this engine an IMEX channel (/dev/nvidia-caps-imex-channels/channel*, "
                    "on a GPU with FABRIC handle support) so vLLM allocates FABRIC-exportable "
                    "pages, or pass --no-enable-extensible-kv-cache (cudaMalloc KV memory); "
                    "across nodes use an RDMA NIC"))
                continue
            findings.append(Finding(
                "vmm-no-ipc-handle", ERROR,
                what + "is CUDA VMM (e.g. kvcached) with no legacy-IPC or FABRIC handle"
                + posix + slow,
                "use cudaMalloc KV memory where peers map it (prefill workers in vLLM's pull "
                "mode: kvcached on the decode side only), or VMM pages "
                "created with CU_MEM_HANDLE_TYPE_FABRIC (needs an IMEX channel); across nodes "
                "use an RDMA NIC"))
    return findings


def format_findings(findings: Sequence[Finding]) -> str:
    """One line per finding, for logs and ``pdpatch doctor``."""
    if not findings:
        return "pdpatch: KV transport: no known slow path"
    return "\n".join(f"pdpatch: KV transport {f.line()}" for f in findings)


# ------------------------------------------------------------------ driver probe (impure)
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES = 14
_CU_MEMORYTYPE_HOST = 1
_CU_MEMORYTYPE_DEVICE = 2
_libcuda: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL | None:
    global _libcuda
    if _libcuda is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        lib.cuInit.argtypes = [ctypes.c_uint]
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        if lib.cuInit(0) != 0:
            return None
        _libcuda = lib
    return _libcuda


def cuda_driver_present() -> bool:
    """Whether this machine has a working CUDA driver (``libcuda`` loads and initializes)."""
    return _driver() is not None


def probe_memory(ptr: int, label: str = "") -> MemoryFacts:
    """Facts about the allocation at device address ``ptr`` (e.g. ``kv_cache.data_ptr()``),
    read with ``cuPointerGetAttribute``; ``kind="unknown"`` without a CUDA driver."""
    lib = _driver()
    if lib is None:
        return MemoryFacts(KIND_UNKNOWN, label=label)
    p = ctypes.c_uint64(ptr)
    mtype = ctypes.c_uint(0)
    rc = lib.cuPointerGetAttribute(ctypes.byref(mtype), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, p)
    if rc != 0:  # plain host memory is unknown to CUDA
        return MemoryFacts(KIND_HOST if rc == 1 else KIND_UNKNOWN, label=label)
    if mtype.value == _CU_MEMORYTYPE_HOST:
        return MemoryFacts(KIND_HOST, label=label)
    legacy = ctypes.c_int(0)
    rc = lib.cuPointerGetAttribute(ctypes.byref(legacy),
                                   _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p)
    is_legacy = bool(legacy.value) if rc == 0 else None
    handles = ctypes.c_uint64(0)
    rc = lib.cuPointerGetAttribute(ctypes.byref(handles),
                                   _CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, p)
    htypes = int(handles.value) if rc == 0 else None
    if mtype.value != _CU_MEMORYTYPE_DEVICE or is_legacy is None:
        kind = KIND_UNKNOWN
    else:
        kind = KIND_DEVICE if is_legacy else KIND_VMM
    return MemoryFacts(kind, is_legacy, htypes, label)


def cuda_context_current() -> bool | None:
    """Whether the calling thread has a current CUDA context (``cuCtxGetCurrent``); None
    without a CUDA driver.  Call it right before creating the NIXL agent."""
    lib = _driver()
    if lib is None:
        return None
    ctx = ctypes.c_void_p(0)
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0:
        return None
    return bool(ctx.value)
