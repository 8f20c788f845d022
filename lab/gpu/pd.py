"""Real vLLM GPU engines doing P/D over NIXL on the device machine, stock vs pdpatch, each
request judged by lab/gpu/oracle.py (numeric drift vs corrupted KV), the oracle proven by
deliberately corrupted controls in the same run.

Run on the device machine, from the repository root, with the stage built by
``scripts/gpu_stage.sh`` carried along::

    python3 -m scripts.gpu_pd --stage .gpu_stage/vllm-0.25.1 --out "$OUT" ref fa-triton ...

(``-m`` from the root: the device's ``python3`` has no pdpatch install, so the checkout root must
be what puts ``lab`` and ``pdpatch`` on ``sys.path``; see ``lab/__init__.py``.)

A scenario is ``name`` from :data:`SCENARIOS`.  The references (stock, same backend on both
sides: ``ref`` FLASH_ATTN, ``ref-triton`` TRITON_ATTN, ``ref-load`` FLASH_ATTN under load) set
their backend's tolerances from their first-token drift per prompt (``--tolerances`` takes what
the run lacks from an earlier run); a scenario is judged by its P's and D's backends' (the
wider), and its controls (P's first block read into every block; another prompt's KV) must be
caught.  Results go
to ``$OUT/gpu_pd.json`` and a Markdown table to ``$OUT/gpu_pd.md``; every engine's log, compressed,
to ``$OUT/logs.tar.xz`` (a device run returns at most 8 files).

Scenarios with kvcached on D need the stage built with ``scripts/gpu_stage.sh --kvcached``: the
sdist is built here, against the device's own torch and CUDA, once per warm machine.

``--geometry`` gives the tiny model a real model's KV cache (:data:`GEOMETRIES`), so a request
moves that model's bytes over NIXL: ``llama3-8b`` (32 layers, 8 KV heads of 128), ``qwen2.5-7b``
(28 layers, 4 KV heads of 128), ``llama3-70b`` (80 layers, 8 KV heads of 128; for TP 2),
``llama3-70b-tp2`` (one GPU's share of 70B at TP 2: 80 layers, 4 KV heads of 128, at TP 1),
``deepseek-v2-lite`` (MLA, a DeepseekV2ForCausalLM: 27 layers of a 512 + 64 latent; the
engines run FLASH_ATTN_MLA / TRITON_MLA for a scenario's FLASH_ATTN / TRITON_ATTN).
``--prompt-lengths 600,1500,4000,8000`` the prompts; the table shows D's NIXL time per prompt
(``vllm:nixl_xfer_time_seconds``).

``--geometry llama3-8b-full`` / ``qwen2.5-7b-full`` / ``deepseek-v2-lite-full``: the real
model's architecture at full width (``lab/gpu/weights.py``), its seeded weights drawn on the GPU
at the start of the run, so a prefill costs what the real model's does.  ``--repeat N``: N more
rounds of the prompts per pair after the first pass, each request salted and judged
(``samples``); ``ref-aged`` / ``coalesce-aged`` age D (``lab/gpu/aged.py``) before those rounds;
``--cross`` runs the scenarios again in the reverse order (``gpu_pd-crossed.json``);
``--speed-starts K`` makes K pair starts of ``--speed``, the pdpatch pair first and second by
turns, each round kept (``rounds_detail``); ``--dry-run`` starts nothing and checks the call
against the device's limits (``lab/gpu/dryrun.py``; the owed calls: ``lab/gpu/plan.py``).

``--two-gpus`` (the nvidia-h200-x2 machine) puts P on GPU 0 and D on GPU 1; the ``*-tp12`` and
``*-tp21`` scenarios run one side at tensor-parallel size 2 on both GPUs (sharing one with the
other side), judged by the tolerances of the reference with the same TP sizes (``ref-tp12``,
``ref-tp21``) where the run has it.  Engines not on kvcached get a fixed KV cache
(``--kv-cache-memory-bytes``), so P and D start together; kvcached D, which sizes its own
pool, starts first where it shares a GPU with P.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import random
import re
import shutil
import signal
import statistics
import subprocess
import sysconfig
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

from lab.gpu import aged, oracle, unpack, weights
from lab.gpu.engines import (
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    REPO,
    Engine,
    Paths,
    Scenario,
    install_kvcached,
    kvcached_used,
    placement,
    start_pair,
    start_pairs,
)
from lab.paired import median_ci, verdict
from lab.rig.proxy import PREFILL_KV_PARAMS as PREFILL
from lab.rig.proxy import PDResult
from lab.rig.proxy import pd_request as streamed_pd_request
from pdpatch.patches.block_keys import wrappers as block_keys

PROMPT_LENGTHS = (7, 16, 17, 100, 600, 1500)
SPEED_GOAL = 1.02
SPEED_LENGTHS = (100, 600, 1500)
SPEED_TOKENS = 64
SPEED_WARMUP = 3
GEOMETRIES: dict[str, dict] = {
    "tiny": {},
    # Llama-3-8B's KV cache (32 layers, 8 KV heads of 128): 128 KiB per token in bf16, so a
    # request's NIXL READ moves what an 8B model's would; the rest of the model stays tiny
    # (hidden 256: ~0.2 GB of seeded weights), its outputs judged by the same oracle.
    "llama3-8b": {"num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128},
    # Qwen2.5-7B's KV cache (28 layers, 4 KV heads of 128, 28 query heads: 56 KiB per token)
    # on the Llama architecture: the KV layout NIXL moves is the same, and the rig's weight
    # recipe stays one (Qwen2's q/k/v biases change no cached byte's shape).
    "qwen2.5-7b": {"num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "head_dim": 128,
                   "hidden_size": 448},   # transformers wants the hidden size / heads whole
    # Llama-3-70B's KV cache (80 layers, 8 KV heads of 128, 64 query heads: 320 KiB per
    # token), for engines run at TP 2 (each GPU holds 4 KV heads).
    "llama3-70b": {"num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 128},
    # What one GPU of Llama-3-70B at TP 2 holds (80 layers, 4 KV heads of 128: 160 KiB per
    # token), served at TP 1: the per-GPU READ of a 70B TP-2 deployment on one GPU.  32 query
    # heads keep 70B's 8 query heads per KV head.
    "llama3-70b-tp2": {"num_hidden_layers": 80, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "head_dim": 128},
    # DeepSeek-V2-Lite's MLA KV cache: 27 layers of one 576-wide latent (kv_lora_rank 512 +
    # the shared RoPE key's 64) per token, 30.4 KiB per token in bf16; 16 heads, no q LoRA.
    # Every layer a dense MLP (first_k_dense_replace = the layer count: vLLM's load_weights
    # needs n_routed_experts to be a number, so V2-Lite's 64 stays, unused); default RoPE in
    # place of V2-Lite's YaRN (the cache holds the latent, whatever the rotary scaling).
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"],
                         "model_type": "deepseek_v2", "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16,
                         "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
                         "qk_nope_head_dim": 128, "v_head_dim": 128,
                         "head_dim": 64,    # = qk_rope_head_dim, as transformers derives it
                         "n_routed_experts": 64, "first_k_dense_replace": 27},
}
"""``--geometry``: config overrides of the rig's tiny Llama (2 layers, 4 KV heads of 64, hidden
256, vocab 512): real models' KV geometry, the rest kept tiny so the weights stay small and the
oracle still tells intact KV from corrupted."""
GEOMETRIES.update({name: dict(cfg) for name, cfg in weights.FULL.items()})
# ``llama3-8b-full``, ``qwen2.5-7b-full``, ``deepseek-v2-lite-full``: the whole config of a real
# model's architecture at full width (lab/gpu/weights.py), its seeded weights drawn on the
# device's GPU at the start of the run, so a prefill costs what the real model's does.


def is_full_width(geometry: str) -> bool:
    """Whether ``geometry`` is a full-width model (:data:`lab.gpu.weights.FULL`)."""
    return geometry in weights.FULL


def is_mla(geometry: str) -> bool:
    """Whether ``geometry``'s KV cache is MLA's latent (the engines then run vLLM's MLA
    attention backends, :data:`lab.gpu.engines.MLA_BACKENDS`)."""
    return "kv_lora_rank" in GEOMETRIES[geometry]


SCENARIOS: dict[str, Scenario] = {
    "ref": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", controls=True,
                    note="reference: stock, same backend"),
    "ref-triton": Scenario(False, "TRITON_ATTN", "TRITON_ATTN", controls=True,
                           note="reference: stock, same backend (TRITON_ATTN's drift)"),
    "ref-load": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", load=96,
                         note="stock, same backend, under load: the drift batching alone gives"),
    "stock-fa-triton": Scenario(False, "FLASH_ATTN", "TRITON_ATTN"),
    "stock-triton-fa": Scenario(False, "TRITON_ATTN", "FLASH_ATTN"),
    "fa-triton": Scenario(True, "FLASH_ATTN", "TRITON_ATTN", hashseed=None, controls=True),
    "triton-fa": Scenario(True, "TRITON_ATTN", "FLASH_ATTN", hashseed=None),
    "fa-fa": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", hashseed=None, salt_mismatch=True,
                      note="PYTHONHASHSEED unset on both; a cache_salt mismatch D must refuse"),
    "kill-p": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", kill_p=True,
                       note="P killed after prefilling, before D pulls"),
    "stock-kill-p": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", kill_p=True,
                             note="P killed after prefilling, before D pulls"),
    # D token-major (the layout kvcached forces), P stock head-major
    "stock-nhd": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", d_env={"VLLM_KV_CACHE_LAYOUT": "NHD"},
                          note="D token-major, P head-major"),
    "stock-nhd-permute": Scenario(False, "FLASH_ATTN", "FLASH_ATTN",
                                  d_env={"VLLM_KV_CACHE_LAYOUT": "NHD"},
                                  d_ktc={"enable_permute_local_kv": True},
                                  note="D token-major with vLLM's enable_permute_local_kv"),
    "nhd": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, controls=True,
                    d_env={"PDPATCH_LAYOUT_FORCE": "1"},
                    note="D token-major by pdpatch's layout override, P stock"),
    # kvcached 0.1.6 on D (token-major VMM pool, over-allocated), P stock head-major
    "stock-kvc": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", d_kvcached=True,
                          note="kvcached pool on D, both stock"),
    "kvc": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, d_kvcached=True,
                    controls=True, load=96,
                    note="kvcached pool on D with pdpatch's defaults, P stock"),
    # vLLM refuses a head-major P for a token-major D unless its receive-side reorder is on;
    # here the operator sets it (run cc, 0.30, before pdpatch turned it on past 0.28 itself)
    "kvc-permute": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, d_kvcached=True,
                            controls=True, d_ktc={"enable_permute_local_kv": True},
                            note="as kvc, with the operator's enable_permute_local_kv on D"),
    # at 8B on 0.30 a kvcached D's own READ posts more descriptors as prompts grow (run cd:
    # 128 at 1,500 tokens, 544 at 16,000, stock 32): does the coalesced opt-in merge them?
    "kvc-coalesce": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, d_kvcached=True,
                             controls=True, d_env={"PDPATCH_KV_COALESCE": "1"},
                             note="as kvc with D's READs coalesced (PDPATCH_KV_COALESCE=1)"),
    "kvc-unstaged": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, d_kvcached=True,
                             load=96, d_env={"PDPATCH_KV_STAGING_MIB": "0"},
                             note="as kvc, converted READs straight into the VMM pool"),
    # Same layout, stock P; D stages and coalesces its READs (opt-in)
    "coalesce": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, controls=True,
                         d_env={"PDPATCH_KV_COALESCE": "1"},
                         note="same layout, D's READs coalesced (PDPATCH_KV_COALESCE=1), P stock"),
    # Tensor parallelism across P and D (--two-gpus; TP-2 engines see both GPUs): each of D's
    # ranks pulls its share of the heads from P's rank(s)
    "ref-tp12": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", controls=True, d_tp=2,
                         note="reference: stock, P TP 1 -> D TP 2"),
    "tp12": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", controls=True, d_tp=2,
                     note="P TP 1 -> D TP 2"),
    "kvc-tp12": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, d_kvcached=True,
                         controls=True, load=96, d_tp=2,
                         note="kvcached pool on D (TP 2) with pdpatch's defaults, P stock TP 1"),
    # a kvcached D's READ at TP 1 -> 2 is vLLM's own, one descriptor per head slice (run ce,
    # 0.30: 15,040 at 1,500 tokens); staged and coalesced with the opt-in?
    "kvc-tp12-coalesce": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True,
                                  d_kvcached=True, controls=True, d_tp=2,
                                  d_env={"PDPATCH_KV_COALESCE": "1",
                                         "PDPATCH_KV_STAGING_MIB": "1024"},
                                  note="as kvc-tp12 with D's READs coalesced "
                                       "(PDPATCH_KV_COALESCE=1), staging buffer 1 GiB"),
    "ref-tp21": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", controls=True, p_tp=2,
                         note="reference: stock, P TP 2 -> D TP 1"),
    "tp21": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", controls=True, p_tp=2,
                     note="P TP 2 -> D TP 1"),
    "coalesce-tp12": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, controls=True,
                              d_tp=2, d_env={"PDPATCH_KV_COALESCE": "1"},
                              note="P TP 1 -> D TP 2, D's READs coalesced (head slices: gap "
                                   "READs), P stock"),
    "ref-triton-tp12": Scenario(False, "TRITON_ATTN", "TRITON_ATTN", controls=True, d_tp=2,
                                note="reference: stock TRITON_ATTN, P TP 1 -> D TP 2"),
    "coalesce-tp21": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, controls=True,
                              p_tp=2, d_env={"PDPATCH_KV_COALESCE": "1"},
                              note="P TP 2 -> D TP 1, D's READs coalesced, P stock"),
    # the coalesced READ with a 1 GiB staging buffer: an 8,000-token request at 70B's KV is
    # 2.5 GiB, 20 chunks of the default 128 MiB; does the time follow the chunks?
    "coalesce-tp12-stage1g": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True,
                                      controls=True, d_tp=2,
                                      d_env={"PDPATCH_KV_COALESCE": "1",
                                             "PDPATCH_KV_STAGING_MIB": "1024"},
                                      note="as coalesce-tp12, staging buffer 1 GiB"),
    "coalesce-tp21-stage1g": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True,
                                      controls=True, p_tp=2,
                                      d_env={"PDPATCH_KV_COALESCE": "1",
                                             "PDPATCH_KV_STAGING_MIB": "1024"},
                                      note="as coalesce-tp21, staging buffer 1 GiB"),
    "fa-triton-tp12": Scenario(True, "FLASH_ATTN", "TRITON_ATTN", hashseed=None, controls=True,
                               d_tp=2, note="P TP 1 -> D TP 2, mixed backends"),
    "kvc-tp21": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, d_kvcached=True,
                         controls=True, load=96, p_tp=2,
                         note="kvcached pool on D (TP 1) with pdpatch's defaults, P stock TP 2"),
    "ref-load-tp12": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", load=96, d_tp=2,
                              note="stock, P TP 1 -> D TP 2, under load: the drift batching "
                                   "alone gives at those TP sizes"),
    "ref-load-tp21": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", load=96, p_tp=2,
                              note="stock, P TP 2 -> D TP 1, under load: the drift batching "
                                   "alone gives at those TP sizes"),
    "ref-triton-tp21": Scenario(False, "TRITON_ATTN", "TRITON_ATTN", controls=True, p_tp=2,
                                note="reference: stock TRITON_ATTN, P TP 2 -> D TP 1"),
    "fa-triton-tp21": Scenario(True, "FLASH_ATTN", "TRITON_ATTN", hashseed=None, controls=True,
                               p_tp=2, note="P TP 2 -> D TP 1, mixed backends"),
    # An aged D (lab/gpu/aged.py): the first pass on a fresh D, then D aged by local requests
    # of mixed lengths finished in mixed order, then the repeated samples (--repeat) on the
    # aged D.  P's cache holds every measured request without reusing a block, so what moves
    # the READ is D's blocks alone.
    "ref-aged": Scenario(False, "FLASH_ATTN", "FLASH_ATTN", controls=True, aged=True,
                         p_kv_gib=32, note="reference: stock, D aged before the samples"),
    "coalesce-aged": Scenario(True, "FLASH_ATTN", "FLASH_ATTN", p_stock=True, controls=True,
                              aged=True, p_kv_gib=32, d_env={"PDPATCH_KV_COALESCE": "1"},
                              note="D aged before the samples, its READs coalesced "
                                   "(PDPATCH_KV_COALESCE=1), P stock"),
}
LOAD_IN_FLIGHT = 32
"""With the two longest prompts, ~34k tokens of KV in flight on D: 16 of kvcached's 2 MiB pages
per layer for the tiny Llama, beyond the 5-10 it keeps reserved, so pages get mapped and
unmapped while other requests' READs run."""
KILL_BOUND_S = 120.0
"""How long D may take to fail a request whose P is gone (vLLM's own handshake and transfer
timeouts decide; the bound only keeps a hang from stalling the run)."""


