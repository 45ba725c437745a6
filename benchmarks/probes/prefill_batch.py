"""A burst of prompts over one cached prefix: prefilled one by one, or as one batch.

What workers/prefill/batch.py is for: a swarm's agents send their next turns
together, each a shared system prompt and its own history (cached) plus ~65
new tokens. This times, in one process with no cache service, R rows of
P cached + N new tokens each: every row's prefix is a copy of one computed
prefix (as the prefix cache would load it), then the rows are prefilled
  * alone: PrefillJob.step() each, as the worker did before batching;
  * batched: workers.prefill.batch.run_batch over groups of `--rows`.
Both include sampling the first token; neither includes loading the prefix
or the handoff. Prints ms per prompt for each, and their ratio, after the
first passes of each batch size (what a new process pays per new shape).

    python -m benchmarks.probes.prefill_batch --model DIR [--prefix 1500 --new 65 --prompts 32 --rows 8 16 32]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from protos.messages import SamplingParams
from workers.models.loading import load_model
from workers.prefill.batch import run_batch
from workers.prefill.engine import PrefillEngine


def _ids(n: int, seed: int) -> list[int]:
    return [10 + (i * 7919 + seed * 104729) % 1000 for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prefix", type=int, default=1500, help="cached tokens per prompt")
    ap.add_argument("--new", type=int, default=65, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32], help="batch sizes to time")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    engine = PrefillEngine(model, chunk_size=1 << 20)  # one chunk a prompt, whatever its length
    system = _ids(args.prefix, 0)
    base = make_prompt_cache(model)
    model(mx.array([system]), cache=base)
    mx.eval([c.state for c in base])
    greedy = SamplingParams(max_tokens=1, temperature=0.0)

    def jobs(count: int, seed: int, new: int) -> list:
        out = []
        for i in range(count):
            job = engine.start(system + _ids(new, seed * 1000 + i + 1), greedy)
            prefix = []
            for c in base:  # the prefix as the prefix cache loads it: arrays of its own
                k = KVCache()
                k.state = (mx.array(c.keys[..., :c.offset, :]), mx.array(c.values[..., :c.offset, :]), c.offset)
                prefix.append(k)
            mx.eval([k.state for k in prefix])
            job.load(cached=(prefix, args.prefix))
            out.append(job)
        return out

    def alone(js) -> None:
        for j in js:
            while j.step() is None:
                pass

    def batched(rows: int):
        def run(js) -> None:
            for i in range(0, len(js), rows):
                run_batch(js[i:i + rows])
        return run

    def timed(fn, seed: int, new: int = args.new, count: int = args.prompts) -> float:
        js = jobs(count, seed, new)
        mx.synchronize()
        t0 = time.perf_counter()
        fn(js)
        mx.synchronize()
        return (time.perf_counter() - t0) * 1000 / count

    ways = [("alone", alone, 1)] + [(f"batch of {r}", batched(r), r) for r in args.rows]
    # A new process's first pass of each shape pays set-up (kernels, plans):
    # the first batch of each size, then the same size with one more new token.
    print("first passes (ms a prompt): a new batch size, then a new length")
    for name, fn, rows in ways:
        print(f"  {name:12s} {timed(fn, 90, count=rows):8.2f} {timed(fn, 91, args.new + 1, rows):8.2f}")
    for _, fn, _ in ways:  # warm-up: every shape once
        timed(fn, 99)
    best = {name: min(timed(fn, s) for s in range(args.repeats)) for name, fn, _ in ways}
    print(f"{args.prompts} prompts of {args.prefix} cached + {args.new} new tokens, {mx.default_device()}:")
    for name, ms in best.items():
        print(f"  {name:12s} {ms:8.2f} ms a prompt   {best['alone'] / ms:5.2f}x")


if __name__ == "__main__":
    main()
