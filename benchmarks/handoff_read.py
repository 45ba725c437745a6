"""A decode worker's intake of a handoff's tail: read_kv from host memory.

On MLX's CUDA backend every MLX array made from host memory pays a fixed cost
(managed memory), so reading a tail array by array (2 per layer) costs more
than reading its whole span once and cutting views (what read_kv does on a
GPU). Times both, for tails of Qwen3-0.6B's shape (28 layers, 8 KV heads of
128, bfloat16), each read followed by an evaluation on the device that
touches every array:

    python -m benchmarks.handoff_read [--tokens 16,130,600] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

import workers.kv_transfer as kv


def tail(tokens: int, layers: int = 28, heads: int = 8, dim: int = 128) -> list:
    out = []
    for i in range(layers):
        c = KVCache()
        k, v = (mx.random.normal((1, heads, tokens, dim), key=mx.random.key(2 * i + j)).astype(mx.bfloat16)
                for j in (0, 1))
        c.update_and_fetch(k, v)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def timed_read(buf, layers, per_slice: bool) -> float:
    on_cpu = kv._on_cpu
    kv._on_cpu = (lambda: True) if per_slice else on_cpu  # the per-slice read is the CPU's
    try:
        t0 = time.perf_counter()
        back = kv.read_kv(buf, layers)
        mx.eval(sum(mx.sum(c.keys[..., :1, :1]) + mx.sum(c.values[..., :1, :1]) for c in back))
        return time.perf_counter() - t0
    finally:
        kv._on_cpu = on_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,130,600")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print(f"{mx.default_device()}; read_kv of a tail, then one evaluation touching every array")
    print(f"{'tokens':>6} {'MiB':>6}  {'array by array':>14}  {'one span':>9}")
    for n in (int(x) for x in args.tokens.split(",")):
        cache = tail(n)
        buf = bytearray(kv.kv_nbytes(cache) + 64)
        layers = kv.write_kv(memoryview(buf), 64, cache)
        got = {}
        for per_slice in (True, False):
            timed_read(buf, layers, per_slice)
            got[per_slice] = statistics.median(timed_read(buf, layers, per_slice) for _ in range(args.repeats))
        print(f"{n:>6} {len(buf) / 2**20:>6.1f}  {got[True] * 1e3:>11.2f} ms  {got[False] * 1e3:>6.2f} ms")


if __name__ == "__main__":
    main()