def prompt_lengths(text: str) -> tuple[int, ...]:
    """``--prompt-lengths 600,1500,4000``: at least two (the controls and the load use the
    two longest), each at least one token; run shortest first, whatever the order given.

    Why sorted: each prompt is drawn from one seeded generator in this order, so a length's
    prompt -- and the tolerance an earlier run calibrated for it (``--tolerances``) -- depends
    on the lengths before it.  Given as ``100,4000,1500,8000`` (run az), the 1,500-token
    prompt was another prompt than the reference's of that name, and judged by its
    tolerance."""
    try:
        lengths = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated token counts, got {text!r}") from None
    if len(lengths) < 2 or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"two or more token counts >= 1, got {text!r}")
    return lengths


BLOCK_SIZE = 16
"""vLLM's default KV block size on CUDA (the engines set no ``--block-size``)."""
BASELINE_SALT = "baseline"
"""D's own prefill of each prompt (the oracle's baseline) runs under this ``cache_salt``: with
prefix caching on, an unsalted baseline would reuse the very blocks D pulled and judge them by
themselves."""


def build_encoder() -> str:
    """Compile pdpatch's C block encoder for this interpreter, as a wheel install has it (the
    engines run pdpatch from the checkout, where only the CPU machine's build lies); the
    engines fall back to the pure-Python encoder where this fails."""
    source = REPO / "pdpatch" / "hashing" / "_block_items.c"
    target = source.with_name("_block_items" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    cmd = ["cc", "-shared", "-fPIC", "-O2", "-fno-strict-aliasing",
           f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(target)]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"pure Python ({type(exc).__name__}: {getattr(exc, 'stderr', '') or exc})"[:300]
    return f"compiled ({target.name})"


def hit_prompts(prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Requests that find their prefix in D's prefix cache, sent after ``prompts`` (vLLM's
    default, prefix caching on, as operators run it): ``hit-partial`` shares the first half
    (whole blocks) of the longest prompt and pulls only the rest; ``hit-full`` repeats the
    longest prompt, all of it cached on D."""
    longest = list(prompts.values())[-1]
    half = len(longest) // 2 // BLOCK_SIZE * BLOCK_SIZE
    rng = random.Random(len(longest))
    tail = [rng.randrange(3, 512) for _ in range(len(longest) - half)]
    return {"hit-partial": longest[:half] + tail, "hit-full": list(longest)}


def model_config(geometry: str, lengths: tuple[int, ...],
                 speed_lengths: tuple[int, ...] = SPEED_LENGTHS) -> tuple[dict, int]:
    """The model's config overrides and the engines' ``--max-model-len`` for ``geometry`` and
    the longest prompt: a P/D request is the prompt plus :data:`MAX_TOKENS`, and ``--speed``
    requests up to :data:`SPEED_TOKENS` after its own lengths; never below the rig's 2048."""
    longest = max(*lengths, *speed_lengths) + max(MAX_TOKENS, SPEED_TOKENS)
    max_len = max(MAX_MODEL_LEN, -(-longest // 1024) * 1024)
    overrides = dict(GEOMETRIES[geometry])
    if max_len > MAX_MODEL_LEN:
        overrides["max_position_embeddings"] = max_len
    return overrides, max_len


def decoded(r: dict) -> oracle.Decoded:
    return oracle.Decoded(r.get("ids") or [], r.get("lp") or [])


def pd_request(p: Engine, d: Engine, prompt: list[int], mutate=None, salt=None,
               d_salt=None) -> dict:
    """P prefills, D pulls and decodes.  ``salt`` (vLLM's ``cache_salt``) on both sides keeps a
    request apart from what either engine's prefix cache holds already (prefix caching is on,
    vLLM's default); ``d_salt`` on D alone (a tenant mismatch D must refuse)."""
    pre = p.complete(prompt, 1, dict(PREFILL), salt=salt)
    if "error" in pre:
        return {"error": "P: " + pre["error"]}
    kvp = pre["kvp"] or {}
    if mutate is not None:
        kvp = mutate(kvp)
    out = d.pulled(prompt, kvp, salt=d_salt if d_salt is not None else salt)
    out["remote_blocks"] = len(kvp.get("remote_block_ids") or [])
    out["p_lp0"] = (pre.get("lp") or [None])[0]
    return out


def repeat_first_block(kvp: dict) -> dict:
    ids = kvp.get("remote_block_ids") or []
    if ids and isinstance(ids[0], list):        # per KV-cache group
        wrong = [oracle.repeated_block(g) for g in ids]
    else:
        wrong = oracle.repeated_block(ids)
    return {**kvp, "remote_block_ids": wrong}


def kill_p(p: Engine, d: Engine, prompts: dict[str, list[int]]) -> dict:
    """P prefills two requests and dies before D pulls them: D must fail each within the bound
    and go on serving (a local request, then health)."""
    names = list(prompts)[-2:]
    pre = {n: p.complete(prompts[n], 1, dict(PREFILL), salt="kill-p") for n in names}
    p.stop()
    out: dict = {}
    for n in names:
        t0 = time.perf_counter()
        got = d.pulled(prompts[n], pre[n].get("kvp") or {}, salt="kill-p",
                       timeout_s=KILL_BOUND_S)
        out[n] = {"error": got.get("error"), "seconds": round(time.perf_counter() - t0, 1),
                  "decoded": len(got.get("ids") or [])}
    local = d.complete(prompts[names[0]], MAX_TOKENS)
    out["after"] = {"local_ok": len(local.get("ids") or []) == MAX_TOKENS,
                    "healthy": d.healthy(), "alive": d.proc.poll() is None}
    return out


def under_load(p: Engine, d: Engine, prompts: dict[str, list[int]], n: int) -> dict:
    """``n`` P/D requests, :data:`LOAD_IN_FLIGHT` at a time, alternating the two longest prompts;
    where D runs kvcached, its mapped memory is sampled meanwhile (pages mapped for new requests and
    unmapped for finished ones while other requests' transfers run).  Each answer is kept for
    the oracle (against D's own prefill of the same prompt)."""
    names = [list(prompts)[-1 - i % 2] for i in range(n)]
    used: list[int] = []
    ipc = getattr(d, "kvcached_ipc", None)
    with concurrent.futures.ThreadPoolExecutor(LOAD_IN_FLIGHT) as pool:
        t0 = time.perf_counter()
        futs = [pool.submit(pd_request, p, d, prompts[nm], salt=f"load-{i}")
                for i, nm in enumerate(names)]
        while ipc and not all(f.done() for f in futs):
            if (u := kvcached_used(ipc)) is not None:
                used.append(u)
            time.sleep(0.02)
        got = [f.result() for f in futs]
        seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 1), "answers": list(zip(names, got, strict=True)),
            "kvcached_used": churn(used) if ipc else None}


def churn(samples: list[int]) -> dict:
    """How often kvcached's mapped memory grew (pages mapped) and shrank (pages unmapped)."""
    steps = [b - a for a, b in itertools.pairwise(samples)]
    return {"samples": len(samples), "grew": sum(1 for s in steps if s > 0),
            "shrank": sum(1 for s in steps if s < 0),
            "min": min(samples, default=None), "max": max(samples, default=None)}




SAMPLE_KEYS = ("error", "pulled", "bytes", "xfer_s", "descriptors", "remote_blocks", "ms",
               "p_lp0")
"""What each repeated sample records of its P/D request (its answer is judged, then dropped)."""


def repeat_samples(p: Engine, d: Engine, prompts: dict[str, list[int]], rounds: int,
                   phase: str) -> list[dict]:
    """``--repeat``: ``rounds`` more P/D requests of every prompt, round by round, each under
    its own ``cache_salt`` on both sides (no prefix cache hit: every request moves its whole
    KV), for ``n`` samples per pair and prompt; each sample's answer is judged as the first
    pass's are, against D's own prefill of that prompt.  ``phase``: ``fresh`` or ``aged``."""
    out = []
    for rnd in range(rounds):
        for pname, prompt in prompts.items():
            got = pd_request(p, d, prompt, salt=f"{phase}-{rnd}")
            sample = {"prompt": pname, "phase": phase, "round": rnd,
                      **{k: got.get(k) for k in SAMPLE_KEYS}}
            if "error" not in got:
                sample["pd"] = {"ids": got.get("ids"), "lp": got.get("lp")}
            out.append(sample)
    return out


def age_d(d: Engine, paths: Paths) -> dict:
    """Age D (:func:`lab.gpu.aged.age`) by about :data:`lab.gpu.aged.CYCLES` times its KV
    cache, the size D logged (else the size its ``--kv-cache-memory-bytes`` makes)."""
    cfg = json.loads((paths.model / "config.json").read_text())
    logged = aged.logged_cache_tokens(d.log.read_text(errors="replace"))
    tokens = logged or aged.cache_tokens(d.kv_cache_bytes, cfg)

    def complete(prompt: list[int], n: int, salt: str) -> dict:
        return d.complete(prompt, n, salt=salt, timeout_s=600)

    got = aged.age(complete, tokens, paths.max_model_len)
    got["cache_tokens_from"] = "D's log" if logged else "--kv-cache-memory-bytes"
    return got


def _xfer_s(r: PDResult) -> float | None:
    """D's NIXL transfer time for one streamed P/D request; None where it pulled nothing."""
    return r.transfer.xfer_time_s if r.transfer and r.transfer.transfers else None


def _speed_rounds(pairs: dict[str, tuple[Engine, Engine, float]], sides: list[str],
                  lengths: tuple[int, ...], rounds: int, rng: random.Random, errors: list[str]
                  ) -> Iterator[tuple[int, int, dict[str, PDResult]]]:
    """``(round, prompt length, {side: result})`` for every prompt of every round, the same
    prompt sent to both pairs back to back, in an order that alternates; a request that fails
    is recorded in ``errors`` and missing from its round."""
    for rnd in range(rounds):
        for n in lengths:
            prompt = [rng.randrange(3, 512) for _ in range(n)]
            order = sides if (rnd + n) % 2 == 0 else sides[::-1]
            outs = {}
            for k in order:
                p, d, _ = pairs[k]
                try:
                    outs[k] = streamed_pd_request(p, d, prompt, SPEED_TOKENS, timeout_s=120)
                except (OSError, RuntimeError) as e:      # recorded; the round is skipped
                    errors.append(f"{k} len{n}: {type(e).__name__}: {e}"[:200])
            yield rnd, n, outs


def round_detail(rnd: int, length: int, order: list[str], outs: dict[str, PDResult]) -> dict:
    """One paired round of ``--speed`` as ``rounds_detail`` keeps it."""
    return {"round": rnd, "length": length, "first": order[0],
            "ttft_s": {k: round(r.ttft_s, 6) for k, r in outs.items()},
            "xfer_s": {k: _xfer_s(r) for k, r in outs.items()},
            "descriptors": {k: r.transfer.descriptors if r.transfer else None
                            for k, r in outs.items()},
            "identical": outs["on"].decode.token_ids == outs["off"].decode.token_ids}


def speed(paths: Paths, reps: int, warmup: int = SPEED_WARMUP, control: bool = False,
          on_first: bool = False, lengths: tuple[int, ...] = SPEED_LENGTHS,
          on_env: dict[str, str] | None = None) -> dict:
    """P/D TTFT and decode throughput, pdpatch on vs off: two FLASH_ATTN pairs on one GPU, the
    same fresh prompt sent to both back to back (order alternating), ``reps`` rounds per prompt
    length.  TTFT is P's prefill round trip plus D's first streamed token; the paired ratios'
    medians and bootstrap intervals say whether the run resolves the goal.  ``control`` runs
    the "on" pair stock too (an A/A run): what the ratios read when only the pairs differ.
    The pair started second was the faster one in an A/A run; ``on_first`` starts the "on"
    pair first, so two runs with opposite orders cross pdpatch over between the start slots."""
    rng = random.Random(11)
    sides = {"off": Scenario(False, "FLASH_ATTN", "FLASH_ATTN"),
             "on": Scenario(not control, "FLASH_ATTN", "FLASH_ATTN", p_env=dict(on_env or {}),
                           d_env=dict(on_env or {}))}
    start_order = ["on", "off"] if on_first else ["off", "on"]
    pairs = {k: start_pair(f"speed-{k}", sides[k], paths) for k in start_order}
    ttft_by_len: dict[str, dict[int, list[float]]] = {k: {} for k in sides}
    tput: dict[str, list[float]] = {k: [] for k in sides}
    xfer: dict[str, list[float]] = {k: [] for k in sides}
    ratio_ttft, ratio_tput, ratio_xfer, errors, same = [], [], [], [], 0
    detail: list[dict] = []
    stopped = ""
    try:
        rounds = _speed_rounds(pairs, list(sides), lengths, warmup + reps, rng, errors)
        while True:
            try:
                rnd, n, outs = next(rounds)
            except StopIteration:
                break
            except Stopped as exc:     # `timeout`'s SIGTERM: the rounds so far are kept
                stopped = f"stopped ({exc}) after {len(ratio_ttft)} paired rounds"
                break
            if rnd < warmup or len(outs) < 2:
                continue
            for k, r in outs.items():
                ttft_by_len[k].setdefault(n, []).append(r.ttft_s)
                if r.decode.decode_tok_per_s:
                    tput[k].append(r.decode.decode_tok_per_s)
                if _xfer_s(r) is not None:
                    xfer[k].append(_xfer_s(r))
            on, off = outs["on"], outs["off"]
            detail.append(round_detail(rnd - warmup, n, list(outs), outs))
            ratio_ttft.append(on.ttft_s / off.ttft_s)
            if on.decode.decode_tok_per_s and off.decode.decode_tok_per_s:
                ratio_tput.append(off.decode.decode_tok_per_s / on.decode.decode_tok_per_s)
            if _xfer_s(on) is not None and _xfer_s(off):
                ratio_xfer.append(_xfer_s(on) / _xfer_s(off))
            same += on.decode.token_ids == off.decode.token_ids
    finally:
        for p, d, _ in pairs.values():
            p.stop()
            d.stop()
    worst, said = (verdict({"ttft": ratio_ttft, "tput": ratio_tput}, SPEED_GOAL)
                   if ratio_ttft and ratio_tput else (float("nan"), "no paired round finished"))

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 5) if xs else None

    return {"control": control, "started_first": start_order[0],
            "rounds": len(ratio_ttft), "lengths": lengths, "on_env": on_env or {},
            "warmup": warmup,
            "max_tokens": SPEED_TOKENS,
            "start_s": {k: round(v[2], 1) for k, v in pairs.items()},
            "ttft_s": {k: med([x for xs in by.values() for x in xs])
                       for k, by in ttft_by_len.items()},
            "ttft_s_by_length": {k: {n: med(v) for n, v in by.items()}
                                 for k, by in ttft_by_len.items()},
            "decode_tok_s": {k: med(v) for k, v in tput.items()},
            "xfer_s": {k: med(v) for k, v in xfer.items()},
            "ratio_ttft_on_off": [med(ratio_ttft), *median_ci(ratio_ttft)],
            "ratio_tput_off_on": [med(ratio_tput), *median_ci(ratio_tput)],
            # D's NIXL transfer time alone, where pdpatch's read-path wrappers run
            "ratio_xfer_on_off": [med(ratio_xfer), *median_ci(ratio_xfer)] if ratio_xfer else None,
            "paired": {"ttft_on_off": ratio_ttft, "tput_off_on": ratio_tput,
                       "xfer_on_off": ratio_xfer},
            "outputs_identical": f"{same}/{len(ratio_ttft)}", "errors": errors[:10],
            # every paired round by itself: its prompt length, which pair was sent first, each
            # pair's TTFT and NIXL time (the report's n, median and range per length)
            "rounds_detail": detail,
            "worst": round(worst, 4), "verdict": said, **({"stopped": stopped} if stopped else {})}


