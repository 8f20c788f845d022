"""Full-width models with seeded, properly scaled weights, generated where they are served.

The GPU engines so far served the rig's narrow model (hidden 256, vocabulary 512) given a real
model's layers and KV cache (:data:`lab.gpu.pd.GEOMETRIES`): a request moves the real model's KV
bytes, but its prefill is a tiny model's, so a TTFT ratio overstates what a deployment sees.
The models here have the named model's architecture at its full width -- Llama-3-8B (hidden
4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336, vocabulary 128256), Qwen2.5-7B
(hidden 3584, 28 layers, 28 / 4 heads, q/k/v biases, MLP 18944, vocabulary 152064) and
DeepSeek-V2-Lite's MLA attention (hidden 2048, 27 layers, 16 heads, a 512 + 64 latent,
vocabulary 102400) -- so a prefill costs what the real model's costs.  The weights are random,
so the answers are no language, but every token is computed by the real shapes.

Why the weights are generated, not downloaded or carried: the device machine reaches no network
and a call carries 64 MiB (Llama-3-8B is 16 GB in bf16).  Each tensor is drawn from its own
generator, seeded by the recipe, the seed and the tensor's name (:func:`tensor_seed`), on the
device's GPU (:func:`write`: a few seconds for 8B; the CPU's generator in the tests), so the
checkpoint is the same whatever the order, the sharding or the process, and a P and a D engine
load the very same files.  A checkpoint made by one kind of generator is not the other's (CUDA's
Philox and the CPU's Mersenne twister draw other numbers): ``weights.json`` records the device
and a fingerprint of the tensors, and the run records both.

Why not vLLM's ``--load-format dummy``: it fills every parameter, the norms' too, with
U(-1e-3, 1e-3) (``initialize_dummy_weights``): the hidden states after each RMSNorm are ~1e-3,
the logits ~0, every next-token distribution almost uniform, and the answer does not depend on
the KV cache -- a D that decoded from corrupted KV answers what an intact one does, so the
oracle's controls (:mod:`lab.gpu.oracle`) cannot be caught (``tests/test_gpu_weights.py`` shows
it with vLLM's own initializer).  It also draws each engine's *own* parameter shapes (vLLM's
fused ``qkv_proj``, a TP rank's shard) from one seed, so a TP-1 P and a TP-2 D would not even
hold the same model.  The recipe here is the rig's (:mod:`lab.rig.model`) at full width:
linear weights N(0, gain^2 / fan-in), so activations stay O(1) at any width and depth; query
gain 3, so attention is sharp and an answer depends on which K/V are cached; lm_head gain 4, so
the logits spread (a near-tie between the first two tokens is rare: the oracle's drift
tolerance stays meaningful); norms 1; embeddings N(0, 1); Qwen2's q/k/v biases 0.

    python3 -m lab.gpu.weights llama3-8b-full --out /tmp/m --device cuda --max-len 17408
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECIPE = "full-v1"
"""Bumped whenever :func:`specs` or :func:`make` changes what a seed draws."""
SEED = 1234
SHARD_BYTES = 2 << 30
FINGERPRINT_BYTES = 4096
"""Bytes of each tensor's head and tail the fingerprint hashes (a whole-checkpoint digest of
16 GB would cost ~10 s of one CPU core; the head and tail of every tensor tell two seeds, two
recipes or two generators apart)."""

_LLAMA_COMMON = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                 "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "attention_bias": False, "mlp_bias": False}
FULL: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B's config.json (its RoPE without scaling: Llama 3, not 3.1)
    "llama3-8b-full": {**_LLAMA_COMMON, "hidden_size": 4096, "intermediate_size": 14336,
                       "num_hidden_layers": 32, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                       "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                       "rope_theta": 500000.0, "bos_token_id": 128000,
                       "eos_token_id": 128001},
    # Qwen/Qwen2.5-7B's config.json (no sliding window, as it ships)
    "qwen2.5-7b-full": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                        "hidden_act": "silu", "tie_word_embeddings": False,
                        "torch_dtype": "bfloat16", "hidden_size": 3584,
                        "intermediate_size": 18944, "num_hidden_layers": 28,
                        "num_attention_heads": 28, "num_key_value_heads": 4,
                        "vocab_size": 152064, "max_position_embeddings": 32768,
                        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                        "use_sliding_window": False, "sliding_window": None,
                        "max_window_layers": 28, "bos_token_id": 151643,
                        "eos_token_id": 151643},
    # deepseek-ai/DeepSeek-V2-Lite's attention and widths, every layer's MLP dense: the stage
    # carries none of vLLM's MoE kernels (``_moe_C``), and its dense width, 10944, is within 3 %
    # of the width a V2-Lite token runs through (6 routed + 2 shared experts of 1408 = 11264),
    # so the prefill FLOPs are the real model's; default RoPE in place of YaRN, as the narrow
    # geometry (the cache holds the latent, whatever the rotary scaling)
    "deepseek-v2-lite-full": {"model_type": "deepseek_v2",
                              "architectures": ["DeepseekV2ForCausalLM"],
                              "hidden_act": "silu", "tie_word_embeddings": False,
                              "torch_dtype": "bfloat16", "hidden_size": 2048,
                              "intermediate_size": 10944, "num_hidden_layers": 27,
                              "num_attention_heads": 16, "num_key_value_heads": 16,
                              "kv_lora_rank": 512, "q_lora_rank": None,
                              "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                              "v_head_dim": 128, "head_dim": 64, "vocab_size": 102400,
                              "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
                              "rope_theta": 10000.0, "n_routed_experts": 64,
                              "n_shared_experts": 2, "moe_intermediate_size": 1408,
                              "num_experts_per_tok": 6, "first_k_dense_replace": 27,
                              "moe_layer_freq": 1, "routed_scaling_factor": 1.0,
                              "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                              "scoring_func": "softmax", "norm_topk_prob": False,
                              "aux_loss_alpha": 0.001, "seq_aux": True,
                              "bos_token_id": 100000, "eos_token_id": 100001},
}
"""``--geometry`` names of the full-width models: their Hugging Face ``config.json``."""
NARROW_TWIN = {"llama3-8b-full": "llama3-8b", "qwen2.5-7b-full": "qwen2.5-7b",
               "deepseek-v2-lite-full": "deepseek-v2-lite"}
"""The narrow geometry with the same KV cache (layers, heads, latent): a request moves the
same bytes over NIXL in both."""


@dataclass(frozen=True)
class Spec:
    """One checkpoint tensor: its Hugging Face name, shape, and how it is drawn: ``lin``
    N(0, (gain / sqrt(fan-in))^2), ``embed`` N(0, 1), ``ones``, ``zeros``."""

    name: str
    shape: tuple[int, ...]
    kind: str
    gain: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _mlp_and_norms(p: str, h: int, inter: int) -> list[Spec]:
    return [Spec(p + "mlp.gate_proj.weight", (inter, h), "lin"),
            Spec(p + "mlp.up_proj.weight", (inter, h), "lin"),
            Spec(p + "mlp.down_proj.weight", (h, inter), "lin"),
            Spec(p + "input_layernorm.weight", (h,), "ones"),
            Spec(p + "post_attention_layernorm.weight", (h,), "ones")]


def _llama_like(cfg: dict[str, Any], bias: bool) -> list[Spec]:
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    out = [Spec("model.embed_tokens.weight", (vocab, h), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out += [Spec(a + "q_proj.weight", (nh * hd, h), "lin", 3.0),
                Spec(a + "k_proj.weight", (nkv * hd, h), "lin"),
                Spec(a + "v_proj.weight", (nkv * hd, h), "lin")]
        if bias:
            out += [Spec(a + "q_proj.bias", (nh * hd,), "zeros"),
                    Spec(a + "k_proj.bias", (nkv * hd,), "zeros"),
                    Spec(a + "v_proj.bias", (nkv * hd,), "zeros")]
        out.append(Spec(a + "o_proj.weight", (h, nh * hd), "lin"))
        out += _mlp_and_norms(p, h, inter)
    return [*out, Spec("model.norm.weight", (h,), "ones"),
            Spec("lm_head.weight", (vocab, h), "lin", 4.0)]


def _deepseek_v2(cfg: dict[str, Any]) -> list[Spec]:
    """MLA without q LoRA (V2-Lite's), dense MLPs only: the names vLLM's DeepseekV2 loads (the
    rig's recipe, :func:`lab.rig.model._deepseek_v2_weights`)."""
    if cfg.get("q_lora_rank") is not None:
        raise ValueError("the DeepSeek-V2 recipe writes q_proj only: q_lora_rank must be null")
    if cfg.get("n_routed_experts") and cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]:
        raise ValueError("the DeepSeek-V2 recipe writes dense MLPs only: first_k_dense_replace "
                         "must be >= num_hidden_layers")
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    out = [Spec("model.embed_tokens.weight", (vocab, h), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{i}.self_attn."
        out += [Spec(a + "q_proj.weight", (nh * (nope + rope), h), "lin", 3.0),
                Spec(a + "kv_a_proj_with_mqa.weight", (rank + rope, h), "lin"),
                Spec(a + "kv_a_layernorm.weight", (rank,), "ones"),
                Spec(a + "kv_b_proj.weight", (nh * (nope + v), rank), "lin"),
                Spec(a + "o_proj.weight", (h, nh * v), "lin")]
        out += _mlp_and_norms(f"model.layers.{i}.", h, inter)
    return [*out, Spec("model.norm.weight", (h,), "ones"),
            Spec("lm_head.weight", (vocab, h), "lin", 4.0)]


def specs(cfg: dict[str, Any]) -> list[Spec]:
    """Every tensor of ``cfg``'s checkpoint, in the order written."""
    (arch,) = cfg["architectures"]
    if arch == "LlamaForCausalLM":
        return _llama_like(cfg, bias=False)
    if arch == "Qwen2ForCausalLM":
        return _llama_like(cfg, bias=True)
    if arch == "DeepseekV2ForCausalLM":
        return _deepseek_v2(cfg)
    raise ValueError(f"no full-width recipe for {arch}")


def parameters(cfg: dict[str, Any]) -> int:
    return sum(s.numel for s in specs(cfg))


def checkpoint_bytes(cfg: dict[str, Any]) -> int:
    """The checkpoint's size in its dtype (bf16: 2 bytes a parameter)."""
    return 2 * parameters(cfg)


_NARROW = {"LlamaForCausalLM": {"hidden_size": 256, "num_attention_heads": 16},
           "Qwen2ForCausalLM": {"hidden_size": 1024, "num_attention_heads": 8},
           "DeepseekV2ForCausalLM": {"hidden_size": 256, "num_attention_heads": 4,
                                     "num_key_value_heads": 4}}
"""Per architecture, the narrow width: Llama keeps its 8 KV heads of 128 and a query group of
2 (its head size is in the config); Qwen2 derives its head size from hidden / heads, so 8
query heads of 128 over its 4 KV heads; MLA keeps its latent and head sizes, with 4 heads."""


def narrow(name: str, *, layers: int = 2, vocab: int = 512) -> dict[str, Any]:
    """``FULL[name]`` at a tiny width, for the CPU: the same architecture, KV and head sizes
    (for MLA, the latent), fewer layers and heads, a narrower hidden size, MLP and vocabulary.
    What the tests run the recipe's code path on."""
    cfg = dict(FULL[name])
    cfg.update(_NARROW[cfg["architectures"][0]], num_hidden_layers=layers, vocab_size=vocab,
               max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    cfg["intermediate_size"] = 2 * cfg["hidden_size"]
    for key in ("first_k_dense_replace", "max_window_layers"):
        if key in cfg:
            cfg[key] = layers
    return cfg


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name``: its own, so that neither the order tensors are
    drawn in nor the sharding changes what it holds."""
    digest = hashlib.sha256(f"{RECIPE}:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def make(spec: Spec, seed: int, device: str = "cpu", dtype: str = "bfloat16") -> Any:
    """Tensor ``spec`` drawn on ``device`` (float32, scaled, then ``dtype``)."""
    import torch

    dt = getattr(torch, dtype)
    if spec.kind == "ones":
        return torch.ones(spec.shape, dtype=dt, device=device)
    if spec.kind == "zeros":
        return torch.zeros(spec.shape, dtype=dt, device=device)
    g = torch.Generator(device=device).manual_seed(tensor_seed(seed, spec.name))
    x = torch.randn(spec.shape, generator=g, dtype=torch.float32, device=device)
    if spec.kind == "lin":
        x.mul_(spec.gain / math.sqrt(spec.shape[1]))
    elif spec.kind != "embed":
        raise ValueError(f"{spec.name}: unknown kind {spec.kind!r}")
    return x.to(dt)


def shards(all_specs: list[Spec], shard_bytes: int = SHARD_BYTES) -> list[list[Spec]]:
    """Consecutive tensors in shards of at most ``shard_bytes`` (a larger tensor alone)."""
    out: list[list[Spec]] = [[]]
    size = 0
    for s in all_specs:
        b = 2 * s.numel
        if out[-1] and size + b > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(s)
        size += b
    return out


def _fingerprint_update(h: Any, name: str, t: Any) -> None:
    raw = t.contiguous().view(-1).view(__import__("torch").uint8)
    h.update(name.encode() + b"\0")
    h.update(raw[:FINGERPRINT_BYTES].numpy().tobytes())
    h.update(raw[-FINGERPRINT_BYTES:].numpy().tobytes())


def manifest_of(dest: Path) -> dict[str, Any] | None:
    try:
        return json.loads((dest / "weights.json").read_text())
    except (OSError, ValueError):
        return None


def _config_key(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def write(dest: Path, cfg: dict[str, Any], *, seed: int = SEED, device: str = "cpu",
          shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """A Hugging Face checkpoint of ``cfg`` in ``dest`` (``config.json``, safetensors shards,
    their index, ``weights.json``), each tensor drawn on ``device``; kept where ``dest``
    already holds this config, seed, recipe and device's checkpoint.  Written into a temporary
    folder beside ``dest`` and renamed, so a stopped run leaves no half checkpoint.  Returns
    the manifest (``weights.json``)."""
    import torch
    from safetensors.torch import save_file

    key = _config_key(cfg)
    dev = torch.device(device)
    kind = dev.type
    have = manifest_of(dest)
    if have and (have.get("recipe"), have.get("seed"), have.get("config_key"),
                 have.get("generator")) == (RECIPE, seed, key, kind):
        return have
    t0 = time.time()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".weights-", dir=dest.parent))
    tmp.chmod(0o755)
    all_specs = specs(cfg)
    groups = shards(all_specs, shard_bytes)
    weight_map: dict[str, str] = {}
    fp = hashlib.sha256()
    with torch.no_grad():
        for i, group in enumerate(groups, 1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            out = {}
            for s in group:
                t = make(s, seed, device, cfg.get("torch_dtype", "bfloat16")).cpu()
                _fingerprint_update(fp, s.name, t)
                out[s.name] = t
                weight_map[s.name] = fname
            save_file(out, str(tmp / fname), metadata={"format": "pt"})
            del out
    total = sum(2 * s.numel for s in all_specs)
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    manifest = {"recipe": RECIPE, "seed": seed, "config_key": key, "generator": kind,
                "device": torch.cuda.get_device_name(dev) if kind == "cuda" else kind,
                "torch": torch.__version__, "architecture": cfg["architectures"][0],
                "parameters": parameters(cfg), "bytes": total, "shards": len(groups),
                "fingerprint": fp.hexdigest()[:32], "seconds": round(time.time() - t0, 1)}
    (tmp / "weights.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return manifest


def tensors(dest: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint in ``dest``, as written (the tests read it back)."""
    from safetensors import safe_open

    index = json.loads((dest / "model.safetensors.index.json").read_text())
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(dest / fname), "pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                yield k, f.get_tensor(k)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=sorted(FULL))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", help="where the tensors are drawn (cuda on "
                    "the device machine)")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--max-len", type=int, help="max_position_embeddings (the engines' "
                    "--max-model-len)")
    args = ap.parse_args(argv)
    cfg = dict(FULL[args.model])
    if args.max_len:
        cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], args.max_len)
    print(json.dumps(write(args.out, cfg, seed=args.seed, device=args.device), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
