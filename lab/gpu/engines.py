"""The device machine's vLLM GPU engines for ``lab/gpu/pd.py``: a scenario's P and D as real
vLLM OpenAI servers started from the unpacked stage (pdpatch from the checkout through its
``sitecustomize`` way in, kvcached on D where the scenario asks, each side at its
tensor-parallel size on the GPUs :func:`placement` gives it), their requests and metrics.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from lab.gpu.unpack import python_path, site_release
from lab.rig.engine_env import WRAPPER_CLOCK
from lab.rig.proxy import TransferStats
from lab.rig.servers import free_port, prometheus_counters

REPO = Path(__file__).resolve().parents[2]

MAX_TOKENS = 16


MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 16 << 30
"""``--kv-cache-memory-bytes`` of every engine not on kvcached (per GPU): about the KV cache
``--gpu-memory-utilization 0.12`` gave on a 141 GiB H200 before (0.12 of it, less the tiny
model and the profiling peak).  A fixed size skips vLLM's memory profiling (0.25.1's
``Worker.determine_available_memory`` returns it after one dummy run), which read the other
engine's allocations as its own on a shared GPU ("No available memory for the cache blocks",
seen on an H100), so P and D can start together."""
GPU_MEMORY_UTILIZATION = "0.12"
"""Still vLLM's startup check (that much memory free) for every engine, and kvcached D's
budget, which sizes its own pool."""
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
"""NVLink multicast stays off on the device's multi-GPU machines (it can take the host's shared
GPUs out of service): the machine's own settings, restated for the engines, and vLLM's
symmetric-memory all-reduce (multimem on Hopper) off for TP-2 engines."""
MLA_BACKENDS = {"FLASH_ATTN": "FLASH_ATTN_MLA", "TRITON_ATTN": "TRITON_MLA"}
"""A scenario's backend as vLLM's MLA counterpart, for MLA geometries (``--geometry
deepseek-v2-lite``): vLLM refuses a non-MLA ``--attention-backend`` for an MLA model."""


@dataclass(frozen=True)
class Scenario:
    pdpatch: bool
    p_backend: str
    d_backend: str
    hashseed: str | None = "0"         # PYTHONHASHSEED on both engines (None: unset)
    d_env: dict = field(default_factory=dict)
    p_env: dict = field(default_factory=dict)
    controls: bool = False
    salt_mismatch: bool = False         # one extra request whose D-side cache_salt differs
    kill_p: bool = False                # last: P killed after prefilling, before D pulls
    p_stock: bool = False               # P without pdpatch even where D has it
    d_ktc: dict = field(default_factory=dict)   # more --kv-transfer-config keys for D
    d_kvcached: bool = False            # D's KV cache in a kvcached (CUDA VMM) pool
    load: int = 0                       # then this many long P/D requests, LOAD_IN_FLIGHT at once
    p_tp: int = 1                       # P's --tensor-parallel-size (2: needs --two-gpus)
    d_tp: int = 1                       # D's --tensor-parallel-size (2: needs --two-gpus)
    note: str = ""
    aged: bool = False                  # D aged by earlier traffic before the repeated samples
    p_kv_gib: float | None = None       # P's KV cache, GiB per GPU (None: the run's)
    d_kv_gib: float | None = None       # D's KV cache, GiB per GPU (None: the run's)


KVCACHED_ENV = {
    "ENABLE_KVCACHED": "true",
    "KVCACHED_CONTIGUOUS_LAYOUT": "false",   # kvcached refuses NixlConnector otherwise
    "KVCACHED_GPU_UTILIZATION": "0.3",
    # kvcached keeps only 16,000 tokens of freed blocks for prefix hits by default, so the rig's
    # repeated prompts were pulled again (runs z, aa, ab); no cap keeps them until the memory
    # is needed, as stock vLLM does (README's troubleshooting advice)
    "KVCACHED_MAX_CACHED_TOKENS": "-1",
}


def kvcached_env(release: str) -> dict[str, str]:
    """:data:`KVCACHED_ENV` plus the model runner kvcached 0.1.6 adapts on ``release``: vLLM's V1
    runner below 0.29, Model Runner V2 from 0.29 (its ``VLLM_MRV2_RANGE``), where it refuses
    V1 at engine start (``KVCachedConfigError``: runs bx, by asked for V1 on 0.30)."""
    from packaging.version import InvalidVersion, Version

    try:
        v2 = Version(release) >= Version("0.29")
    except InvalidVersion:
        raise SystemExit(f"no vLLM release known for the kvcached D ({release!r}): "
                         "is the stage unpacked?") from None
    return {**KVCACHED_ENV, "VLLM_USE_V2_MODEL_RUNNER": "1" if v2 else "0"}


@dataclass(frozen=True)
class Paths:
    site: Path                  # the unpacked stage
    model: Path
    logs: Path
    kvcached: Path | None = None   # kvcached's site and its sitecustomize (install_kvcached)
    max_model_len: int = MAX_MODEL_LEN
    mla: bool = False              # an MLA model: backends as MLA_BACKENDS maps them
    kv_cache_bytes: int = KV_CACHE_BYTES   # per engine not on kvcached (--kv-cache-gib)
    p_kv_cache_bytes: int | None = None    # P's where it differs (--p-kv-cache-gib)


def install_kvcached(stage: Path, dest: Path) -> Path:
    """Build kvcached's sdist against this machine's torch and CUDA into ``dest/site`` and
    write ``dest/sitecustomize.py``: kvcached patches vLLM from a ``.pth`` file, which Python
    runs only in a site directory, not in a ``--target`` folder on PYTHONPATH."""
    if not (dest / "sitecustomize.py").exists():
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "pip", "-q", "install", "--no-build-isolation",
                        "--no-deps", "--no-index", "--target", str(dest / "site"),
                        *map(str, sorted((stage / "kvcached").iterdir()))], check=True)
        (dest / "sitecustomize.py").write_text(
            f"import site\nsite.addsitedir({str(dest / 'site')!r})\n")
        print(f"kvcached built in {time.time() - t0:.0f}s", flush=True)
    return dest


def kvcached_used(ipc_name: str, shm: Path = Path("/dev/shm")) -> int | None:
    """Bytes of KV memory kvcached has mapped in engine ``ipc_name`` (its shared-memory
    record: total, used, preallocated, int64 each), or None before it wrote one."""
    try:
        raw = (shm / ipc_name).read_bytes()[:24]
    except OSError:
        return None
    return int.from_bytes(raw[8:16], "little", signed=True) if len(raw) == 24 else None


def lab_clocks(env: dict[str, str], name: str, pdpatch: bool) -> list[str]:
    """The lab clocks' ``sitecustomize`` directory for engine ``name``'s path (none when
    neither a clock nor a switch interval is asked for), each clock's records given a
    directory of the engine's own in ``env``: the wrapper clock times pdpatch's wrappers (a
    pdpatch engine only), the step clock vLLM's steps in every engine."""
    if not pdpatch:
        env.pop("PDLAB_WRAPPER_CLOCK", None)
    clocks = [c for c in ("PDLAB_WRAPPER_CLOCK", "PDLAB_STEP_CLOCK") if env.get(c)]
    for c in clocks:
        env[c] = os.path.join(env[c], name)
    return [str(WRAPPER_CLOCK)] if clocks or env.get("PDLAB_SWITCH_INTERVAL") else []