def run_scenario(name: str, sc: Scenario, prompts: dict[str, list[int]], paths: Paths,
                 two_gpus: bool = False,
                 started: tuple[Engine, Engine, float] | None = None, repeat: int = 0) -> dict:
    """One scenario on its pair (``started``: a pair :func:`start_pairs` started already),
    stopped when it is done.  ``repeat``: that many more rounds of the prompts after the first
    pass and the controls (``samples``); an aged scenario's D is aged first (``aging``)."""
    p, d, start_s = started or start_pair(name, sc, paths, two_gpus)
    res: dict = {"scenario": name, "pdpatch": sc.pdpatch, "P": tp_backend(p.backend, sc.p_tp),
                 "D": tp_backend(d.backend, sc.d_tp), "backends": [p.backend, d.backend],
                 "tp": [sc.p_tp, sc.d_tp],
                 "hashseed": sc.hashseed, "note": sc.note, "start_s": round(start_s, 1),
                 "requests": {}, "controls": {}}
    try:
        if not (p.healthy() and d.healthy()):
            res["error"] = f"engines not healthy after {start_s:.0f}s"
            return res
        # D's cold start (its first kernels; kvcached's first pages) on a local request, so
        # that the first P/D request's time is D's first contact with P alone
        res["d_warmup_ms"] = d.complete(list(range(3, 3 + 2 * BLOCK_SIZE)), 1,
                                        salt="warm-up").get("ms")
        for pname, prompt in {**prompts, **hit_prompts(prompts)}.items():
            got = pd_request(p, d, prompt)
            base = d.complete(prompt, MAX_TOKENS, salt=BASELINE_SALT)
            entry = {k: got.get(k)
                     for k in ("error", "pulled", "bytes", "xfer_s", "descriptors",
                               "remote_blocks", "ms", "p_lp0")}
            if "error" not in got and "error" not in base:
                entry["pd"], entry["base"] = got, base
            res["requests"][pname] = entry
        if sc.controls:
            names = list(prompts)
            long_a, long_b = names[-2], names[-1]
            wrong = pd_request(p, d, prompts[long_a], mutate=repeat_first_block,
                               salt="control-wrong-blocks")
            res["controls"]["wrong-blocks"] = {"prompt": long_a, **_slim(wrong)}
            other = p.complete(prompts[long_b][:len(prompts[long_a])], 1, dict(PREFILL),
                               salt="control-other-prompt")
            kvp = {k: v for k, v in (other.get("kvp") or {}).items()
                   if k != block_keys.PARAMS_KEY}
            swapped = d.pulled(prompts[long_a], kvp, salt="control-other-prompt")
            res["controls"]["other-prompt"] = {"prompt": long_a, **_slim(swapped)}
        if repeat:
            if sc.aged:
                res["aging"] = age_d(d, paths)
            res["samples"] = repeat_samples(p, d, prompts, repeat,
                                            "aged" if sc.aged else "fresh")
        if sc.salt_mismatch:
            prompt = prompts[list(prompts)[-2]]
            got = pd_request(p, d, prompt, salt="tenant", d_salt="another-tenant")
            res["salt_mismatch"] = {k: got.get(k) for k in ("error", "pulled")}
        if sc.load:
            res["load"] = under_load(p, d, prompts, sc.load)
        if sc.kill_p:
            res["kill_p"] = kill_p(p, d, prompts)
    finally:
        for e in (p, d):
            e.stop()
    res["d_log_pdpatch"] = [ln for ln in d.log.read_text(errors="replace").splitlines()
                            if "pdpatch" in ln][:20]
    res["errors"] = {e.name: [ln for ln in e.log.read_text(errors="replace").splitlines()
                              if "Error" in ln or "Traceback" in ln][:10] for e in (p, d)}
    return res


