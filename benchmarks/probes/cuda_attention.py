"""A prefill's attention on MLX's CUDA backend: cuDNN (MLX's fused kernel) on
a shape it has not seen, cuDNN on a shape it has, and workers/kernels/cuda_attention.py.

cuDNN builds and caches a graph per (query, key) shape; a prefill after a
cached prefix almost always has a new one. Times one attention call (one
layer), evaluated, median of `--repeats`, for a few shapes of a swarm turn,
a picture follow-up and a cold prompt's chunk:

    python benchmarks/probes/cuda_attention.py [--heads 16 --kv-heads 8 --dim 128]

`--decode` times instead a padded decode batch's one query per row
(workers/kernels/cuda_decode_attention.py): MLX's attention under mlx-lm's
left-padding mask (its CUDA backend has no fused kernel for an array mask, so
it runs separate ops), ours, and MLX's fused kernel with no mask (what the
rows would cost unpadded), for `--layers` layers evaluated together, as one
decode step runs them:

    python benchmarks/probes/cuda_attention.py --decode [--layers 28]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from workers.kernels import cuda_attention, cuda_decode_attention

SHAPES = [(80, 1600), (65, 1537), (200, 2400), (512, 1400), (512, 4096)]  # (new tokens, keys)
DECODE_SHAPES = [(8, 1500), (32, 1400), (32, 2600), (64, 2600)]  # (rows, keys of the longest)


def _timed(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t0


def decode(args) -> None:
    """A decode step's attention over `args.layers` layers of padded rows."""
    print(f"{mx.default_device()}, {args.heads} query heads, {args.kv_heads} KV heads of {args.dim}, "
          f"bfloat16, {args.layers} layers per step")
    print(f"{'rows':>5} {'keys':>6}  {'MLX, masked':>11}  {'ours':>8}  {'MLX, no mask':>12}")
    scale = args.dim ** -0.5
    for i, (rows, total) in enumerate(DECODE_SHAPES):
        keys = mx.random.split(mx.random.key(100 + i), 4)
        shape = (rows + 8, args.kv_heads, total + 256, args.dim)  # a batch cache's spare rows and room
        kb = mx.random.normal(shape, key=keys[0]).astype(mx.bfloat16)
        vb = mx.random.normal(shape, key=keys[1]).astype(mx.bfloat16)
        k, v = kb[:rows, :, :total], vb[:rows, :, :total]
        qs = [mx.random.normal((rows, args.heads, 1, args.dim), key=mx.random.key(j)).astype(mx.bfloat16)
              for j in range(args.layers)]
        starts = mx.random.randint(0, total // 2, (rows,), key=keys[2]).astype(mx.int32)
        mask = (mx.arange(total)[None] >= starts[:, None])[:, None, None, :]
        mx.eval(kb, vb, qs, starts, mask)
        ways = {
            "masked": lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask) for q in qs],
            "ours": lambda: [cuda_decode_attention.attention(q, k, v, scale, starts) for q in qs],
            "plain": lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale) for q in qs],
        }
        got = {}
        for name, fn in ways.items():
            _timed(fn)
            got[name] = statistics.median(_timed(fn) for _ in range(args.repeats)) * 1e3
        print(f"{rows:>5} {total:>6}  {got['masked']:>8.2f} ms  {got['ours']:>5.2f} ms  {got['plain']:>9.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--decode", action="store_true", help="a padded decode batch's attention instead")
    ap.add_argument("--layers", type=int, default=28, help="with --decode: layers per step")
    args = ap.parse_args()
    if args.decode:
        return decode(args)
    print(f"{mx.default_device()}, {args.heads} query heads, {args.kv_heads} KV heads of {args.dim}, bfloat16")
    print(f"{'queries':>7} {'keys':>6}  {'cuDNN, new shape':>16}  {'cuDNN, seen':>11}  {'ours':>8}")
    for i, (n, total) in enumerate(SHAPES):
        key = mx.random.key(i)
        q = mx.random.normal((1, args.heads, n, args.dim), key=key).astype(mx.bfloat16)
        k = mx.random.normal((1, args.kv_heads, total, args.dim), key=key).astype(mx.bfloat16)
        v = mx.random.normal((1, args.kv_heads, total, args.dim), key=key).astype(mx.bfloat16)
        scale = args.dim ** -0.5
        fused = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")  # noqa: E731
        ours = lambda: cuda_attention.attention(q, k, v, scale, "causal")  # noqa: E731
        first = _timed(fused)
        seen = statistics.median(_timed(fused) for _ in range(args.repeats))
        if ours() is None:
            mine = "(MLX's)"
        else:
            _timed(ours)
            mine = f"{statistics.median(_timed(ours) for _ in range(args.repeats)) * 1e3:.2f} ms"
        print(f"{n:>7} {total:>6}  {first * 1e3:>13.2f} ms  {seen * 1e3:>8.2f} ms  {mine:>8}")


if __name__ == "__main__":
    main()
