"""What a forward pass of a new shape costs the first time, per shape.

On MLX's CUDA backend a prefill's first pass at some shapes costs tens of ms
more than the same pass again (MLX records and instantiates a CUDA graph for
kernels it has not recorded; cuBLAS picks kernels per row count; compare with
MLX_USE_CUDA_GRAPHS=0). This tells which dimension it keys on: the new
tokens (n) over a fixed cached prefix, or the cached prefix (keys) under a fixed n. Each pass runs
over a prefix cache trimmed back to P cached tokens, twice: first and again.
`--parts` times a pass's pieces one by one instead (each evaluated on its
own): the layers without the output projection, the output projection of n
rows, and the KV caches' updates alone (every layer's keys and values
written at offset P). `--layer` times the first layer's steps one by one
(Llama- and Qwen3-style layers: q/k/v/o projections, RoPE, q/k norms
where the model has them): norm, projections, q/k norms, RoPE, cache update, attention,
output projection, MLP.

    python -m benchmarks.probes.first_pass --model DIR [--parts | --layer]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from workers.kernels import mlx_hooks
from workers.models.loading import load_model


def _ids(n: int) -> list[int]:
    return [10 + (i * 7919) % 1000 for i in range(n)]


def _timed(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _whole(model, cache, ids: list[int], p: int, n: int) -> dict:
    """A whole pass of n new tokens over p cached ones, to its last row's logits."""
    trim_prompt_cache(cache, cache[0].offset - p)
    return {"pass": _timed(lambda: model(mx.array([ids[:n]]), cache=cache)[:, -1])}


def _pieces(model, cache, ids: list[int], p: int, n: int) -> dict:
    """The layers, the output projection of n rows, and the KV caches' updates, each evaluated alone."""
    inner = getattr(model, "model", None)
    out_proj = model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens.as_linear
    trim_prompt_cache(cache, cache[0].offset - p)
    h = None

    def layers():
        nonlocal h
        h = inner(mx.array([ids[:n]]), cache=cache)
        return h
    t = {"layers": _timed(layers), "output": _timed(lambda: out_proj(h))}
    trim_prompt_cache(cache, n)
    k = [mx.zeros((1, c.keys.shape[1], n, c.keys.shape[3]), c.keys.dtype) for c in cache]
    mx.eval(k)
    t["cache update"] = _timed(lambda: [c.update_and_fetch(x, x)[0] for c, x in zip(cache, k)])
    return t


def _layer_steps(model, cache, ids: list[int], p: int, n: int) -> dict:
    """The first layer's steps one by one, each evaluated alone."""
    trim_prompt_cache(cache, cache[0].offset - p)
    layer, c = model.model.layers[0], cache[0]
    a = layer.self_attn
    x = mx.random.normal((1, n, a.q_proj.weight.shape[1]), key=mx.random.key(n)).astype(a.q_proj.weight.dtype)
    mx.eval(x)
    t, v = {}, {}

    def step(name, fn):
        t[name] = _timed(lambda: v.__setitem__(name, fn()) or v[name])

    step("norm", lambda: layer.input_layernorm(x))
    step("qkv", lambda: [a.q_proj(v["norm"]), a.k_proj(v["norm"]), a.v_proj(v["norm"])])
    q, k, val = v["qkv"]
    q_norm, k_norm = (getattr(a, name, lambda y: y) for name in ("q_norm", "k_norm"))  # Llama has none
    step("qk norm", lambda: [q_norm(q.reshape(1, n, a.n_heads, -1)).transpose(0, 2, 1, 3),
                             k_norm(k.reshape(1, n, a.n_kv_heads, -1)).transpose(0, 2, 1, 3)])
    step("rope", lambda: [a.rope(v["qk norm"][0], offset=c.offset), a.rope(v["qk norm"][1], offset=c.offset)])
    vv = val.reshape(1, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
    step("cache", lambda: list(c.update_and_fetch(v["rope"][1], vv)))
    # The attention the model's module calls (workers/kernels/mlx_hooks.py's where installed).
    attend = sys.modules[type(a).__module__].scaled_dot_product_attention
    step("attention", lambda: attend(
        v["rope"][0], *v["cache"], cache=c, scale=a.scale, mask="causal"))
    step("o proj", lambda: a.o_proj(v["attention"].transpose(0, 2, 1, 3).reshape(1, n, -1)))
    step("mlp", lambda: layer.mlp(layer.post_attention_layernorm(x + v["o proj"])))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--parts", action="store_true", help="time a pass's pieces one by one")
    ap.add_argument("--layer", action="store_true", help="time the first layer's steps one by one")
    args = ap.parse_args()
    model, _ = load_model(args.model)
    mlx_hooks.install(model)  # as the workers run it (attention routing)
    cache = make_prompt_cache(model)
    top = 1600
    model(mx.array([_ids(top)]), cache=cache)
    mx.eval([c.state for c in cache])
    measure = _layer_steps if args.layer else _pieces if args.parts else _whole
    once = functools.partial(measure, model, cache, _ids(600))

    def row(label: str, p: int, n: int) -> None:
        a, b = once(p, n), once(p, n)
        cells = ", ".join(f"{k} {a[k]:7.2f} / {b[k]:6.2f} ms" for k in a)
        print(f"{label:>10} P={p:>5} n={n:>4}: first / again: {cells}", flush=True)

    print(mx.default_device())
    for n in (63, 64, 65, 57, 59, 70, 100, 128, 129, 200):  # new tokens, fixed keys
        row("tokens", 1472, n)
    for p in (1400, 1410, 1473, 1500, 1536, 1537, 1590):  # cached prefix, fixed tokens
        row("prefix", p, 63)
    for p in (1400, 1401, 1500):  # a decode-like single token
        row("one", p, 1)
    for n in (63, 64, 65, 57, 59, 70, 100, 128, 129, 200):  # the same again: all seen?
        row("repeat", 1472, n)


if __name__ == "__main__":
    main()
