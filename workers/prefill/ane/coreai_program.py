"""The chunk program of contract.py as a Core AI program (coreai-core's
authoring API, no torch): built from a BodyWeights for one Bucket (Q, S),
float16 throughout, the weights baked in as constants, saved as an
`.aimodel` asset (a folder: main.mlirb, main.hash, metadata.json).

The program keeps the contract's tensors at its boundary (x, pos, k_cache,
v_cache in; k_new, v_new, h out) and its layout inside too: the cache is read
as (L, KV, S, Dh) and attention runs over the cache's S slots plus the
chunk's Q rows under the contract's mask, so nothing is written in place
(Core AI's own LLM recipe keeps (L, 1, kv_dim, 1, S) states updated in
place; that layout is the Neural Engine's business and can come later
without changing this boundary).

Numerics: `compute="fp16"` (the default, what the Neural Engine runs) keeps
every tensor in float16 but the RMSNorm statistics (mean of squares, rsqrt:
float32, since x^2 overflows float16 once an activation passes 256);
`compute="fp32"` computes in float32 between the same float16 inputs,
outputs and weights (the weights stay float16 constants, cast inside), for
checks: coreai-core's Linux CPU runtime sums a float16 matmul term by term
in float16 (reference.py's "fp16acc"), ~100x slower than its float32 one.
Rope uses the model's own tables (weights.rope_cos/sin) gathered at
pos + row; the attention scale is applied to q before q.k^T to keep the
scores well inside float16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np

from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.weights import BodyConfig, BodyWeights

FUNCTION = "main"
INPUTS = ("x", "pos", "k_cache", "v_cache")
OUTPUTS = ("k_new", "v_new", "h")
COMPUTE_DTYPES = {"fp16": np.float16, "fp32": np.float32}


def io_shapes(config: BodyConfig, bucket: Bucket) -> dict[str, tuple[tuple[int, ...], type]]:
    """Every input's and output's (shape, dtype), by contract.py."""
    q, s = bucket.chunk, bucket.cache
    cache = (config.layers, config.kv_heads, s, config.head_dim)
    new = (config.layers, config.kv_heads, q, config.head_dim)
    return {"x": ((1, q, config.hidden), np.float16), "pos": ((1,), np.int32),
            "k_cache": (cache, np.float16), "v_cache": (cache, np.float16),
            "k_new": (new, np.float16), "v_new": (new, np.float16), "h": ((1, q, config.hidden), np.float16)}


def _shape(*dims: int) -> np.ndarray:
    return np.array(dims, np.int64)


def _perm(*axes: int) -> np.ndarray:
    return np.array(axes, np.uint32)  # coreai.transpose wants unsigned permutations


def rope_tables(weights: BodyWeights, bucket: Bucket) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rope as x * cos_full + (x @ rot) * sin_full: the (positions, Dh) float32
    tables and the signed permutation rot (Dh, Dh) that maps each pair (a, b)
    to (-b, a), interleaved pairs when traditional, else halves. A product with
    rot is exact (one +-1 per column)."""
    cfg = weights.config
    rows = min(weights.rope_cos.shape[0], bucket.cache + bucket.chunk)
    if rows < bucket.cache:
        raise ValueError(f"rope tables hold {weights.rope_cos.shape[0]} positions, bucket {bucket.name} needs "
                         f"{bucket.cache} (build the weights with positions >= S + Q)")
    cos, sin = weights.rope_cos[:rows], weights.rope_sin[:rows]
    dh, half = cfg.head_dim, cfg.head_dim // 2
    rot = np.zeros((dh, dh), np.float16)
    if cfg.rope_traditional:
        cos_full, sin_full = np.repeat(cos, 2, axis=1), np.repeat(sin, 2, axis=1)
        a, b = np.arange(0, dh, 2), np.arange(1, dh, 2)
    else:
        cos_full, sin_full = np.concatenate([cos, cos], 1), np.concatenate([sin, sin], 1)
        a, b = np.arange(half), np.arange(half, dh)
    rot[b, a] = -1.0  # out[a] = -x[b]
    rot[a, b] = 1.0  # out[b] = x[a]
    return cos_full.astype(np.float32), sin_full.astype(np.float32), rot