class Engine:
    def __init__(self, name: str, role: str, backend: str, sc: Scenario, paths: Paths,
                 gpus: str | None = None) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.backend = MLA_BACKENDS.get(backend, backend) if paths.mla else backend
        producer = role == "kv_producer"
        self.kv_cache_bytes = kv_bytes(sc, paths, producer)
        env = dict(os.environ)
        path = [str(p) for p in python_path(paths.site)]   # the site, the CUTLASS DSL's
        kvcached = not producer and sc.d_kvcached
        if kvcached:
            assert paths.kvcached is not None, "install_kvcached() before a kvcached D"
            path = [str(paths.kvcached), *path]
            self.kvcached_ipc = f"pdpatch-{name}-{os.getpid()}"
            env.update(kvcached_env(site_release(paths.site)),
                       KVCACHED_IPC_NAME=self.kvcached_ipc)
        pdpatch = sc.pdpatch and not (producer and sc.p_stock)
        clock = lab_clocks(env, name, pdpatch)
        if pdpatch:
            path = [str(REPO / "sitecustomize"), *clock, str(REPO), *path]
        else:
            path = [*clock, *path]
        env.pop("PYTHONHASHSEED", None)
        if sc.hashseed is not None:
            env["PYTHONHASHSEED"] = sc.hashseed
        env.update({
            "PYTHONPATH": os.pathsep.join(path), "ENABLE_PDPATCH": str(pdpatch).lower(),
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_HOST_IP": "127.0.0.1",
            "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_USE_FLASHINFER_SAMPLER": "0", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on",
            **MULTICAST_OFF,
        })
        env.update(sc.p_env if producer else sc.d_env)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--host", "127.0.0.1", "--port", str(self.port), "--model", str(paths.model),
               "--served-model-name", "tiny", "--skip-tokenizer-init", "--enforce-eager", "-O0",
               "--max-model-len", str(paths.max_model_len),
               "--gpu-memory-utilization", GPU_MEMORY_UTILIZATION,
               *([] if kvcached else ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]),
               "--tensor-parallel-size", str(sc.p_tp if producer else sc.d_tp),
               "--seed", "0",
               "--attention-backend", self.backend,
               "--kv-transfer-config",
               json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                           **({} if producer else sc.d_ktc)})]
        self.log = paths.logs / f"{name}.log"
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def complete(self, prompt: list[int], n: int, kvp: dict | None = None,
                 salt: str | None = None, timeout_s: float = 120.0) -> dict:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
                "return_tokens_as_token_ids": True}
        if kvp is not None:
            body["kv_transfer_params"] = kvp
        if salt is not None:
            body["cache_salt"] = salt
        req = urllib.request.Request(self.url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                d = json.loads(r.read())
        except urllib.error.HTTPError as e:
            return {"error": f"HTTP {e.code}: {e.read()[:300]!r}"}
        except OSError as e:
            return {"error": repr(e)}
        c = d["choices"][0]
        return {"ids": c.get("token_ids") or [],
                "lp": (c.get("logprobs") or {}).get("token_logprobs") or [],
                "kvp": d.get("kv_transfer_params"), "ms": 1000 * (time.perf_counter() - t0)}

    def metrics(self) -> dict[str, float]:
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
                return prometheus_counters(r.read().decode())
        except OSError:
            return {}

    def pulled(self, prompt: list[int], kvp: dict, salt: str | None = None,
               timeout_s: float = 120.0) -> dict:
        """A decode with ``kvp``, and how many NIXL transfers (bytes, descriptors) it cost D."""
        before = self.metrics()
        out = self.complete(prompt, MAX_TOKENS, kvp, salt=salt, timeout_s=timeout_s)
        moved = TransferStats.delta(before, self.metrics())
        out["pulled"], out["bytes"] = moved.transfers, int(moved.bytes)
        out["xfer_s"], out["descriptors"] = moved.xfer_time_s, moved.descriptors
        return out


def kv_bytes(sc: Scenario, paths: Paths, producer: bool) -> int:
    """One side's ``--kv-cache-memory-bytes``: the scenario's own size for that side where it
    sets one (an aged D's P holds every measured request without reusing a block), else the
    run's (``--kv-cache-gib``; P's ``--p-kv-cache-gib`` where given)."""
    gib = sc.p_kv_gib if producer else sc.d_kv_gib
    if gib is not None:
        return int(gib * (1 << 30))
    if producer and paths.p_kv_cache_bytes is not None:
        return paths.p_kv_cache_bytes
    return paths.kv_cache_bytes


def placement(sc: Scenario, two_gpus: bool) -> tuple[str | None, str | None]:
    """``CUDA_VISIBLE_DEVICES`` of P and D (None: the machine's one GPU).  On two GPUs a TP-1 P
    takes GPU 0 and a TP-1 D GPU 1, a TP-2 engine both, so a TP-1 engine shares its GPU with
    the other side's TP-2 engine."""
    tps = (sc.p_tp, sc.d_tp)
    if not set(tps) <= {1, 2}:
        raise ValueError(f"tensor-parallel sizes 1 or 2 only (two GPUs), got P {tps[0]}, "
                         f"D {tps[1]}")
    if not two_gpus:
        if tps != (1, 1):
            raise ValueError(f"P TP {tps[0]} -> D TP {tps[1]} needs two GPUs: run with "
                             "--two-gpus on the nvidia-h200-x2 machine")
        return None, None
    return ("0,1" if sc.p_tp == 2 else "0"), ("0,1" if sc.d_tp == 2 else "1")


def start_pair(name: str, sc: Scenario, paths: Paths, two_gpus: bool = False,
               timeout_s: float = 300) -> tuple[Engine, Engine, float]:
    """P and D on the GPUs :func:`placement` gives them, started together: with a fixed
    :data:`KV_CACHE_BYTES` no engine profiles memory.  kvcached D sizes its own pool from the
    free memory, so where it shares a GPU with P it starts first, and P once D is up."""
    p_gpus, d_gpus = placement(sc, two_gpus)
    t0 = time.time()

    def wait(*engines: Engine) -> None:
        while time.time() - t0 < timeout_s and not all(e.healthy() for e in engines):
            if any(e.proc.poll() is not None for e in engines):
                return
            time.sleep(1)

    d = Engine(f"{name}-D", "kv_consumer", sc.d_backend, sc, paths, gpus=d_gpus)
    shared = p_gpus is None or not set(p_gpus.split(",")).isdisjoint((d_gpus or "").split(","))
    if sc.d_kvcached and shared:
        wait(d)
    p = Engine(f"{name}-P", "kv_producer", sc.p_backend, sc, paths, gpus=p_gpus)
    wait(p, d)
    return p, d, time.time() - t0


def start_pairs(scenarios: dict[str, Scenario], paths: Paths, two_gpus: bool = False,
                ) -> dict[str, tuple[Engine, Engine, float]]:
    """The pairs of ``scenarios`` started at once (``--together``): TP-2 engines take ~2 min
    each to start, mostly imports and NCCL set-up that overlap well on the device's cores, and
    the pairs then wait idle, so each scenario is still measured alone.  kvcached scenarios are
    not started here: a kvcached D sizes its pool from the memory the others leave free."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(scenarios))) as pool:
        started = {name: pool.submit(start_pair, name, sc, paths, two_gpus)
                   for name, sc in scenarios.items() if not sc.d_kvcached}
        return {name: f.result() for name, f in started.items()}
