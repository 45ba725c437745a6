"""Attention for MLX's CPU backend, where the softmax's exponential is the bottleneck.

On the x86 CPU backend `mx.exp` runs ~70 M values/s (scalar): for a warm
request (62 new tokens over 926 cached ones) `mx.fast.scaled_dot_product_attention`
spent ~0.3 s of its ~0.33 s in exp across 30 layers. Here:
  * the query heads that share a KV head form one (repeats·N x D) @ (D x L)
    product per KV head, in MLX (its BLAS), instead of a broadcast per head;
  * a prompt's softmax (N > 1, at least NUMPY_MIN_SCORES scores) runs in
    numpy, whose float32 exp is vectorised (AVX2/AVX-512, NEON): ~2 G values/s
    here against ~0.3 G for workers/kernels/cpu_math.py's polynomial in MLX ops, and
    its max and sum ~5x faster than MLX's. It costs a wait for each layer's
    scores, nothing on a CPU where nothing else runs alongside; 512 new tokens
    over 864 cached, whole forward pass: 2.9 -> 1.6 s. The matrix products
    stay in MLX: numpy's own BLAS threads next to MLX's made the forward 2x
    slower;
  * other softmaxes (decode's one query, small prompts) use the polynomial
    (`softmax_weights`), as RaggedKVCache's decode batches do.
Only masks of the plain kinds are handled (none, or "causal" aligned to the
end of the keys); anything else (arrays, sinks, windows) returns None and the
caller uses mlx-lm's own attention. A Mac's GPU never comes here.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from workers.kernels.cpu_math import exp_shifted


def softmax_weights(scores: mx.array) -> tuple[mx.array, mx.array]:
    """The softmax over the last axis before normalisation: e^(s - max) (-inf
    scores get exactly 0) and its sums. Callers divide after multiplying by
    V, which divides D values per row instead of L."""
    e = exp_shifted(scores, mx.stop_gradient(scores.max(axis=-1, keepdims=True)))
    return e, e.sum(axis=-1, keepdims=True)


@functools.lru_cache(maxsize=8)
def _causal_bias(n: int, length: int) -> np.ndarray:
    """0 where the last n of `length` positions may look, -inf after: the
    same for every layer of a forward pass, so built once per shape."""
    rows = np.arange(length - n, length)[:, None]
    bias = np.where(rows >= np.arange(length)[None], np.float32(0.0), np.float32(-np.inf))
    bias.flags.writeable = False
    return bias


@functools.lru_cache(maxsize=8)
def _causal_bias_mx(n: int, length: int) -> mx.array:
    return mx.array(_causal_bias(n, length))


def _start_bias(starts: np.ndarray, length: int) -> np.ndarray:
    """(B, 1, 1, L): -inf before each row's first key (its left padding), 0 from it."""
    keep = np.arange(length)[None] >= starts.reshape(-1, 1)
    return np.where(keep, np.float32(0.0), np.float32(-np.inf))[:, None, None, :]


# Below this many scores a prompt's softmax stays in MLX ops: numpy's exp needs
# the scores evaluated first, a wait (~0.1 ms a layer) worth more than the exp saves.
NUMPY_MIN_SCORES = 1 << 16


def attention(queries, keys, values, scale: float, mask, starts: mx.array | None = None) -> mx.array | None:
    """softmax(q k^T * scale) v for (B, H, N, D) queries over (B, Hkv, L, D)
    keys and values; None when `mask` is not None or "causal",
    or the dtype is not float32 (the caller then uses its own attention).
    `starts` (one per row, with a causal mask): row b's keys before
    starts[b] are hidden, as in mlx-lm's left-padded BatchKVCache."""
    if (not (mask is None or (isinstance(mask, str) and mask == "causal")) or queries.dtype != mx.float32
            or (starts is not None and mask is None)):
        return None
    b, n_heads, n, d = queries.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    rep = n_heads // n_kv
    q = (queries * scale).reshape(b, n_kv, rep * n, d)
    scores = q @ keys.swapaxes(-1, -2)  # (B, Hkv, rep*N, L)
    causal = n > 1 and mask is not None
    if n == 1 or scores.size < NUMPY_MIN_SCORES:
        if causal:
            scores = (scores.reshape(b, n_kv, rep, n, length) + _causal_bias_mx(n, length)).reshape(scores.shape)
        if starts is not None:
            scores = scores + mx.array(_start_bias(np.asarray(starts), length))
        e, total = softmax_weights(scores)
        return ((e @ values) / total).reshape(b, n_heads, n, values.shape[-1])
    mx.eval(scores)
    s = np.asarray(scores)  # MLX's buffer, not copied
    if causal:
        e = (s.reshape(b, n_kv, rep, n, length) + _causal_bias(n, length)).reshape(s.shape)
        if starts is not None:
            e += _start_bias(np.asarray(starts), length)
        e -= e.max(axis=-1, keepdims=True)
    else:
        e = s - s.max(axis=-1, keepdims=True)
    np.exp(e, out=e)  # masked: e^-inf = 0 exactly
    total = mx.array(e.sum(axis=-1, keepdims=True))
    return ((mx.array(e) @ values) / total).reshape(b, n_heads, n, values.shape[-1])
