"""What a speculative step costs against an ordinary one, by batch size.

A speculative step runs every row of the decode batch over its input and up
to k drafts (workers/kernels/verify_step.py): k + 1 positions a row instead
of one. While a step is bound by reading the weights (one row, a few rows)
the extra positions are nearly free; once the batch is large the step is
bound by arithmetic and costs about (k + 1) times as much, more than the
kept drafts save. This times the decode engine's own batch (the ragged rows
on the CPU, the padded slot batch on a GPU) for B rows of L cached tokens
and T = 1, 3, 5, 9 positions a row, and prints each T's cost over T = 1's:
speculation pays while a row keeps more than that ratio minus one drafts a
step. `--spec-max-batch`'s default is where that stops being likely.

    python -m benchmarks.probes.spec_step_cost [--model DIR] [--rows 1 2 4 8 16] [--context 512]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from environment.backend import on_cpu
from workers.decode import ragged_kv
from workers.decode.shifted_rope import ShiftedKVCache
from workers.kernels import mlx_hooks
from workers.models.loading import load_model
from workers.models.store import resolve_model


def _batch_cache(model, rows: int, context: int):
    """A decode batch's per-layer caches: `rows` requests of `context` tokens each."""
    ragged = mlx_hooks.install(model) and on_cpu()
    per_row = []
    for r in range(rows):
        cache = make_prompt_cache(model)
        model(mx.array([[(7 * r + i) % 1000 + 10 for i in range(context)]]), cache=cache)
        mx.eval([c.state for c in cache])
        per_row.append(ragged_kv.rows_of(cache) if ragged else ShiftedKVCache.of(cache, 0))
    return [type(layer[0]).merge(list(layer)) for layer in zip(*per_row)]


def _time(model, cache, rows: int, width: int, repeats: int) -> float:
    inputs = mx.array([[11 + j for j in range(width)] for _ in range(rows)], dtype=mx.uint32)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        logits = model(inputs, cache=cache)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
        for c in cache:
            c.trim_rows([width] * rows)
    return sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="as `tandem serve --model` takes it (default: the embedded model)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 3, 5, 9], help="positions a row (1 + drafts)")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per row")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model, _ = load_model(resolve_model(args.model))
    print(f"{'rows':>4}  " + "  ".join(f"T={w:<2} ms" for w in args.widths) + "  " +
          "  ".join(f"T={w}/T=1" for w in args.widths[1:]))
    for rows in args.rows:
        cache = _batch_cache(model, rows, args.context)
        ms = [1000 * _time(model, cache, rows, w, args.repeats) for w in args.widths]
        print(f"{rows:>4}  " + "  ".join(f"{m:8.1f}" for m in ms) + "  " +
              "  ".join(f"{m / ms[0]:7.2f}x" for m in ms[1:]), flush=True)


if __name__ == "__main__":
    main()
