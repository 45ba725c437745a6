"""The transformer body's pieces as MIL ops (coremltools' Builder), float16
throughout: RMSNorm, rope at absolute positions, GQA attention under the
contract's visibility rule, the SwiGLU MLP, and one decoder layer.

Every function takes and returns MIL vars and must be called inside a MIL
function being built (`mb.program`). Only ops with a NumPy value inference in
coremltools are used (silu is written as x * sigmoid(x) for that reason), so
the same code, fed constants, evaluates the program on Linux
(coreml_evaluate.py).

Layouts: hidden states (1, Q, hidden); per-head tensors (heads, Q, Dh), the
contract's (KV, Q, Dh) per layer for keys and values.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb

# Smallest fp16 normal: the floor of a row's max |x| in rms_norm (an all-zero
# padding row must not divide by zero and poison the cache with NaN).
_NORM_FLOOR = np.float16(2.0**-14)
# The fill for scores a row may not see: exp() of it is exactly 0, and it is
# far enough from fp16's -65504 that score - max cannot overflow to -inf.
MASKED_SCORE = np.float16(-30000.0)


def const(value: np.ndarray, name: str):
    """A float16 weight constant (written to the package's weight file)."""
    return mb.const(val=np.asarray(value, dtype=np.float16), name=name)


def rms_norm(x, weight, eps: float, name: str):
    """x * rsqrt(mean(x^2) + eps) * weight over the last axis, overflow-safe in
    fp16: x is divided by its row's max |x| first (m), so squares stay <= 1 for
    residual streams far past fp16's sqrt(max) = 256; eps is carried as
    (sqrt(eps)/m)^2, which is mathematically the same norm."""
    m = mb.maximum(x=mb.reduce_max(x=mb.abs(x=x), axes=[-1], keep_dims=True), y=_NORM_FLOOR)
    y = mb.real_div(x=x, y=m)
    t = mb.real_div(x=np.float16(np.sqrt(eps)), y=m)
    mean_square = mb.reduce_mean(x=mb.square(x=y), axes=[-1], keep_dims=True)
    r = mb.rsqrt(x=mb.add(x=mean_square, y=mb.square(x=t)))
    return mb.mul(x=mb.mul(x=y, y=r), y=weight, name=name)


def rope_rows(table, pos, chunk: int, name: str):
    """The rope table's rows for positions pos .. pos+chunk-1: (chunk, Dh/2)."""
    offsets = mb.const(val=np.arange(chunk, dtype=np.int32), name=f"{name}_offsets")
    return mb.gather(x=table, indices=mb.add(x=pos, y=offsets), axis=0, name=name)


def rope(x, cos, sin, traditional: bool, name: str):
    """Rotate x (heads, Q, Dh) by the angles whose cos/sin are (Q, Dh/2): pairs
    are (x[i], x[i + Dh/2]) (halves) or (x[2i], x[2i+1]) (traditional)."""
    heads, q, dh = x.shape
    half = dh // 2
    if traditional:
        pairs = mb.reshape(x=x, shape=[heads, q, half, 2])
        x1 = mb.slice_by_index(x=pairs, begin=[0, 0, 0, 0], end=[heads, q, half, 1], squeeze_mask=[False] * 3 + [True])
        x2 = mb.slice_by_index(x=pairs, begin=[0, 0, 0, 1], end=[heads, q, half, 2], squeeze_mask=[False] * 3 + [True])
    else:
        x1 = mb.slice_by_index(x=x, begin=[0, 0, 0], end=[heads, q, half])
        x2 = mb.slice_by_index(x=x, begin=[0, 0, half], end=[heads, q, dh])
    r1 = mb.sub(x=mb.mul(x=x1, y=cos), y=mb.mul(x=x2, y=sin))
    r2 = mb.add(x=mb.mul(x=x2, y=cos), y=mb.mul(x=x1, y=sin))
    if traditional:
        return mb.reshape(x=mb.stack(values=[r1, r2], axis=-1), shape=[heads, q, dh], name=name)
    return mb.concat(values=[r1, r2], axis=-1, name=name)


def heads_of(x, count: int, head_dim: int, norm, eps: float, name: str):
    """(1, Q, count*Dh) -> (Q, count, Dh), RMS-normed per head when `norm` is given."""
    q = x.shape[1]
    split = mb.reshape(x=x, shape=[q, count, head_dim], name=f"{name}_split")
    if norm is not None:
        split = rms_norm(split, norm, eps, name=f"{name}_norm")
    return split


def attention(q, keys, values, visible, name: str):
    """softmax(q k^T / sqrt(Dh), where visible) v for q (H, Q, Dh) and keys,
    values (KV, T, Dh), visible (Q, T) bool; head h reads kv head h // (H/KV)
    (MLX's GQA), without repeating the KV. Returns (1, Q, H*Dh)."""
    heads, chunk, dh = q.shape
    kv, t, _ = keys.shape
    group = heads // kv
    scaled = mb.mul(x=q, y=np.float16(dh**-0.5))
    grouped = mb.reshape(x=scaled, shape=[kv, group * chunk, dh])
    scores = mb.matmul(x=grouped, y=keys, transpose_y=True)
    scores = mb.reshape(x=scores, shape=[kv, group, chunk, t])
    # select, not an additive mask: a stale slot's score is replaced, never summed
    scores = mb.select(cond=visible, a=scores, b=MASKED_SCORE)
    probs = mb.softmax(x=scores, axis=-1, name=f"{name}_probs")
    probs = mb.reshape(x=probs, shape=[kv, group * chunk, t])
    out = mb.matmul(x=probs, y=values)
    out = mb.transpose(x=mb.reshape(x=out, shape=[heads, chunk, dh]), perm=[1, 0, 2])
    return mb.reshape(x=out, shape=[1, chunk, heads * dh], name=name)


def mlp(x, w, prefix: str, name: str):
    """down(silu(gate(x)) * up(x)), silu as x * sigmoid(x)."""
    gate = mb.linear(x=x, weight=const(w["w_gate"], f"{prefix}_w_gate"))
    up = mb.linear(x=x, weight=const(w["w_up"], f"{prefix}_w_up"))
    act = mb.mul(x=gate, y=mb.sigmoid(x=gate))
    return mb.linear(x=mb.mul(x=act, y=up), weight=const(w["w_down"], f"{prefix}_w_down"), name=name)


def projection(x, w, key: str, bias_key: str, prefix: str):
    bias = w.get(bias_key)
    if bias is None:
        return mb.linear(x=x, weight=const(w[key], f"{prefix}_{key}"))
    return mb.linear(x=x, weight=const(w[key], f"{prefix}_{key}"), bias=const(bias, f"{prefix}_{bias_key}"))


def layer_qkv(h, w, cfg, cos, sin, prefix: str):
    """A layer's queries (H, Q, Dh) and the chunk's keys and values (KV, Q, Dh),
    keys after k-norm and rope: exactly what the contract's caches hold."""
    hn = rms_norm(h, const(w["attn_norm"], f"{prefix}_attn_norm"), cfg.rms_eps, name=f"{prefix}_attn_in")
    q_norm = const(w["q_norm"], f"{prefix}_q_norm") if cfg.qk_norm else None
    k_norm = const(w["k_norm"], f"{prefix}_k_norm") if cfg.qk_norm else None
    q = heads_of(projection(hn, w, "wq", "bq", prefix), cfg.heads, cfg.head_dim, q_norm, cfg.rms_eps, f"{prefix}_q")
    k = heads_of(projection(hn, w, "wk", "bk", prefix), cfg.kv_heads, cfg.head_dim, k_norm, cfg.rms_eps, f"{prefix}_k")
    v = heads_of(projection(hn, w, "wv", "bv", prefix), cfg.kv_heads, cfg.head_dim, None, cfg.rms_eps, f"{prefix}_v")
    q = rope(mb.transpose(x=q, perm=[1, 0, 2]), cos, sin, cfg.rope_traditional, name=f"{prefix}_q_rope")
    k = rope(mb.transpose(x=k, perm=[1, 0, 2]), cos, sin, cfg.rope_traditional, name=f"{prefix}_k_rope")
    v = mb.transpose(x=v, perm=[1, 0, 2], name=f"{prefix}_v_heads")
    return q, k, v


def layer_out(h, attn, w, cfg, prefix: str):
    """The rest of the block after attention: o-projection, residual, MLP, residual."""
    o = projection(attn, w, "wo", "bo", prefix)
    h = mb.add(x=h, y=o, name=f"{prefix}_attn_res")
    hn = rms_norm(h, const(w["mlp_norm"], f"{prefix}_mlp_norm"), cfg.rms_eps, name=f"{prefix}_mlp_in")
    return mb.add(x=h, y=mlp(hn, w, prefix, name=f"{prefix}_mlp"), name=f"{prefix}_out")
