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
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from lab.env import cache_dir

#: The shipped config directory.
TINY_LLAMA_DIR = Path(__file__).with_name("tiny_llama")
WEIGHTS_SEED = 1234
#: Bumped whenever the weight recipe below changes, so cached model dirs are regenerated.
_RECIPE = "v1"


def tiny_config() -> dict[str, Any]:
    return json.loads((TINY_LLAMA_DIR / "config.json").read_text())


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """Llama weights in HF naming, scaled so activations stay O(1) and logits spread out."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    dtype = getattr(torch, cfg.get("torch_dtype", "bfloat16"))

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        # q gain 3: sharper attention, so outputs depend strongly on which K/V are cached.
        w[p + "self_attn.q_proj.weight"] = lin(nh * hd, h, 3.0)
        w[p + "self_attn.k_proj.weight"] = lin(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = lin(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, nh * hd)
        w[p + "mlp.gate_proj.weight"] = lin(inter, h)
        w[p + "mlp.up_proj.weight"] = lin(inter, h)
        w[p + "mlp.down_proj.weight"] = lin(h, inter)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = lin(vocab, h, 4.0)
    return {k: v.to(dtype).contiguous() for k, v in w.items()}


def model_dir(dest: Path | None = None, *, seed: int = WEIGHTS_SEED, **overrides: Any) -> Path:
    """Return a model dir (config.json + model.safetensors) for the tiny Llama.

    ``overrides`` change the config, e.g. ``num_hidden_layers=3`` for a deliberately
    incompatible D engine.  Without ``dest`` the dir is cached under ``~/.cache/pdpatch`` keyed
    by config + seed + recipe; creation is atomic (temp dir + rename), so concurrent callers
    are safe.
    """
    cfg = tiny_config()
    cfg.update(overrides)
    blob = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    if dest is None:
        key = hashlib.sha256(f"{blob}{seed}{_RECIPE}".encode()).hexdigest()[:12]
        cache = cache_dir()
        dest = cache / f"tiny_llama-{key}"
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
