"""Tiny random-weight models for engine tests (no downloads, built in milliseconds).

`make_tiny_llama` writes an MLX model folder (config.json + model.safetensors)
that `load_tiny_model` (mlx_lm.utils.load_model) reads back. There is no
tokenizer: engine tests work on token ids, and `mlx_lm.load` would insist on
tokenizer files, so load with `load_tiny_model` / `mlx_lm.utils.load_model`.

Models whose caches are not plain KV: `make_tiny_gemma3` (gemma3_text: sliding
window layers with a RotatingKVCache between global KVCache layers) and
`make_tiny_qwen3_next` (Gated DeltaNet layers with an ArraysCache between
attention layers). Both go through `make_tiny_model`, which builds mlx-lm's
own module for any config and draws its weights from a seeded generator.

Runs on them: `prompt_of` (seeded token ids), `greedy` (sampling settings),
`reference` (mlx-lm's own greedy tokens, what every split run must equal) and
`Counting` (a model that counts the positions it is run over). The pytest
fixtures `tiny_dir` and `model` (one tiny llama per test module) are in
tests/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from protos.messages import SamplingParams

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


VOCAB = TINY_LLAMA_CONFIG["vocab_size"]


def prompt_of(length: int, seed: int) -> list[int]:
    """`length` token ids drawn from the tiny vocabulary with `seed`."""
    return np.random.default_rng(seed).integers(0, VOCAB, length).tolist()


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def reference(model, prompt, max_tokens) -> list[int]:
    """mlx-lm's own greedy tokens for `prompt` (no cache, no split)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(tok) for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)]


class Counting:
    """The model, counting the token positions it is run over."""

    def __init__(self, model):
        self.model = model
        self.tokens = 0

    def __call__(self, inputs, *args, **kwargs):
        self.tokens += inputs.size
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


# Gemma 3 text: layers 0 and 2 slide over an 8-token window (RotatingKVCache),
# 1 and 3 attend globally (KVCache); prompts of 20+ tokens wrap the window.
TINY_GEMMA3_CONFIG = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_local_base_freq": 10000.0,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "max_position_embeddings": 2048,
}

# Qwen3-Next: layers 0 and 2 are Gated DeltaNet (ArraysCache: conv + recurrent
# state), 1 and 3 gated attention (KVCache); dense MLPs (no experts).
TINY_QWEN3_NEXT_CONFIG = {
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 0,
    "num_experts_per_tok": 1,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 128,
    "mlp_only_layers": [],
    "moe_intermediate_size": 64,
    "full_attention_interval": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def make_tiny_model(path, config: dict, seed: int = 0) -> Path:
    """Write mlx-lm's model for `config` with seeded random weights to `path`.

    Every matrix (2-D and up) is drawn like make_tiny_llama's: N(0, 1/fan_in),
    the embedding N(0, 1), lm_head "hot" (x4) so greedy decoding wanders.
    Vectors keep the module's own initial values (norm scales; Qwen3-Next's
    decay rates are drawn from MLX's generator, seeded here). Saved exactly as the module names its parameters,
    so mlx-lm's loader (whose sanitize leaves such weights alone) reads them
    back strictly.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if p.ndim < 2:
            weights[name] = p
            continue
        fan_in = int(np.prod(p.shape[1:]))
        if name.endswith("embed_tokens.weight"):
            w = rng.standard_normal(p.shape)
        else:
            gain = 4.0 if name == "lm_head.weight" else 1.0
            w = rng.standard_normal(p.shape) * (gain / np.sqrt(fan_in))
        weights[name] = mx.array(w.astype(np.float32))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def make_tiny_gemma3(path, seed: int = 0, **overrides) -> Path:
    return make_tiny_model(path, {**TINY_GEMMA3_CONFIG, **overrides}, seed)


def make_tiny_qwen3_next(path, seed: int = 0, **overrides) -> Path:
    return make_tiny_model(path, {**TINY_QWEN3_NEXT_CONFIG, **overrides}, seed)