class _ChunkGraph:
    """The ops of one chunk, emitted inside a Core AI graph body."""

    def __init__(self, ca, weights: BodyWeights, bucket: Bucket, compute: str):
        self.ca, self.w, self.cfg, self.q, self.s = ca, weights, weights.config, bucket.chunk, bucket.cache
        self.dt = COMPUTE_DTYPES[compute]
        self.cos_table, self.sin_table, self.rot = (t.astype(self.dt) for t in rope_tables(weights, bucket))

    def from_fp16(self, x):
        """A float16 tensor (an input) in the compute dtype."""
        return x if self.dt == np.float16 else self.ca.cast(x, self.dt)

    def to_fp16(self, x):
        """A compute-dtype tensor as float16 (an output)."""
        return x if self.dt == np.float16 else self.ca.cast(x, np.float16)

    def matrix(self, weight: np.ndarray):
        """A weight matrix as a float16 constant, in the compute dtype."""
        const = np.ascontiguousarray(weight.astype(np.float16))
        return const if self.dt == np.float16 else self.ca.cast(const, self.dt)

    def rms_norm(self, x, weight: np.ndarray, rows: int):
        """x (rows, n) -> normalized over n, statistics in float32."""
        ca = self.ca
        x32 = x if self.dt == np.float32 else ca.cast(x, np.float32)
        mean = ca.reshape(ca.reduce_mean(ca.mul(x32, x32), np.array([1], np.int32)), _shape(rows, 1))
        inv = ca.rsqrt(ca.broadcasting_add(mean, np.float32(self.cfg.rms_eps)))
        normed = ca.broadcasting_mul(x32, inv)
        normed = normed if self.dt == np.float32 else ca.cast(normed, self.dt)
        return ca.broadcasting_mul(normed, weight.astype(self.dt).reshape(1, -1))

    def linear(self, x, weight: np.ndarray, bias: np.ndarray | None = None):
        """x (rows, in) @ weight.T, weight (out, in) as MLX holds it."""
        y = self.ca.batch_matmul(x, self.matrix(weight.T))
        return y if bias is None else self.ca.broadcasting_add(y, bias.astype(self.dt).reshape(1, -1))

    def heads(self, x, n: int):
        """(Q, n * Dh) -> (n, Q, Dh)."""
        ca, dh = self.ca, self.cfg.head_dim
        return ca.transpose(ca.reshape(x, _shape(self.q, n, dh)), _perm(1, 0, 2))

    def head_norm(self, x, weight: np.ndarray, n: int):
        """qwen3's per-head RMSNorm of x (n, Q, Dh)."""
        dh = self.cfg.head_dim
        flat = self.rms_norm(self.ca.reshape(x, _shape(n * self.q, dh)), weight, n * self.q)
        return self.ca.reshape(flat, _shape(n, self.q, dh))

    def rope(self, x, cos, sin, n: int):
        """x (n, Q, Dh) rotated by cos/sin (Q, Dh) of its positions."""
        ca, dh = self.ca, self.cfg.head_dim
        turned = ca.reshape(ca.batch_matmul(ca.reshape(x, _shape(n * self.q, dh)), self.rot), _shape(n, self.q, dh))
        return ca.add(ca.broadcasting_mul(x, cos), ca.broadcasting_mul(turned, sin))

    def positions(self, pos):
        """The chunk rows' rope rows (Q, Dh) and the attention mask (Q, S + Q)."""
        ca, q, s = self.ca, self.q, self.s
        index = ca.broadcasting_add(ca.range_(np.int32(0), np.int32(q), np.int32(1)), pos)
        index = ca.reshape(index, _shape(q, 1))
        cos, sin = ca.gather_nd(self.cos_table, index), ca.gather_nd(self.sin_table, index)
        slots = ca.broadcasting_greater(pos, ca.range_(np.int32(0), np.int32(s), np.int32(1)))  # j < pos
        slots = ca.broadcast_to(ca.reshape(slots, _shape(1, s)), _shape(q, s))
        mask = ca.concat(np.int32(1), [slots, np.tril(np.ones((q, q), bool))])
        group = self.cfg.heads // self.cfg.kv_heads
        if group > 1:  # one copy per query head of a kv group: rows (group * Q)
            mask = ca.concat(np.int32(0), [mask] * group)
        return cos, sin, mask

    def layer_cache(self, cache, i: int):
        """Layer i's (KV, S, Dh) slice of a (L, KV, S, Dh) cache."""
        cfg = self.cfg
        part = self.ca.slice_(cache, np.array([i, 0, 0, 0], np.int32),
                              np.array([i + 1, cfg.kv_heads, self.s, cfg.head_dim], np.int32),
                              np.array([1, 1, 1, 1], np.int32))
        return self.from_fp16(self.ca.reshape(part, _shape(cfg.kv_heads, self.s, cfg.head_dim)))

    def attention(self, q, keys, values, mask):
        """q (H, Q, Dh) over keys/values (KV, S + Q, Dh): query head h reads kv
        head h // (H / KV), as MLX groups them. Returns (Q, H * Dh)."""
        ca, cfg, qn = self.ca, self.cfg, self.q
        kv, group, dh = cfg.kv_heads, cfg.heads // cfg.kv_heads, cfg.head_dim
        grouped = ca.reshape(ca.mul(q, np.full((cfg.heads, qn, dh), dh ** -0.5, self.dt)),
                             _shape(kv, group * qn, dh))
        scores = ca.batch_matmul(grouped, ca.transpose(keys, _perm(0, 2, 1)))
        scores = ca.broadcasting_where(mask, scores, np.array(-np.inf, self.dt))
        out = ca.batch_matmul(ca.softmax(scores, np.int32(-1)), values)  # (KV, group * Q, Dh)
        out = ca.transpose(ca.reshape(out, _shape(cfg.heads, qn, dh)), _perm(1, 0, 2))
        return ca.reshape(out, _shape(qn, cfg.heads * dh))

    def block(self, layer: dict, x, cached_k, cached_v, cos, sin, mask):
        """One transformer block over x (Q, hidden): (x out, k (KV, Q, Dh), v)."""
        ca, cfg = self.ca, self.cfg
        xn = self.rms_norm(x, layer["attn_norm"], self.q)
        q = self.heads(self.linear(xn, layer["wq"], layer.get("bq")), cfg.heads)
        k = self.heads(self.linear(xn, layer["wk"], layer.get("bk")), cfg.kv_heads)
        v = self.heads(self.linear(xn, layer["wv"], layer.get("bv")), cfg.kv_heads)
        if cfg.qk_norm:
            q = self.head_norm(q, layer["q_norm"], cfg.heads)
            k = self.head_norm(k, layer["k_norm"], cfg.kv_heads)
        q, k = self.rope(q, cos, sin, cfg.heads), self.rope(k, cos, sin, cfg.kv_heads)
        keys = ca.concat(np.int32(1), [cached_k, k])
        values = ca.concat(np.int32(1), [cached_v, v])
        x = ca.add(x, self.linear(self.attention(q, keys, values, mask), layer["wo"], layer.get("bo")))
        xn = self.rms_norm(x, layer["mlp_norm"], self.q)
        gate, up = self.linear(xn, layer["w_gate"]), self.linear(xn, layer["w_up"])
        x = ca.add(x, self.linear(ca.mul(ca.silu(gate), up), layer["w_down"]))
        return x, k, v

    def chunk(self, x, pos, k_cache, v_cache):
        """The whole program: (k_new, v_new, h) per contract.py."""
        ca, cfg = self.ca, self.cfg
        cos, sin, mask = self.positions(pos)
        h = self.from_fp16(ca.reshape(x, _shape(self.q, cfg.hidden)))
        ks, vs = [], []
        for i, layer in enumerate(self.w.layers):
            h, k, v = self.block(layer, h, self.layer_cache(k_cache, i), self.layer_cache(v_cache, i), cos, sin, mask)
            ks.append(ca.reshape(k, _shape(1, cfg.kv_heads, self.q, cfg.head_dim)))
            vs.append(ca.reshape(v, _shape(1, cfg.kv_heads, self.q, cfg.head_dim)))
        h = ca.reshape(self.rms_norm(h, self.w.final_norm, self.q), _shape(1, self.q, cfg.hidden))
        return self.to_fp16(ca.concat(np.int32(0), ks)), self.to_fp16(ca.concat(np.int32(0), vs)), self.to_fp16(h)