def tp_backend(backend: str, tp: int) -> str:
    """An engine's backend for the results table, with its TP size where above 1."""
    return f"{backend} TP{tp}" if tp > 1 else backend


def _slim(r: dict) -> dict:
    return {k: r.get(k) for k in ("error", "ids", "lp", "pulled", "p_lp0")}


REFERENCES = ("ref", "ref-triton", "ref-load", "ref-tp12", "ref-tp21", "ref-triton-tp12",
              "ref-triton-tp21", "ref-load-tp12", "ref-load-tp21", "ref-aged")
"""Stock same-backend scenarios: each calibrates the tolerances of its backend at its TP sizes
(all of one key in a run pooled), ``ref-load`` the load phase's too."""


def calibration_key(backend: str, tp: tuple[int, int] | list[int] = (1, 1)) -> str:
    """What a calibration is kept under: the backend, and the pair's TP sizes where not 1 -> 1
    (a TP-2 engine's all-reduce sums in another order: its drift is its own)."""
    return backend if tuple(tp) == (1, 1) else f"{backend} TP{tp[0]}->{tp[1]}"


def pair_keys(res: dict) -> list[str]:
    """The calibration keys of a scenario's P and D kernels (one where they are the same)."""
    backends = res.get("backends") or [res["P"], res["D"]]
    return list(dict.fromkeys(calibration_key(b, res.get("tp", (1, 1))) for b in backends))
