"""What the Neural Engine prefill's tests share: tiny random models of the
variants the chunk contract covers, and MLX with the weights rounded to
float16 (so it computes what an fp16 program computes)."""

from __future__ import annotations

import contextlib

import mlx.core as mx
from mlx.utils import tree_map

from tests.support.tiny_models import TINY_LLAMA_CONFIG, load_tiny_model, make_tiny_llama, make_tiny_model


@contextlib.contextmanager
def fp16_weights(model):
    """The model's parameters rounded to float16 (kept in their dtype) for the
    block, restored after: MLX then computes what the fp16 program computes."""
    original = model.parameters()
    model.update(tree_map(lambda a: a.astype(mx.float16).astype(a.dtype), original))
    try:
        yield model
    finally:
        model.update(original)


TINY_VARIANTS = {
    "qwen3": {"model_type": "qwen3", "head_dim": 16},  # q/k norms
    "llama_bias": {"attention_bias": True},  # q/k/v and o_proj biases
}


def tiny(path, variant: str):
    """A tiny random model: "llama", or one of TINY_VARIANTS."""
    if variant == "llama":
        return load_tiny_model(make_tiny_llama(path, seed=0))
    return load_tiny_model(make_tiny_model(path, {**TINY_LLAMA_CONFIG, **TINY_VARIANTS[variant]}))
