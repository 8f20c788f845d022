"""The report's names for the full-width models (``--geometry *-full``, :mod:`lab.gpu.weights`):
the real model's architecture at its full width, seeded weights drawn on the GPU, so a prefill
costs what the real model's does -- unlike the narrow geometries (hidden 256), whose TTFT
ratios overstate what a deployment sees."""

from __future__ import annotations

from lab.gpu import weights

NAMED = {"llama3-8b-full": ("Llama-3-8B, full width", "Llama-3-8B's"),
         "qwen2.5-7b-full": ("Qwen2.5-7B, full width", "Qwen2.5-7B's"),
         "deepseek-v2-lite-full": ("DeepSeek-V2-Lite, full width", "DeepSeek-V2-Lite's")}
"""Per full-width ``--geometry``: the tables' short name, and whose architecture it has (the
shape of :data:`lab.report.tables.NAMED`)."""


def model(geometry: str) -> str:
    """The model as it was, for the report's model table."""
    cfg = weights.FULL[geometry]
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:
        attn = (f"{cfg['num_attention_heads']} heads over a {cfg['kv_lora_rank']} + "
                f"{cfg['qk_rope_head_dim']} MLA latent, every MLP dense "
                f"({cfg['intermediate_size']:,})")
    else:
        hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
        attn = (f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads "
                f"of {hd}, MLP {cfg['intermediate_size']:,}")
    return (f"{NAMED[geometry][1]} architecture at full width (hidden {h:,}, {layers} layers, "
            f"{attn}, vocabulary {cfg['vocab_size']:,}), seeded weights drawn on the GPU "
            "(`lab/gpu/weights.py`): a prefill costs what the real model's does")
