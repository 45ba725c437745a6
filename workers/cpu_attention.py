"""Attention for MLX's CPU backend, where the softmax's exponential is the bottleneck.

On the x86 CPU backend `mx.exp` runs ~70 M values/s (scalar), while plain
arithmetic runs at billions: for a warm request (62 new tokens over 926 cached
ones) `mx.fast.scaled_dot_product_attention` spends ~0.3 s of its ~0.33 s in
exp across 30 layers, more than the rest of the prefill. Here the softmax
uses workers/cpu_math.py's exponential (within ~2 ulps of `mx.exp`, ~8x
faster). The query heads that share a KV head form one (repeats·N x D) @
(D x L) product per KV head instead of a broadcast per query head (~1.5x on
this CPU).

Only masks of the plain kinds are handled (none, or "causal" aligned to the
end of the keys); anything else (arrays, sinks, windows) returns None and the
caller uses mlx-lm's own attention. A Mac's GPU never comes here.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from workers.cpu_math import exp_shifted


def softmax_weights(scores: mx.array) -> tuple[mx.array, mx.array]:
    """The softmax over the last axis before normalisation: e^(s - max) (-inf
    scores get exactly 0) and its sums. Callers divide after multiplying by
    V, which divides D values per row instead of L."""
    e = exp_shifted(scores, mx.stop_gradient(scores.max(axis=-1, keepdims=True)))
    return e, e.sum(axis=-1, keepdims=True)


@functools.lru_cache(maxsize=8)
def _causal_bias(n: int, length: int) -> mx.array:
    """0 where the last n of `length` positions may look, -inf after: the
    same for every layer of a forward pass, so built once per shape."""
    rows = mx.arange(length - n, length)[:, None]
    bias = mx.where(rows >= mx.arange(length)[None], 0.0, -mx.inf).astype(mx.float32)
    mx.eval(bias)
    return bias


def attention(queries, keys, values, scale: float, mask) -> mx.array | None:
    """softmax(q k^T * scale) v for (B, H, N, D) queries over (B, Hkv, L, D)
    keys and values; None when `mask` is not None or "causal", or the dtype
    is not float32 (the caller then uses its own attention)."""
    if not (mask is None or (isinstance(mask, str) and mask == "causal")) or queries.dtype != mx.float32:
        return None
    b, n_heads, n, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    rep = n_heads // n_kv
    q = (queries * scale).reshape(b, n_kv, rep * n, d)
    scores = q @ keys.swapaxes(-1, -2)  # (B, Hkv, rep*N, L)
    if mask is not None and n > 1:
        scores = (scores.reshape(b, n_kv, rep, n, length) + _causal_bias(n, length)).reshape(b, n_kv, rep * n, length)
    e, total = softmax_weights(scores)
    return ((e @ values) / total).reshape(b, n_heads, n, values.shape[-1])
