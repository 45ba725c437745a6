"""Checking a chunk runner against MLX: MLX's own prefill of the same tokens
in the contract's layout, a prompt run chunk by chunk through any runner (the
NumPy reference, a Core AI or Core ML program) with garbage wherever the
mask must not look, the differences a check prints, and greedy decode over
mlx-lm caches (after bridge.py's prefill or MLX's own).

Nothing here is Core AI-specific (the prefix only says which helper wrote it).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from workers.prefill.ane.bridge import head


def embed(model, tokens) -> np.ndarray:
    """The tokens' input embeddings (1, n, hidden) as float16, looked up in MLX."""
    ids = mx.array(np.asarray(tokens, dtype=np.int32))[None]
    return np.array(model.model.embed_tokens(ids).astype(mx.float32)).astype(np.float16)


def head_logits(model, row) -> np.ndarray:
    """MLX's head on one final-norm hidden row (hidden,): logits (vocab,) float32."""
    h = mx.array(np.asarray(row, dtype=np.float32))[None, None].astype(model.model.norm.weight.dtype)
    return np.array(head(model, h)[0, 0].astype(mx.float32))


def mlx_prefill(model, tokens, cache=None):
    """MLX's prefill of `tokens` over `cache` (mlx-lm caches, made when None):
    the new tokens' keys and values (L, KV, n, Dh) float32 (after rope), the
    final-norm hidden states (1, n, hidden) float32, and the cache."""
    cache = make_prompt_cache(model) if cache is None else cache
    start = cache[0].offset
    h = model.model(mx.array(np.asarray(tokens, dtype=np.int32))[None], cache=cache)
    mx.eval(h, [c.state for c in cache])
    end = cache[0].offset
    keys = np.stack([np.array(c.keys[0, :, start:end].astype(mx.float32)) for c in cache])
    values = np.stack([np.array(c.values[0, :, start:end].astype(mx.float32)) for c in cache])
    return keys, values, np.array(h.astype(mx.float32)), cache


def chunked_prefill(run, model, tokens, config, bucket, garbage: float = 0.0):
    """`tokens` through `run(x, pos, k_cache, v_cache) -> (k_new, v_new, h)`
    one chunk of bucket.chunk at a time, each padded to Q, over a contract
    cache of bucket.cache slots that collects the real rows' KV. Slots not yet
    written and padded rows hold `garbage` * N(0, 1), so a mask that leaks
    shows. Returns keys, values (L, KV, n, Dh) float16 and h (n, hidden)."""
    tokens = np.asarray(tokens)
    n, q, s = len(tokens), bucket.chunk, bucket.cache
    if n > s:
        raise ValueError(f"{n} tokens do not fit a cache of {s}")
    rng = np.random.default_rng(0)
    shape = (config.layers, config.kv_heads, s, config.head_dim)
    k_cache = (rng.standard_normal(shape) * garbage).astype(np.float16)
    v_cache = (rng.standard_normal(shape) * garbage).astype(np.float16)
    rows = []
    for start in range(0, n, q):
        real = min(q, n - start)
        x = (rng.standard_normal((1, q, config.hidden)) * garbage).astype(np.float16)
        x[:, :real] = embed(model, tokens[start:start + real])
        k_new, v_new, h = run(x, np.array([start], np.int32), k_cache, v_cache)
        k_cache[:, :, start:start + real] = k_new[:, :, :real]
        v_cache[:, :, start:start + real] = v_new[:, :, :real]
        rows.append(np.asarray(h[0, :real], dtype=np.float32))
    return k_cache[:, :, :n].copy(), v_cache[:, :, :n].copy(), np.concatenate(rows)


def relative(ours, theirs) -> float:
    """max |ours - theirs| / max |theirs|: the error in units of the tensor's
    own scale (one float16 rounding is at most 2^-11 ~ 4.9e-4 of that)."""
    theirs = np.asarray(theirs, dtype=np.float32)
    return float(np.abs(np.asarray(ours, dtype=np.float32) - theirs).max() / max(np.abs(theirs).max(), 1e-30))


def prefill_differences(run, model, tokens, config, bucket, garbage: float = 0.0) -> dict:
    """A chunked prefill through `run` against MLX's prefill of the same
    tokens: `relative` errors of keys, values and hidden states over the first
    chunk's rows (pos = 0) and over the rest (pos > 0), of the last row's
    logits through MLX's head, and whether both pick the same greedy token."""
    keys, values, h = chunked_prefill(run, model, tokens, config, bucket, garbage)
    mk, mv, mh, _ = mlx_prefill(model, tokens)
    out = {}
    for part, rows in (("first", slice(0, bucket.chunk)), ("rest", slice(bucket.chunk, None))):
        if len(tokens) > rows.start:
            out[f"k_{part}"] = relative(keys[:, :, rows], mk[:, :, rows])
            out[f"v_{part}"] = relative(values[:, :, rows], mv[:, :, rows])
            out[f"h_{part}"] = relative(h[rows], mh[0, rows])
    ours, theirs = head_logits(model, h[-1]), head_logits(model, mh[0, -1])
    out["logits"] = relative(ours, theirs)
    out["same_token"] = bool(ours.argmax() == theirs.argmax())
    return out


def greedy_decode(model, cache, first_token: int, steps: int) -> list[int]:
    """`steps` greedy tokens after `first_token` (chosen, not yet in `cache`),
    each fed back through `model` over `cache`: [first_token, ...]."""
    tokens = [int(first_token)]
    for _ in range(steps):
        logits = model(mx.array([[tokens[-1]]], dtype=mx.int32), cache=cache)
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return tokens
