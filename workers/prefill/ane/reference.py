"""The chunk program of contract.py in NumPy: the independent check of the
layout every converted program (Core ML, Core AI) must reproduce.

`run_chunk(weights, x, pos, k_cache, v_cache)` computes one chunk of Q rows
over a cache of S slots from a BodyWeights (weights.py) and returns
(k_new, v_new, h) in the contract's shapes; `ReferenceRunner(weights)` is the
same as a chunk runner that widens the weights once. Three precisions:
- "fp32": every op in float32 from the fp16 weights: what the program means;
- "fp16": every intermediate rounded to float16, dot products accumulated in
  float32 and then rounded (a Neural Engine with wide accumulators);
- "fp16acc": the same, but every dot product accumulated in float16 one term
  at a time, each product and each partial sum rounded: what coreai-core's
  Linux CPU runtime does for a float16 batch_matmul (measured: the same error,
  to the bit, on a (16, 1536) @ (1536, 576) product); the worst case for the
  Neural Engine.
Norm statistics (mean of squares) stay in float32 in all three (x^2
overflows float16 once an activation passes 256), as in coreai_program.py.
"""

from __future__ import annotations

import numpy as np

from workers.prefill.ane.weights import BodyWeights

PRECISIONS = ("fp32", "fp16", "fp16acc")


