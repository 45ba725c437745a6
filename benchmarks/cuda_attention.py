"""A prefill's attention on MLX's CUDA backend: cuDNN (MLX's fused kernel) on
a shape it has not seen, cuDNN on a shape it has, and workers/cuda_attention.py.

cuDNN builds and caches a graph per (query, key) shape; a prefill after a
cached prefix almost always has a new one. Times one attention call (one
layer), evaluated, median of `--repeats`, for a few shapes of a swarm turn,
a picture follow-up and a cold prompt's chunk:

    python benchmarks/cuda_attention.py [--heads 16 --kv-heads 8 --dim 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from workers import cuda_attention

SHAPES = [(80, 1600), (65, 1537), (200, 2400), (512, 1400), (512, 4096)]  # (new tokens, keys)


def _timed(fn) -> float:
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
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
