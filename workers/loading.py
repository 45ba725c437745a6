"""Load a model folder for inference on whatever device MLX runs on.

On MLX's CPU backend quantized matmuls are far slower than float32 matmuls
through BLAS, so quantized layers are expanded to float32 at load; on a GPU
(Metal or CUDA) they stay quantized, which is both smaller and faster there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from workers.model_store import ModelError


def on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def load_model(folder: str | os.PathLike, dequantize: bool | None = None):
    """(model, tokenizer) for an MLX model folder, via mlx_lm.load.
    `dequantize` defaults to "only on the CPU backend"."""
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    folder = Path(folder)
    try:
        model, tokenizer = load(str(folder))
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ModelError(f"{folder}: cannot load model ({_one_line(e)})") from None
    if on_cpu() if dequantize is None else dequantize:
        if any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules()):
            # Scales first, so the expansion itself runs in float32 and the
            # weights are not rounded through float16 on the way.
            model.set_dtype(mx.float32)
            model = dequantize_model(model)
        model.set_dtype(mx.float32)  # float16 checkpoints too: no fast fp16 BLAS
        mx.eval(model.parameters())
    return model, tokenizer


def context_length(folder: str | os.PathLike) -> int | None:
    """The model's trained context (max_position_embeddings), if it says."""
    with open(Path(folder) / "config.json") as f:
        cfg = json.load(f)
    n = cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
    return int(n) if n else None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
