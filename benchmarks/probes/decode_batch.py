"""Decode step cost with long contexts: mlx-lm's padded BatchKVCache, Tandem's
padded batch that drops rows by contiguous copies (workers/kernels/slot_batch_cache.py: what
decode workers use on a GPU) and Tandem's ragged rows (workers/decode/ragged_kv.py: on
the CPU), with and without a shared prompt prefix. Tandem's modes run through
workers/decode/engine.py's DecodeEngine, as a decode worker does; "batch" is mlx-lm's
BatchGenerator.

A swarm keeps a decode batch of long contexts whose rows come and go every few
steps. This measures, on the embedded model and random KV of the given
lengths, in one process:
  * a steady decode step of B rows;
  * a row joining (add + the step it joins in) and a row leaving (remove + a step);
  * with `--shared N`, every row's first N tokens identical (a system prompt),
    which ragged rows hold and read once.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/probes/decode_batch.py --rows 16 --context 1300 --shared 864
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from protos.messages import DecodeRequest, KVHandoff, SamplingParams
from workers.decode.prefix_sharing import PrefixSharing
from workers.decode.engine import DecodeEngine
from workers.models.loading import load_model, size_buffer_cache
from workers.models.store import resolve_model


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


class _MlxLmBatch:
    """mlx-lm's own BatchGenerator and padded BatchKVCache (mode "batch"):
    a newcomer goes through its prompt phase, a forward pass of its own."""

    def __init__(self, model, rows: int):
        self.gen = BatchGenerator(model, completion_batch_size=rows + 8, prefill_batch_size=rows + 8)
        self.uid_of = {}

    def add(self, key, tokens, cache):
        (self.uid_of[key],) = self.gen.insert([[5]], max_tokens=[100_000], caches=[cache])

    def step(self):
        self.gen.next_generated()

    def remove(self, key):
        self.gen.remove([self.uid_of.pop(key)])


class _TandemBatch:
    """workers/decode/engine.py's DecodeEngine (modes "runs", "ragged", "ragged+shared"),
    fed as the decode worker feeds it."""

    def __init__(self, model, rows: int, ragged: bool):
        self.engine = DecodeEngine(model, max_batch=rows + 8, ragged=ragged)
        if self.engine.sharing is not None:
            self.engine.sharing = PrefixSharing(min_tokens=1)

    def add(self, key, tokens, cache):
        n = len(tokens)
        self.engine.add(DecodeRequest(key, tokens, 5, KVHandoff(key, n, n), SamplingParams(max_tokens=100_000, temperature=0.0)), cache)

    def step(self):
        self.engine.step()

    def remove(self, key):
        self.engine.cancel(key, save=False)


def run(mode: str, rows: int, context: int, shared_len: int, steps: int, spread: int = 37, model_dir=None) -> dict:
    model, _ = load_model(str(resolve_model(model_dir)))
    size_buffer_cache()  # as a worker sizes it
    ragged = mode.startswith("ragged")
    shared = None
    if shared_len:
        base = filled_cache(model, shared_len, None, 999)
        shared = [(c.keys[..., :shared_len, :], c.values[..., :shared_len, :]) for c in base]
    if mode == "batch":
        batch = _MlxLmBatch(model, rows)
    else:
        batch = _TandemBatch(model, rows, ragged)

    def row(i: int, length: int):
        # tokens: the shared prefix, then the row's own (what prefix sharing matches)
        tokens = list(range(shared_len)) + [10_000 + i] * (length - shared_len)
        return f"r{i}", tokens, filled_cache(model, length, shared, i)

    lengths = [context + spread * i for i in range(rows)]
    for i, n in enumerate(lengths):
        batch.add(*row(i, n))
    for _ in range(3):
        batch.step()
    step_s = []
    for _ in range(steps):
        t = time.perf_counter()
        batch.step()
        step_s.append(time.perf_counter() - t)
    join_s, leave_s = [], []
    for k in range(3):
        newcomer = row(rows + k, context + 200)
        t = time.perf_counter()
        batch.add(*newcomer)
        batch.step()
        join_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        batch.remove(f"r{k}")
        batch.step()
        leave_s.append(time.perf_counter() - t)
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
