"""Tiny random-weight models for engine tests (no downloads, built in milliseconds).

`make_tiny_llama` writes an MLX model folder (config.json + model.safetensors)
that `load_tiny_model` (mlx_lm.utils.load_model) reads back. There is no
tokenizer: engine tests work on token ids, and `mlx_lm.load` would insist on
tokenizer files, so load with `load_tiny_model` / `mlx_lm.utils.load_model`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY_LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}


def make_tiny_llama(path, seed: int = 0, **overrides) -> Path:
    """Write a random llama to `path` (created if missing) and return it.

    Weights are drawn from a seeded numpy generator, so the same seed gives the
    same model on every machine. The scales are chosen so that greedy decoding
    wanders over many tokens instead of locking onto one: unit-variance
    embeddings and a "hot" lm_head (std 1/sqrt(hidden) * 4) make the logits
    spread wide enough that each new token changes the argmax.
    """
    import mlx.core as mx

    config = {**TINY_LLAMA_CONFIG, **overrides}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // n_heads

    def linear(out_dim, in_dim, gain=1.0):
        w = rng.standard_normal((out_dim, in_dim)) * (gain / np.sqrt(in_dim))
        return mx.array(w.astype(np.float32))

    weights = {
        "model.embed_tokens.weight": mx.array(
            rng.standard_normal((vocab, hidden)).astype(np.float32)
        ),
        "model.norm.weight": mx.ones((hidden,)),
    }
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, hidden, gain=4.0)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "self_attn.q_proj.weight"] = linear(n_heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(n_kv * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(n_kv * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, n_heads * head_dim)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
        weights[p + "input_layernorm.weight"] = mx.ones((hidden,))
        weights[p + "post_attention_layernorm.weight"] = mx.ones((hidden,))

    dtype = config.pop("torch_dtype", None)
    if dtype is not None:
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
        config["torch_dtype"] = dtype

    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def load_tiny_model(path):
    """Load a folder written by `make_tiny_llama` (no tokenizer needed)."""
    from mlx_lm.utils import load_model

    model, _config = load_model(Path(path))
    return model