PHASES = ("sequential", "load")
Tolerances = dict[str, dict[str, oracle.Calibration | None]]
"""Backend -> phase -> its calibration (None: no reference measured it)."""


def reference_samples(res: dict) -> dict[str, dict[str, list[oracle.Sample]]]:
    """A reference scenario's intact answers per phase and prompt, each with D's sequential
    baseline of its prompt (read before :func:`judge` replaces them by verdicts)."""
    out: dict[str, dict[str, list[oracle.Sample]]] = {"sequential": {}, "load": {}}
    for pname, e in res["requests"].items():
        if "pd" in e:
            out["sequential"][pname] = [(decoded(e["pd"]), decoded(e["base"]), e.get("p_lp0"))]
    for pname, got in (res.get("load") or {}).get("answers", []):
        base = res["requests"][pname].get("base")
        if base is not None and not got.get("error"):
            out["load"].setdefault(pname, []).append((decoded(got), decoded(base),
                                                      got.get("p_lp0")))
    return out


def calibrations(results: list[dict], earlier: Tolerances | None = None) -> Tolerances:
    """Per backend and phase, from this run's reference scenarios where it has them, else from
    ``earlier`` (``--tolerances``).  The load tolerance pools the backend's sequential answers
    with its load reference's load answers: a request under load may also run alone."""
    seq: dict[str, dict[str, list[oracle.Sample]]] = {}
    load: dict[str, dict[str, list[oracle.Sample]]] = {}
    names: dict[tuple[str, str], list[str]] = {}
    for res in results:
        keys = pair_keys(res)
        if res["scenario"] not in REFERENCES or res["pdpatch"] or len(keys) != 1:
            continue
        backend, got = keys[0], reference_samples(res)
        for phase, into in (("sequential", seq), ("load", load)):
            if got[phase]:
                names.setdefault((backend, phase), []).append(res["scenario"])
                for pname, xs in got[phase].items():
                    into.setdefault(backend, {}).setdefault(pname, []).extend(xs)
    out: Tolerances = {b: dict(c) for b, c in (earlier or {}).items()}
    for backend, samples in seq.items():
        out.setdefault(backend, dict.fromkeys(PHASES))["sequential"] = oracle.calibrate(
            samples, f"{backend}: {'+'.join(names[backend, 'sequential'])}")
    for backend, samples in load.items():
        pooled = {n: seq.get(backend, {}).get(n, []) + xs for n, xs in samples.items()}
        out.setdefault(backend, dict.fromkeys(PHASES))["load"] = oracle.calibrate(
            pooled, f"{backend}: {'+'.join(names[backend, 'load'])}, under load")
    return out


def parse_tolerances(data: dict, origin: str) -> Tolerances:
    """The ``tolerances`` of an earlier run's gpu_pd.json: per backend and phase, or the flat
    ``{prompt: tolerance}`` of runs before the per-backend calibration (their reference was
    ``ref``: FLASH_ATTN, sequential)."""
    if all(isinstance(v, int | float) for v in data.values()):
        return {"FLASH_ATTN": {"sequential": oracle.Calibration(
                    f"FLASH_ATTN: {origin} (flat, sequential)", dict(data)), "load": None}}
    return {b: {ph: oracle.Calibration(f"{c['source']} (from {origin})", c["tol"],
                                       c.get("ties") or {}) if c else None
                for ph, c in phases.items()}
            for b, phases in data.items()}


def tolerances_json(cals: Tolerances) -> dict:
    """:data:`Tolerances` as gpu_pd.json records them (what :func:`parse_tolerances` reads)."""
    return {b: {ph: dataclasses.asdict(c) if c else None for ph, c in phases.items()}
            for b, phases in cals.items()}


def pair_calibration(res: dict, cals: Tolerances, phase: str
                     ) -> tuple[oracle.Calibration | None, str]:
    """What judges ``res``'s ``phase``: the wider of its P's and D's backend calibrations, and
    which those are; None, and the backends without one, where either is missing (never
    borrowed from another backend)."""
    backends = pair_keys(res)
    got = [(cals.get(b) or {}).get(phase) for b in backends]
    missing = [b for b, c in zip(backends, got, strict=True) if c is None]
    if missing:
        return None, f"no {phase} reference for {' and '.join(missing)}"
    return oracle.widest([c for c in got if c is not None]), \
        " + ".join(c.source for c in got if c is not None)


def answer_verdict(got: dict, base: dict, p_own: float | None, cal: oracle.Calibration | None,
            pname: str, why_none: str) -> dict:
    """One answer's verdict fields; ``intact`` None (and why) where ``cal`` has no tolerance
    for ``pname``.  The first tokens are kept so a later re-judge needs no decode."""
    pd, b = decoded(got), decoded(base)
    first = {"first": (pd.token_ids or [None])[0], "base_first": (b.token_ids or [None])[0]}
    if cal is None or pname not in cal.tol:
        why = why_none if cal is None else f"no tolerance for {pname} in {cal.source}"
        dlp0 = oracle.drift(pd, b, p_own) if pd.logprobs and b.logprobs else None
        return {"intact": None, "reason": f"not judged: {why}", "dlp0": dlp0, "tol": None,
                "agree": oracle.leading_agreement(pd.token_ids, b.token_ids), **first}
    v = oracle.judge(pd, b, cal.tol[pname], p_own, cal.ties.get(pname, ()))
    return {"intact": v.intact, "reason": v.reason, "dlp0": v.dlp0, "tol": v.tol,
            "agree": v.agree, **first}


def judge(results: list[dict], cals: Tolerances) -> None:
    """Attach the oracle's verdicts to every request and control (in place), each scenario by
    its backends' calibrations (recorded in ``calibration``).  A control that ended in an
    error, or has no tolerance, is no evidence either way and is not counted."""
    mark_same_as_stock(results)
    for res in results:
        cal, said = pair_calibration(res, cals, "sequential")
        res["calibration"] = {"sequential": said}
        verdicts = {}
        for cname, c in res["controls"].items():
            entry = res["requests"][c["prompt"]]
            if c.get("error") or "base" not in entry:
                c["caught"] = None
                continue
            v = answer_verdict(c, entry["base"], entry.get("p_lp0"), cal, c["prompt"], said)
            c.update(caught=None if v["intact"] is None else not v["intact"],
                     reason=v["reason"], dlp0=v["dlp0"])
            if v["intact"] is not None:
                verdicts[f"{res['scenario']}/{cname}"] = oracle.Verdict(
                    v["intact"], v["reason"], v["dlp0"], v["tol"], v["agree"])
        res["oracle"] = oracle.judge_run(verdicts).__dict__ if res["controls"] else None
        if "load" in res:
            lcal, res["calibration"]["load"] = pair_calibration(res, cals, "load")
            judge_load(res["load"], res["requests"], lcal, res["calibration"]["load"])
        judge_samples(res, cal, said)
        for pname, entry in res["requests"].items():
            if "pd" in entry:
                entry.update(answer_verdict(entry.pop("pd"), entry.pop("base"), entry.get("p_lp0"),
                                     cal, pname, said))


