"""An mlx-lm model's transformer body in the converted program's layout:
float16 NumPy arrays as MLX holds them (Linear weights (out, in)), the
architecture's numbers, and the rope tables as MLX itself computes them
(probed through the model's own rope module, so every scaling mlx-lm knows,
llama3's included, and the traditional (interleaved) layout come out right).

Supported: the llama family as mlx-lm implements it (llama, qwen2 with q/k/v
biases, qwen3 with q/k norms, mistral): pre-norm blocks of GQA attention and
a SwiGLU MLP. Anything else raises UnsupportedModel naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np


class UnsupportedModel(ValueError):
    """This architecture cannot be converted (the message says what is missing)."""


@dataclass
class BodyConfig:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float
    qk_norm: bool  # per-head RMSNorm of q and k before rope (qwen3)
    qkv_bias: bool  # q/k/v projections with biases (qwen2)
    rope_traditional: bool  # rotate interleaved pairs (x0, x1), not halves


@dataclass
class BodyWeights:
    config: BodyConfig
    # One dict per layer: attn_norm, wq, wk, wv, wo, [bq, bk, bv], [bo], [q_norm, k_norm],
    # mlp_norm, w_gate, w_up, w_down; all float16.
    layers: list = field(default_factory=list)
    final_norm: np.ndarray | None = None
    rope_cos: np.ndarray | None = None  # (positions, head_dim // 2) float32
    rope_sin: np.ndarray | None = None


def _array(x) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float16)


def _linear(layer) -> np.ndarray:
    """A Linear's weight (out, in), dequantized when it is a QuantizedLinear."""
    if hasattr(layer, "scales"):
        w = mx.dequantize(layer.weight, layer.scales, getattr(layer, "biases", None), layer.group_size, layer.bits)
        return _array(w)
    return _array(layer.weight)


def rope_tables(rope, head_dim: int, positions: int, traditional: bool) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (positions, head_dim // 2) of `rope` (an mlx-lm rope module),
    read off by rotating unit vectors: x = (1, 0) in every pair gives (cos, sin)."""
    half = head_dim // 2
    x = np.zeros((1, 1, positions, head_dim), np.float32)
    if traditional:
        x[..., 0::2] = 1.0
    else:
        x[..., :half] = 1.0
    out = np.array(rope(mx.array(x)).astype(mx.float32))[0, 0]
    if traditional:
        return out[:, 0::2].copy(), out[:, 1::2].copy()
    return out[:, :half].copy(), out[:, half:].copy()


def body_config(model) -> BodyConfig:
    """The architecture's numbers, read without touching the weights (a
    quantized Linear's output rows are its weight's rows all the same);
    UnsupportedModel when it is not the llama family."""
    inner = getattr(model, "model", None)
    blocks = getattr(inner, "layers", None)
    if not blocks:
        raise UnsupportedModel(f"{type(model).__module__}: no model.layers")
    attn0 = getattr(blocks[0], "self_attn", None)
    mlp0 = getattr(blocks[0], "mlp", None)
    for name, part in (("self_attn", attn0), ("mlp", mlp0)):
        if part is None:
            raise UnsupportedModel(f"{type(model).__module__}: layers have no {name}")
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "rope"):
        if not hasattr(attn0, name):
            raise UnsupportedModel(f"{type(model).__module__}: attention has no {name}")
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not hasattr(mlp0, name):
            raise UnsupportedModel(f"{type(model).__module__}: MLP has no {name} (not SwiGLU)")
    heads, kv_heads = attn0.n_heads, attn0.n_kv_heads
    return BodyConfig(layers=len(blocks), hidden=inner.norm.weight.shape[0], heads=heads, kv_heads=kv_heads,
                      head_dim=attn0.k_proj.weight.shape[0] // kv_heads, intermediate=mlp0.gate_proj.weight.shape[0],
                      rms_eps=float(blocks[0].input_layernorm.eps), qk_norm=hasattr(attn0, "q_norm"),
                      qkv_bias="bias" in attn0.q_proj, rope_traditional=bool(getattr(attn0.rope, "traditional", False)))


def body_weights(model, positions: int) -> BodyWeights:
    """The body of `model` (an mlx-lm model) with rope tables for `positions`."""
    cfg = body_config(model)
    out = BodyWeights(cfg)
    inner = model.model
    blocks, attn0 = inner.layers, inner.layers[0].self_attn
    traditional = cfg.rope_traditional
    for block in blocks:
        a, m = block.self_attn, block.mlp
        layer = {"attn_norm": _array(block.input_layernorm.weight), "wq": _linear(a.q_proj), "wk": _linear(a.k_proj),
                 "wv": _linear(a.v_proj), "wo": _linear(a.o_proj),
                 "mlp_norm": _array(block.post_attention_layernorm.weight), "w_gate": _linear(m.gate_proj),
                 "w_up": _linear(m.up_proj), "w_down": _linear(m.down_proj)}
        if cfg.qkv_bias:
            layer.update(bq=_array(a.q_proj.bias), bk=_array(a.k_proj.bias), bv=_array(a.v_proj.bias))
        if "bias" in a.o_proj:  # llama with attention_bias
            layer["bo"] = _array(a.o_proj.bias)
        if cfg.qk_norm:
            layer.update(q_norm=_array(a.q_norm.weight), k_norm=_array(a.k_norm.weight))
        out.layers.append(layer)
    out.final_norm = _array(inner.norm.weight)
    out.rope_cos, out.rope_sin = rope_tables(attn0.rope, cfg.head_dim, positions, traditional)
    return out