def _matmul_fp16_accumulated(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (..., M, K) @ b (..., K, N) summed term by term in float16."""
    a16, b16 = a.astype(np.float16), b.astype(np.float16)
    acc = np.zeros(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1]), np.float16)
    for k in range(a.shape[-1]):
        acc += a16[..., :, k:k + 1] * b16[..., k:k + 1, :]
    return acc.astype(np.float32)


class _Arithmetic:
    """How a precision rounds (`r`) and multiplies matrices (`mm`)."""

    def __init__(self, precision: str):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
        self.precision = precision

    def r(self, a: np.ndarray) -> np.ndarray:
        return a if self.precision == "fp32" else a.astype(np.float16).astype(np.float32)

    def mm(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.precision == "fp16acc":
            return _matmul_fp16_accumulated(a, b)
        return self.r(a @ b)

    def linear(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x (rows, in) @ weight.T for weight (out, in); in float32 as
        weight @ x.T, so that BLAS reads the matrix in place."""
        if self.precision == "fp16acc":
            return _matmul_fp16_accumulated(x, weight.T)
        return self.r((weight @ x.T).T)


def _f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """MLX's RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    x = _f32(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * _f32(weight)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, traditional: bool) -> np.ndarray:
    """Rotate x (..., rows, Dh) by cos/sin (rows, Dh/2): interleaved pairs
    (x0, x1) when traditional, else the halves (x[:Dh/2], x[Dh/2:])."""
    if traditional:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if traditional:
        return np.stack([ra, rb], axis=-1).reshape(x.shape)
    return np.concatenate([ra, rb], axis=-1)


def attention_mask(pos: int, chunk: int, cache: int) -> np.ndarray:
    """(Q, S + Q) bool: chunk row i sees cache slots j < pos and chunk rows <= i."""
    slots = np.broadcast_to(np.arange(cache) < pos, (chunk, cache))
    causal = np.tril(np.ones((chunk, chunk), dtype=bool))
    return np.concatenate([slots, causal], axis=1)


def _heads(x: np.ndarray, heads: int, head_dim: int) -> np.ndarray:
    """(Q, heads * Dh) -> (heads, Q, Dh)."""
    return x.reshape(x.shape[0], heads, head_dim).transpose(1, 0, 2)


def _attention(q, keys, values, mask, kv_heads: int, ar: _Arithmetic) -> np.ndarray:
    """q (H, Q, Dh) over keys/values (KV, S+Q, Dh): query head h reads kv head
    h // (H // KV), as MLX groups them. Returns (Q, H * Dh)."""
    heads, chunk, head_dim = q.shape
    grouped = ar.r(q * np.float32(head_dim ** -0.5)).reshape(kv_heads, heads // kv_heads * chunk, head_dim)
    scores = ar.mm(grouped, keys.transpose(0, 2, 1))
    scores = scores.reshape(kv_heads, heads // kv_heads, chunk, -1)
    scores = np.where(mask, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = ar.r(probs / probs.sum(axis=-1, keepdims=True))
    out = ar.mm(probs.reshape(kv_heads, heads // kv_heads * chunk, -1), values)
    return out.reshape(heads, chunk, head_dim).transpose(1, 0, 2).reshape(chunk, heads * head_dim)


def _layer(w: dict, x, cos, sin, cached_k, cached_v, mask, cfg, ar: _Arithmetic):
    """One block over x (Q, hidden), its weights `w` in float32: returns
    (x out, k (KV, Q, Dh), v (KV, Q, Dh))."""
    r = ar.r
    xn = r(rms_norm(x, w["attn_norm"], cfg.rms_eps))
    q, k, v = (ar.linear(xn, w[name]) for name in ("wq", "wk", "wv"))
    if cfg.qkv_bias:
        q, k, v = r(q + w["bq"]), r(k + w["bk"]), r(v + w["bv"])
    q = _heads(q, cfg.heads, cfg.head_dim)
    k = _heads(k, cfg.kv_heads, cfg.head_dim)
    v = _heads(v, cfg.kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = r(rms_norm(q, w["q_norm"], cfg.rms_eps))
        k = r(rms_norm(k, w["k_norm"], cfg.rms_eps))
    q = r(rope(q, cos, sin, cfg.rope_traditional))
    k = r(rope(k, cos, sin, cfg.rope_traditional))
    keys = np.concatenate([_f32(cached_k), k], axis=1)
    values = np.concatenate([_f32(cached_v), v], axis=1)
    attn = _attention(q, keys, values, mask, cfg.kv_heads, ar)
    out = ar.linear(attn, w["wo"])
    x = r(x + (r(out + w["bo"]) if "bo" in w else out))
    xn = r(rms_norm(x, w["mlp_norm"], cfg.rms_eps))
    gate, up = ar.linear(xn, w["w_gate"]), ar.linear(xn, w["w_up"])
    act = r(r(gate / (1.0 + np.exp(-gate))) * up)
    x = r(x + ar.linear(act, w["w_down"]))
    return x, k, v


class ReferenceRunner:
    """The reference as a chunk runner (contract.py): `runner(x, pos, k_cache,
    v_cache) -> (k_new, v_new, h)`, the weights widened to float32 once.
    Returns float32 arrays for "fp32", float16 for the float16 precisions."""

    def __init__(self, weights: BodyWeights, precision: str = "fp32"):
        self.arithmetic = _Arithmetic(precision)
        self.out_type = np.float32 if precision == "fp32" else np.float16
        self.config, self.cos, self.sin = weights.config, weights.rope_cos, weights.rope_sin
        self.layers = [{name: _f32(a) for name, a in layer.items()} for layer in weights.layers]
        self.final_norm = _f32(weights.final_norm)

    def __call__(self, x, pos, k_cache, v_cache):
        r, cfg = self.arithmetic.r, self.config
        pos = int(np.asarray(pos).reshape(-1)[0])
        chunk, cache = x.shape[1], k_cache.shape[2]
        if not 0 <= pos <= cache:
            raise ValueError(f"pos {pos} is outside the cache's [0, {cache}]")
        if pos + chunk > self.cos.shape[0]:
            raise ValueError(f"rope tables hold {self.cos.shape[0]} positions, the chunk needs {pos + chunk}")
        cos, sin = _f32(self.cos[pos:pos + chunk]), _f32(self.sin[pos:pos + chunk])
        mask = attention_mask(pos, chunk, cache)
        h = r(_f32(x[0]))
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            h, k, v = _layer(layer, h, cos, sin, k_cache[i], v_cache[i], mask, cfg, self.arithmetic)
            ks.append(k)
            vs.append(v)
        h = r(rms_norm(h, self.final_norm, cfg.rms_eps))[None]
        return np.stack(ks).astype(self.out_type), np.stack(vs).astype(self.out_type), h.astype(self.out_type)


def run_chunk(weights: BodyWeights, x, pos, k_cache, v_cache, precision: str = "fp32"):
    """One chunk per contract.py: x (1, Q, hidden), pos (an int or (1,) int32),
    k_cache/v_cache (L, KV, S, Dh). Returns k_new, v_new (L, KV, Q, Dh) and
    h (1, Q, hidden): float32 arrays for "fp32", float16 for the others."""
    return ReferenceRunner(weights, precision)(x, pos, k_cache, v_cache)
