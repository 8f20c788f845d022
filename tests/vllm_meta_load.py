"""vLLM's own model class loading a checkpoint the rig wrote, in a subprocess (it sets up vLLM's
process-wide parallel state): the class built on the meta device on the CPU, then its
``load_weights`` (whose loaders check shapes) fed every tensor of the checkpoint.  Used by
tests/test_gpu_rig.py (the tiny MLA model's ``model.safetensors``) and tests/test_gpu_weights.py
(the full-width models' shards and index, read back through ``lab.gpu.weights.tensors``).

``python tests/vllm_meta_load.py MODEL MODULE CLASS`` prints one JSON line: whether vLLM took
the model as MLA, its parameters' shapes, the names ``load_weights`` loaded and the shapes of the
checkpoint's tensors as written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def checkpoint(model: Path) -> list[tuple[str, Any]]:
    """Every tensor of the checkpoint in ``model``: its shards by its index, or its one file."""
    if (model / "model.safetensors.index.json").is_file():
        from lab.gpu import weights

        return list(weights.tensors(model))
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        return [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118 (safe_open is no mapping)


def load(model: str, module: str, cls: str) -> dict[str, Any]:
    """``cls`` of ``module`` built for ``model`` on the meta device and loaded from it."""
    import importlib
    import tempfile

    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    cfg = VllmConfig(model_config=ModelConfig(model=model, dtype="bfloat16", seed=0,
                                              skip_tokenizer_init=True, max_model_len=1024),
                     device_config=DeviceConfig("cpu"), cache_config=CacheConfig(block_size=16))
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"file://{tempfile.mktemp()}", 0, "gloo")
        initialize_model_parallel(1, 1)
        with torch.device("meta"):
            m = getattr(importlib.import_module(module), cls)(vllm_config=cfg)
        tensors = checkpoint(Path(model))
        loaded = m.load_weights(iter(tensors))
    return {"mla": cfg.model_config.use_mla,
            "params": {n: list(p.shape) for n, p in m.named_parameters()},
            "loaded": sorted(loaded),
            "shapes": {k: list(v.shape) for k, v in tensors}}


def run(model: Path, module: str, cls: str, cwd: Path) -> dict[str, Any]:
    """:func:`load` in a fresh interpreter on the CPU (``VLLM_TARGET_DEVICE=cpu``)."""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, __file__, str(model), module, cls], env=env,
                          capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(load(*sys.argv[1:4])))