def judge_samples(res: dict, cal: oracle.Calibration | None, said: str) -> None:
    """The repeated samples' verdicts (in place), each against D's own prefill of its prompt
    from the first pass, by the scenario's sequential calibration; a sample that failed, or
    whose prompt has no baseline, keeps no answer and is not judged."""
    for sample in res.get("samples") or []:
        got = sample.pop("pd", None)
        entry = res["requests"].get(sample["prompt"]) or {}
        if got is None or "base" not in entry:
            sample["intact"] = None
            continue
        sample.update(answer_verdict(got, entry["base"], sample.get("p_lp0"), cal,
                                     sample["prompt"], said))


def mark_same_as_stock(results: list[dict]) -> None:
    """Where a scenario runs the kernels of a stock reference of the run (same backends, same
    TP sizes), its answers should be *the stock pair's answers*, token for token and logprob
    for logprob: P prefills the same prompt alike, and a byte-exact transfer leaves D nothing
    to differ on.  ``same_as_stock`` per request and ``identical_to_stock`` ("k/n", and the
    reference) per scenario record it -- a check no tolerance loosens, next to the oracle's,
    which the mixed pairs need."""
    stock: dict[tuple[str, ...], tuple[str, dict]] = {}
    for res in results:
        keys = tuple(pair_keys(res))
        if res["scenario"] in REFERENCES and not res.get("pdpatch") and keys not in stock:
            stock[keys] = (res["scenario"], {n: e["pd"] for n, e in res["requests"].items()
                                             if "pd" in e})
    for res in results:
        ref = stock.get(tuple(pair_keys(res)))
        if ref is not None:     # repeated samples: the reference's own too (the same kernels)
            for sample in res.get("samples") or []:
                want = ref[1].get(sample["prompt"])
                if "pd" in sample and want is not None:
                    sample["same_as_stock"] = (sample["pd"].get("ids") == want.get("ids")
                                               and sample["pd"].get("lp") == want.get("lp"))
        if ref is None or ref[0] == res["scenario"]:
            continue
        same = 0
        for pname, entry in res["requests"].items():
            want = ref[1].get(pname)
            if "pd" in entry and want is not None:
                entry["same_as_stock"] = (entry["pd"].get("ids") == want.get("ids")
                                          and entry["pd"].get("lp") == want.get("lp"))
                same += entry["same_as_stock"]
        compared = sum(1 for e in res["requests"].values() if "same_as_stock" in e)
        res["identical_to_stock"] = f"{same}/{compared} ({ref[0]})"


def judge_load(load: dict, requests: dict, cal: oracle.Calibration | None,
               why_none: str = "no load reference") -> None:
    """Replace the load phase's answers by their verdicts (against D's own prefill of the same
    prompt, from the sequential phase, within the drift a stock pair shows under load); where
    no load reference measured that drift, the answers are not judged (``unjudged``)."""
    verdicts = []
    for pname, got in load.pop("answers"):
        base = requests[pname].get("base")
        if got.get("error") or base is None:
            verdicts.append({"prompt": pname, "error": got.get("error") or "no baseline"})
            continue
        v = answer_verdict(got, base, got.get("p_lp0"), cal, pname, why_none)
        verdicts.append({"prompt": pname, **v, "ids": got.get("ids")})
    load.update(requests=len(verdicts), intact=sum(1 for v in verdicts if v.get("intact")),
                unjudged=sum(1 for v in verdicts if "error" not in v and v["intact"] is None),
                unjudged_why=sorted({v["reason"] for v in verdicts
                                     if "error" not in v and v["intact"] is None}),
                errors=sorted({v["error"][:120] for v in verdicts if "error" in v}),
                not_intact=[v for v in verdicts if v.get("intact") is False],
                drift=[[v["prompt"], v["first"], v["dlp0"]] for v in verdicts if "error" not in v])


_FLIPPED = re.compile(r"first token (\d+) != (\d+)")


def _recorded_sample(v: dict) -> oracle.Sample | None:
    """A verdict of a record written before per-answer first tokens were kept, as a sample with
    its drift and, where the first token differed (the reason says so), both tokens: what
    :func:`oracle.calibrate` and :func:`oracle.judge` read.  None where nothing was decoded."""
    dlp0 = v.get("dlp0")
    if dlp0 is None or dlp0 == float("inf"):
        return None
    m = _FLIPPED.match(v.get("reason") or "")
    first, base_first = (int(m[1]), int(m[2])) if m else (0, 0)
    return oracle.Decoded([first], [-dlp0]), oracle.Decoded([base_first], [0.0]), None


def rejudge_recorded(run: dict, reference: dict) -> dict:
    """Re-judge a gpu_pd.json written with flat tolerances (runs up to t) by a recorded stock
    same-backend reference, from what both records keep: every sequential request's drift and
    first-token verdict, but of the load answers only the not-intact ones (the intact ones are
    known only to lie within the flat tolerance they were judged by).  So the load tolerance is
    a range [from the recorded drifts, with the reference's unrecorded ones at their bound];
    the re-judge is ``faithful`` where the range is one value and no load tolerance narrows
    (the run's recorded-intact answers stay intact)."""
    ref = next(r for r in reference["results"]
               if r["scenario"] in REFERENCES and not r["pdpatch"] and r["P"] == r["D"])
    seq = {n: [x] for n, e in ref["requests"].items() if (x := _recorded_sample(e))}
    seq_cal = oracle.calibrate(seq, f"{ref['P']}: {ref['scenario']} (recorded)")
    known: dict[str, list[oracle.Sample]] = {}
    for v in ref["load"]["not_intact"]:
        if x := _recorded_sample(v):
            known.setdefault(v["prompt"], list(seq.get(v["prompt"], []))).append(x)
    prompts = [n for n in ref["requests"] if not n.startswith("hit-")][-2:]
    for n in prompts:
        known.setdefault(n, list(seq.get(n, [])))
    bound = {n: known[n] + [(oracle.Decoded([0], [-reference["tolerances"][n]]),
                             oracle.Decoded([0], [0.0]), None)] for n in prompts}
    lo, hi = oracle.calibrate(known, "recorded"), oracle.calibrate(bound, "bound")
    out: dict = {"reference": ref["scenario"], "sequential_tol": seq_cal.tol,
                 "sequential_ties": seq_cal.ties,
                 "load_tol": {n: [lo.tol[n], hi.tol[n]] for n in prompts}, "scenarios": []}
    for res in run["results"]:
        if (res["P"], res["D"]) != (ref["P"], ref["P"]):
            continue
        got: dict = {"scenario": res["scenario"], "sequential": {}}
        for n, e in res["requests"].items():
            if (x := _recorded_sample(e)) and n in seq_cal.tol:
                v = oracle.judge(x[0], x[1], seq_cal.tol[n], None, seq_cal.ties.get(n, ()))
                got["sequential"][n] = {"was": e.get("intact"), "now": v.intact,
                                        "dlp0": e["dlp0"], "tol": v.tol}
        got["controls_caught"] = {
            c: not oracle.judge(x[0], x[1], seq_cal.tol[v["prompt"]], None,
                                seq_cal.ties.get(v["prompt"], ())).intact
            for c, v in res["controls"].items() if (x := _recorded_sample(v))}
        if "load" in res:
            ld = res["load"]
            now = [[oracle.judge(x[0], x[1], cal.tol[v["prompt"]], None,
                                 cal.ties.get(v["prompt"], ())).intact
                    for v in ld["not_intact"] if (x := _recorded_sample(v))]
                   for cal in (lo, hi)]
            narrows = [n for n in prompts if lo.tol[n] < run["tolerances"][n]]
            got["load"] = {"requests": ld["requests"], "was_intact": ld["intact"],
                           "intact": [ld["intact"] + sum(xs) for xs in now],
                           "faithful": lo.tol == hi.tol and not narrows,
                           "narrowed": narrows}
        out["scenarios"].append(got)
    return out