def build_program(weights: BodyWeights, bucket: Bucket, compute: str = "fp16"):
    """The chunk program for `bucket` as a coreai.authoring.AIProgram,
    computing in `compute` ("fp16" or "fp32") between float16 inputs/outputs."""
    import coreai.authoring as ca  # heavy (MLIR bindings): only where a program is built
    from coreai.authoring import AIProgram, Module, TensorSpec, Value, graph

    spec = {name: TensorSpec(shape, dtype, name=name)
            for name, (shape, dtype) in io_shapes(weights.config, bucket).items()}
    if compute not in COMPUTE_DTYPES:
        raise ValueError(f"compute must be one of {tuple(COMPUTE_DTYPES)}, not {compute!r}")
    ops = _ChunkGraph(ca, weights, bucket, compute)

    def main(x, pos, k_cache, v_cache):
        return ops.chunk(x, pos, k_cache, v_cache)

    # The graph reads its inputs' names from the parameters and its outputs'
    # from the return annotation; set as objects, since this module's
    # annotations are strings that name locals.
    main.__annotations__ = {**{name: Annotated[Value, spec[name]] for name in INPUTS},
                            "return": tuple[tuple(Annotated[Value, spec[name]] for name in OUTPUTS)]}
    module = Module.create()
    with module:
        graph(main)
    return AIProgram(module)


def save_program(weights: BodyWeights, bucket: Bucket, path: Path | str, compute: str = "fp16"):
    """Build the program and save it as an `.aimodel` asset at `path`
    (replaced if present); returns the coreai.authoring.AIModelAsset."""
    path = Path(path)
    if path.suffix != ".aimodel":
        raise ValueError(f"a Core AI asset's path ends in .aimodel, not {path.name!r}")
    return build_program(weights, bucket, compute).save_asset(path)
