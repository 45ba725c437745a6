"""Prefill attention on MLX's CUDA backend without a cuDNN graph per shape.

MLX's CUDA backend runs a prompt's attention through cuDNN, and cuDNN
builds a graph for every new (query, key) shape: ~50 ms on an H100, cached
per shape. A prefill after a cached prefix has a new shape almost every
time (its new tokens over its whole length): a swarm agent's next turn, a
follow-up question about a picture. The same attention as plain MLX ops
(the ones `mx.fast.scaled_dot_product_attention` falls back to where no
fused kernel applies: scaled scores, causal mask, softmax, values) costs no
graph and, for the short queries of such prefills, no more than the kernel.
Unlike that fallback, the scores and the softmax stay in float32 for half-
precision inputs, as in a fused kernel (rounding scores of ~10 to bfloat16
would move the attention weights by several percent); the weights are
rounded to the values' dtype for their product, as a flash kernel does.
Long queries over long contexts keep cuDNN: the scores this materialises
grow with their product.
"""

from __future__ import annotations

import mlx.core as mx

# Largest score tensor (batch x query heads x queries x keys) computed here:
# 2^25 float32 scores, 128 MiB (and as much for the softmax's weights).
MAX_SCORES = 1 << 25


def attention(queries, keys, values, scale: float, mask, starts: mx.array | None = None):
    """`mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
    mask=mask)` for several queries under a causal mask or none, its scores
    in float32 (for float32 inputs: exactly MLX's fallback); None when the
    fused kernel should serve (one query: MLX's vector kernel needs no graph;
    an array mask; a large score tensor). `starts` (one per row, with a
    causal mask): row b's keys before starts[b] are hidden, the mask mlx-lm's
    left-padded BatchKVCache makes (a batch of prompts: workers/prefill/batch.py)."""
    if not (mask is None or (isinstance(mask, str) and mask == "causal")) or (starts is not None and mask is None):
        return None
    b, n_q, length, dim = queries.shape
    n_kv, total = keys.shape[1], keys.shape[2]
    if length == 1 or b * n_q * length * total > MAX_SCORES or n_q % n_kv:
        return None
    q = queries.astype(mx.float32) * mx.array(scale, mx.float32)
    k, v = keys.astype(mx.float32), values
    rep = n_q // n_kv
    if rep > 1:
        q = q.reshape(b, n_kv, rep, length, dim)
        k, v = mx.expand_dims(k, 2), mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if mask == "causal":
        offset = total - length
        positions = mx.arange(total)
        visible = mx.arange(offset, offset + length)[:, None] >= positions[None]
        if starts is not None:  # (B, 1, [1,] N, L) against the scores' (B, heads, [rep,] N, L)
            visible = visible & (positions >= starts.reshape(b, *([1] * (scores.ndim - 1))))
        scores = mx.where(visible, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    out = mx.softmax(scores, axis=-1).astype(v.dtype) @ v
    return out.reshape(b, n_q, length, v.shape[-1]) if rep > 1 else out