def markdown(results: list[dict], gpu: str) -> str:
    rows = [f"GPU: {gpu}", "",
            "| scenario | pdpatch | P -> D | PYTHONHASHSEED | start s | intact / requests | "
            "KV pulled (requests) | D's NIXL time per prompt, ms (descriptors) | max dlp0 | "
            "controls caught | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        reqs = r["requests"].values()
        intact = sum(1 for e in reqs if e.get("intact"))
        unjudged = sum(1 for e in reqs if "reason" in e and e.get("intact") is None)
        pulled = sum(1 for e in reqs if (e.get("pulled") or 0) > 0)
        dl = max((e.get("dlp0") or 0.0 for e in reqs), default=0.0)
        ctl = r.get("oracle") or {}
        caught = f"{ctl.get('caught')}/{ctl.get('controls')}" if ctl else "-"
        errs = sorted({(e.get("error") or "")[:80] for e in reqs if e.get("error")})
        judged_by = [f"{ph} judged by {said}" if " reference for " not in said
                     else f"{ph} NOT JUDGED: {said}"
                     for ph, said in (r.get("calibration") or {}).items()]
        note = "; ".join(filter(None, [r.get("note", ""), r.get("error", ""), *errs,
                                       *judged_by]))
        if "identical_to_stock" in r:
            note += f"; answers identical to stock's: {r['identical_to_stock']}"
        first = next(iter(r["requests"].values()), {}).get("ms")
        if first is not None:
            note += (f"; first P/D request {first:.0f} ms (D's cold local request before it: "
                     f"{r.get('d_warmup_ms') or 0:.0f} ms)")
        if "salt_mismatch" in r:
            note += f"; salt mismatch: pulled={r['salt_mismatch'].get('pulled')}"
        if "load" in r:
            ld = r["load"]
            note += (f"; {ld['requests']} at once ({LOAD_IN_FLIGHT} in flight): "
                     f"{ld['intact']} intact in {ld['seconds']}s")
            if ld.get("unjudged"):
                note += f", {ld['unjudged']} not judged"
            if ld.get("kvcached_used"):
                note += f", kvcached memory {ld['kvcached_used']}"
        if r.get("samples"):
            note += f"; repeated: {samples_summary(r['samples'])}"
        if "aging" in r:
            a = r["aging"]
            note += (f"; D aged by {a['requests']} local requests ({a['cycles']}x its "
                     f"{a['cache_tokens']:,}-token cache, {a['failed']} failed, finish-order "
                     f"inversions {a['inversions']}) in {a['seconds']}s")
        if "kill_p" in r:
            k = r["kill_p"]
            fails = [f"{v['seconds']}s {'error' if v['error'] else 'decoded ' + str(v['decoded'])}"
                     for n, v in k.items() if n != "after"]
            note += f"; P killed: {', '.join(fails)}; after: {k['after']}"
        xfer = ", ".join(f"{n.removeprefix('len')}: {e['xfer_s'] * 1e3:.2f}"
                         + (f" ({e['descriptors']} d)" if e.get("descriptors") else "")
                         for n, e in r["requests"].items() if e.get("xfer_s"))
        rows.append(f"| {r['scenario']} | {r['pdpatch']} | {r['P']} -> {r['D']} | "
                    f"{r['hashseed']} | {r['start_s']} | {intact}/{len(r['requests'])}"
                    f"{f' ({unjudged} not judged)' if unjudged else ''} | "
                    f"{pulled} | {xfer or '-'} | {dl:.1e} | {caught} | {note} |")
    return "\n".join(rows) + "\n"


def samples_summary(samples: list[dict]) -> str:
    """Per phase and prompt: D's NIXL time per request, median of the samples (n), and their
    median descriptors."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for x in samples:
        groups.setdefault((x["phase"], x["prompt"]), []).append(x)
    parts = []
    for (phase, pname), xs in groups.items():
        times = [x["xfer_s"] * 1e3 for x in xs if x.get("xfer_s")]
        descs = [x["descriptors"] for x in xs if x.get("descriptors")]
        if times:
            parts.append(f"{phase} {pname.removeprefix('len')}: {statistics.median(times):.2f} "
                         f"ms (n={len(times)}"
                         + (f", {statistics.median(descs):.0f} d" if descs else "") + ")")
    return ", ".join(parts) or "none pulled"


class Stopped(Exception):
    """SIGTERM (what ``timeout`` sends) during a run: its engines are stopped, and the
    scenarios it finished are judged and written with its logs, rather than lost."""


def _stop(signum: int, _frame: object) -> None:
    raise Stopped(f"signal {signum}")


def prompt_digests(prompts: dict[str, list[int]]) -> dict[str, str]:
    """Each prompt's token ids, hashed: what a tolerance of that prompt's name was measured on."""
    return {name: hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
            for name, ids in {**prompts, **hit_prompts(prompts)}.items()}


def earlier_tolerances(path: Path, digests: dict[str, str]) -> Tolerances:
    """``--tolerances``: an earlier run's calibrations, less the prompts whose name this run
    gives to other token ids (its ``prompts`` digests; runs before they were recorded are
    taken as they are)."""
    data = json.loads(path.read_text())
    cals = parse_tolerances(data["tolerances"], path.name)
    other = sorted(n for n, d in (data.get("prompts") or {}).items()
                   if n in digests and digests[n] != d)
    if other:
        print(f"--tolerances {path.name}: not used for {', '.join(other)} (other prompts of "
              "the same names there)", flush=True)
        for phases in cals.values():
            for cal in phases.values():
                if cal is not None:
                    for n in other:
                        cal.tol.pop(n, None)
                        cal.ties.pop(n, None)
    return cals


def write_results(args: argparse.Namespace, gpu: str, results: list[dict], stopped: str,
                  prompts: dict[str, list[int]], name: str = "gpu_pd",
                  extra: dict | None = None) -> None:
    """Judge ``results`` and write ``NAME.json`` / ``NAME.md`` (``stopped``: why the run ended
    before its last scenario, or ""; ``extra``: more top-level fields, e.g. the full-width
    model's ``weights`` manifest and the ``order`` the pairs were started in)."""
    digests = prompt_digests(prompts)
    earlier = earlier_tolerances(args.tolerances, digests) if args.tolerances else None
    cals = calibrations(results, earlier)
    judge(results, cals)
    record = {"gpu": gpu, "tolerances": tolerances_json(cals), "prompts": digests,
              **(extra or {}), "results": results}
    if stopped:
        record["stopped"] = stopped
    (args.out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
    table = markdown(results, gpu) + (f"\n{stopped}\n" if stopped else "")
    (args.out / f"{name}.md").write_text(table)
    print(table, flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--site", type=Path, default=Path("/tmp/pdpatch-gpu-site"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/pdpatch-gpu-work"),
                    help="model and engine logs (only the summary and a log archive go to --out)")
    ap.add_argument("--tolerances", type=Path,
                    help="gpu_pd.json of an earlier run: its calibrations judge what this run's "
                         f"own references ({', '.join(REFERENCES)}) do not measure")
    ap.add_argument("--two-gpus", action="store_true",
                    help="P on GPU 0, D on GPU 1, a TP-2 engine on both (nvidia-h200-x2); "
                         "the *tp12/*tp21 scenarios need it")
    ap.add_argument("--speed", type=int, metavar="ROUNDS", default=0,
                    help="also time P/D with pdpatch on vs off (paired, ROUNDS per prompt "
                         "length); writes $OUT/gpu_speed.json")
    ap.add_argument("--speed-control", action="store_true",
                    help="with --speed: both pairs stock (A/A), to measure the pairs' own bias")
    ap.add_argument("--speed-on-first", action="store_true",
                    help="with --speed: start the pdpatch pair first (the default starts it "
                         "second); two runs with opposite orders cancel a start-order bias")
    ap.add_argument("--speed-starts", type=int, default=1, metavar="K",
                    help="with --speed: K pair starts, the pdpatch pair started first and "
                         "second by turns (the first as --speed-on-first says); writes "
                         "$OUT/gpu_speed-1.json ... -K.json where K > 1")
    ap.add_argument("--speed-warmup", type=int, default=SPEED_WARMUP, metavar="ROUNDS",
                    help="with --speed: unmeasured rounds first (default %(default)s)")
    ap.add_argument("--speed-lengths", type=prompt_lengths, default=SPEED_LENGTHS,
                    metavar="N,N,...", help="with --speed: its prompt lengths (default: "
                    f"{','.join(map(str, SPEED_LENGTHS))})")
    ap.add_argument("--speed-on-env", action="append", default=[], metavar="NAME=VALUE",
                    help="with --speed: a setting of the pdpatch pair's P and D (e.g. "
                         "PDPATCH_KV_COALESCE=1, PDPATCH_BLOCK_KEYS=0); repeatable")
    ap.add_argument("--together", action="store_true",
                    help="start every scenario's pair at once (kvcached ones excepted), then "
                         "measure each alone while the others wait idle: saves ~2 min per TP-2 "
                         "pair; the pairs must fit the GPUs together (see --kv-cache-gib)")
    ap.add_argument("--repeat", type=int, default=0, metavar="ROUNDS",
                    help="after each scenario's first pass and controls, ROUNDS more rounds of "
                         "its prompts, each request salted (no prefix hit) and judged: n = "
                         "ROUNDS samples per pair and prompt (an aged scenario: after aging D)")
    ap.add_argument("--cross", action="store_true",
                    help="then the scenarios again in the reverse order, each on a pair started "
                         "anew: every pair is measured once before and once after the others "
                         "(crossed starts); writes $OUT/gpu_pd-crossed.json")
    ap.add_argument("--dry-run", action="store_true",
                    help="start nothing: print what the call would carry, start and send, in "
                         "order, with its device time and memory against the device's limits "
                         "(lab/gpu/dryrun.py); exit 1 where a limit is broken")
    ap.add_argument("--no-load", action="store_true",
                    help="skip the scenarios' load phase (e.g. a pair whose READs go over TCP "
                         "loopback, where 96 long requests take minutes)")
    ap.add_argument("--kv-cache-gib", type=float, default=KV_CACHE_BYTES / (1 << 30),
                    help="KV cache of each engine not on kvcached, GiB per GPU (default "
                         f"{KV_CACHE_BYTES >> 30})")
    ap.add_argument("--p-kv-cache-gib", type=float,
                    help="P's KV cache where it differs from D's (--kv-cache-gib), GiB per GPU")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny",
                    help="the model's KV geometry: llama3-8b (32 layers, 8 KV heads of 128), "
                         "qwen2.5-7b (28 layers, 4 KV heads of 128), llama3-70b (80 layers, "
                         "8 KV heads of 128; for TP 2), llama3-70b-tp2 (80 layers, 4 KV heads "
                         "of 128: one GPU's share of 70B at TP 2), deepseek-v2-lite (MLA: 27 "
                         "layers of a 512+64 latent; MLA backends); *-full: that model's "
                         "architecture at full width, seeded weights drawn on the GPU "
                         "(lab/gpu/weights.py); default: the tiny Llama")
    ap.add_argument("--prompt-lengths", type=prompt_lengths, default=PROMPT_LENGTHS,
                    metavar="N,N,...", help="prompt lengths in tokens (default: "
                    f"{','.join(map(str, PROMPT_LENGTHS))})")
    # checked below, not by ``choices``: Python 3.11's argparse refuses an empty list with them
    ap.add_argument("scenarios", nargs="*", metavar="SCENARIO",
                    help=f"any of {', '.join(sorted(SCENARIOS))}")
    return ap


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """What ``main`` refuses before anything runs (``ap.error``); the ``--speed-on-env``
    settings."""
    unknown = [n for n in args.scenarios if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(unknown)}; choose from "
                 f"{', '.join(sorted(SCENARIOS))}")
    if not (args.scenarios or args.speed):
        ap.error("name a scenario or --speed")
    on_env = dict(kv.partition("=")[::2] for kv in args.speed_on_env)
    if any(not k.startswith("PDPATCH_") for k in on_env):
        ap.error("--speed-on-env takes PDPATCH_NAME=VALUE settings")
    if args.repeat < 0 or args.speed_starts < 1:
        ap.error("--repeat takes 0 or more rounds, --speed-starts 1 or more starts")
    unaged = [n for n in args.scenarios if SCENARIOS[n].aged and not args.repeat]
    if unaged:
        ap.error(f"{', '.join(unaged)}: an aged scenario measures its samples after aging D: "
                 "give --repeat ROUNDS")
    for name in args.scenarios:
        try:
            placement(SCENARIOS[name], args.two_gpus)
        except ValueError as exc:
            ap.error(f"{name}: {exc}")
    if args.scenarios and args.tolerances is None and \
            not set(REFERENCES) & set(args.scenarios):
        ap.error(f"name a reference scenario ({', '.join(REFERENCES)}) or take an "
                 "earlier run's tolerances with --tolerances")
    return on_env


