"""Decode step cost with long contexts: mlx-lm's padded BatchKVCache, Tandem's
padded batch that drops rows by contiguous copies (workers/batch_cache.py: what
decode workers use on a GPU) and Tandem's ragged rows (workers/ragged_kv.py: on
the CPU), with and without a shared prompt prefix.

A swarm keeps a decode batch of long contexts whose rows come and go every few
steps. This measures, on the embedded model and random KV of the given
lengths, in one process:
  * a steady decode step of B rows;
  * a row joining (insert + the step it joins in) and a row leaving (remove + a step);
  * with `--shared N`, every row's first N tokens identical (a system prompt),
    which ragged rows hold and read once.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/decode_batch.py --rows 16 --context 1300 --shared 864
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from workers import mlx_hooks, ragged_kv
from workers.loading import load_model, size_buffer_cache
from workers.model_store import resolve_model
from workers.vision import ShiftedKVCache


def filled_cache(model, length: int, shared, seed: int):
    """A batch-1 cache of `length` tokens of random KV; its first tokens are
    `shared`'s (per layer) when given."""
    cache = make_prompt_cache(model)
    key = mx.random.key(seed)
    for i, layer in enumerate(cache):
        attn = model.layers[i].self_attn
        h = attn.n_kv_heads
        d = attn.k_proj.weight.shape[0] // h
        own = length - (shared[i][0].shape[2] if shared else 0)
        k = mx.random.normal((1, h, own, d), key=mx.random.split(key)[0]) * 0.1
        v = mx.random.normal((1, h, own, d), key=mx.random.split(key)[1]) * 0.1
        if shared:
            k, v = mx.concatenate([shared[i][0], k], axis=2), mx.concatenate([shared[i][1], v], axis=2)
        layer.update_and_fetch(k, v)
    mx.eval([c.state for c in cache])
    return cache


def run(mode: str, rows: int, context: int, shared_len: int, steps: int, spread: int = 37, model_dir=None) -> dict:
    model, _ = load_model(str(resolve_model(model_dir)))
    size_buffer_cache()  # as a worker sizes it
    ragged = mode.startswith("ragged")
    if ragged:
        mlx_hooks.install(model)
    shared = None
    if shared_len:
        base = filled_cache(model, shared_len, None, 999)
        shared = [(c.keys[..., :shared_len, :], c.values[..., :shared_len, :]) for c in base]
    sharing = ragged_kv.PrefixSharing(min_tokens=1) if (ragged and shared_len) else None
    prefix_tokens = list(range(shared_len))

    def make(i: int, length: int):
        cache = filled_cache(model, length, shared, i)
        if mode == "runs":  # as workers/decode.py hands a request's KV to the batch
            return ShiftedKVCache.of(cache, 0)
        if not ragged:
            return cache
        cache = ragged_kv.rows_of(cache)
        if sharing is not None:  # tokens: the shared prefix, then the row's own
            sharing.admit(f"r{i}", prefix_tokens + [10_000 + i] * (length - shared_len), cache)
        return cache

    gen = BatchGenerator(model, completion_batch_size=rows + 8, prefill_batch_size=rows + 8)
    lengths = [context + spread * i for i in range(rows)]
    uids = gen.insert([[5]] * rows, max_tokens=[100_000] * rows, caches=[make(i, n) for i, n in enumerate(lengths)])
    gen.next_generated()
    for _ in range(2):
        gen.next_generated()
    step_s = []
    for _ in range(steps):
        t = time.perf_counter()
        gen.next_generated()
        step_s.append(time.perf_counter() - t)
    join_s, leave_s = [], []
    for k in range(3):
        cache = make(rows + k, context + 200)
        t = time.perf_counter()
        gen.insert([[5]], max_tokens=[100_000], caches=[cache])
        gen.next_generated()
        join_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        gen.remove([uids[k]])
        gen.next_generated()
        leave_s.append(time.perf_counter() - t)
    gen.close()
    step = statistics.median(step_s)
    return {"mode": mode, "step_ms": step * 1000, "tok_s": rows / step,
            "join_ms": statistics.median(join_s) * 1000, "leave_ms": statistics.median(leave_s) * 1000}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or id (default: the embedded model)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--context", type=int, default=1300, help="tokens of the shortest row (row i has spread*i more)")
    p.add_argument("--spread", type=int, default=37, help="tokens between one row's context and the next's")
    p.add_argument("--shared", type=int, default=864, help="tokens every row starts with (0: none)")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args(argv)
    results = [run("batch", args.rows, args.context, 0, args.steps, args.spread, args.model),
               run("runs", args.rows, args.context, 0, args.steps, args.spread, args.model),
               run("ragged", args.rows, args.context, 0, args.steps, args.spread, args.model)]
    if args.shared:
        results.append(run("ragged+shared", args.rows, args.context, args.shared, args.steps, args.spread, args.model))
    print(f"{args.rows} rows of {args.context}-{args.context + args.spread * (args.rows - 1)} tokens"
          + (f", {args.shared} shared" if args.shared else ""))
    print("| batch KV | step | output tok/s | join + step | leave + step |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['step_ms']:.0f} ms | {r['tok_s']:.1f} | {r['join_ms']:.0f} ms | {r['leave_ms']:.0f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