def make_model(args: argparse.Namespace) -> tuple[Path, int, dict | None]:
    """The served model's folder, the engines' ``--max-model-len``, and for a full-width model
    its weights' manifest (drawn on this machine's GPU, :mod:`lab.gpu.weights`)."""
    from lab.rig.model import model_dir

    overrides, max_len = model_config(args.geometry, args.prompt_lengths,
                                      args.speed_lengths if args.speed else ())
    dest = args.work / f"model-{args.geometry}-{max_len}"
    if not is_full_width(args.geometry):
        return model_dir(dest, **overrides), max_len, None
    manifest = weights.write(dest, overrides, device="cuda")
    print(f"full-width {args.geometry}: {manifest['parameters'] / 1e9:.2f} B parameters, "
          f"{manifest['bytes'] / 2**30:.1f} GiB, drawn and written in {manifest['seconds']}s "
          f"(fingerprint {manifest['fingerprint']})", flush=True)
    return dest, max_len, manifest


def scenario_orders(names: list[str], cross: bool) -> list[list[str]]:
    """The scenario lists a call runs, in order: the names as given, and with ``--cross`` the
    same again reversed, each pair started anew."""
    return [list(names), list(reversed(names))] if cross else [list(names)]


def speed_orders(first_on: bool, starts: int) -> list[bool]:
    """``--speed-starts``: whether each start puts the pdpatch pair first, by turns."""
    return [first_on if i % 2 == 0 else not first_on for i in range(starts)]


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    on_env = check_args(ap, args)
    if args.dry_run:
        from lab.gpu import dryrun

        plan = dryrun.plan_call(args)
        print(plan.text(), flush=True)
        return 0 if plan.ok else 1
    kvcached = [n for n in args.scenarios if SCENARIOS[n].d_kvcached]
    if kvcached and not (args.stage / "kvcached").is_dir():
        ap.error(f"{', '.join(kvcached)}: a kvcached D needs the stage's kvcached/ folder "
                 f"(scripts/gpu_stage.sh --kvcached); {args.stage} has none")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    shutil.rmtree(logs, ignore_errors=True)     # an earlier call's logs are not this run's
    logs.mkdir(parents=True)
    took = unpack.ensure(args.stage, args.site)
    print(f"unpacked in {took:.1f}s" if took is not None else
          f"{args.stage} already unpacked in {args.site}", flush=True)
    print(f"block-key encoder: {build_encoder()}", flush=True)
    import torch

    model, max_len, manifest = make_model(args)
    kvc = install_kvcached(args.stage, args.work / "kvcached") if kvcached else None
    paths = Paths(args.site, model, logs, kvc, max_len, mla=is_mla(args.geometry),
                  kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                  p_kv_cache_bytes=None if args.p_kv_cache_gib is None
                  else int(args.p_kv_cache_gib * (1 << 30)))
    gpu = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
           f"{' (P on GPU 0, D on GPU 1, TP 2 on both)' if args.two_gpus else ''}, "
           f"torch {torch.__version__}, vLLM {unpack.site_release(args.site)}, "
           f"model geometry {args.geometry}, prefix caching on")
    extra = {"weights": manifest} if manifest else {}
    rng = random.Random(7)
    prompts = {f"len{n}": [rng.randrange(3, 512) for _ in range(n)]
               for n in args.prompt_lengths}
    chosen = {n: dataclasses.replace(SCENARIOS[n], load=0) if args.no_load else SCENARIOS[n]
              for n in args.scenarios}
    orders = scenario_orders(args.scenarios, args.cross) if args.scenarios else []
    done: list[tuple[str, list[dict]]] = []      # (file name, results) per order
    running = "setup"
    pairs: dict[str, tuple[Engine, Engine, float]] = {}
    try:
        signal.signal(signal.SIGTERM, _stop)
        for i, order in enumerate(orders):
            done.append(("gpu_pd" if i == 0 else "gpu_pd-crossed", []))
            if args.together:
                running = "starting the pairs together"
                t0 = time.time()
                pairs = start_pairs({n: chosen[n] for n in order}, paths, args.two_gpus)
                print(f"{len(pairs)} pairs started together in {time.time() - t0:.0f}s",
                      flush=True)
            for running in order:
                print(f"=== {running}{' (crossed order)' if i else ''}", flush=True)
                done[-1][1].append(run_scenario(running, chosen[running], prompts, paths,
                                                args.two_gpus, pairs.pop(running, None),
                                                repeat=args.repeat))
        if args.speed:
            for k, on_first in enumerate(speed_orders(args.speed_on_first, args.speed_starts)):
                which = "first" if on_first else "second"
                print(f"=== speed (start {k + 1}, pdpatch pair {which})", flush=True)
                running = "speed"
                timed = {"gpu": gpu, **extra,
                         **speed(paths, args.speed, args.speed_warmup,
                                 control=args.speed_control,
                                 on_first=on_first, lengths=args.speed_lengths,
                                 on_env=on_env)}
                fname = "gpu_speed.json" if args.speed_starts == 1 else f"gpu_speed-{k + 1}.json"
                (args.out / fname).write_text(json.dumps(timed, indent=1))
                print(json.dumps({k_: v for k_, v in timed.items()
                                  if k_ not in ("paired", "rounds_detail")}, indent=1),
                      flush=True)
        running = ""
    except Stopped as exc:
        print(f"stopped ({exc}) during {running}: writing what the run has", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for p, d, _ in pairs.values():
            p.stop()
            d.stop()
        for i, (name, results) in enumerate(done):
            if results:
                last = i == len(done) - 1
                write_results(args, gpu, results,
                              f"stopped during {running}"
                              if running and last and running != "speed" else "", prompts,
                              name, {**extra, "order": [r["scenario"] for r in results],
                                     "crossed": i > 0})
        with tarfile.open(args.out / "logs.tar.xz", "w:xz") as tf:
            tf.add(logs, arcname="logs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
