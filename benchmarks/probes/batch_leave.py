"""What one request leaving a padded decode batch costs: mlx-lm's BatchKVCache
against Tandem's RunsBatchKVCache (workers/kernels/slot_batch_cache.py, what decode
workers use on a GPU).

For each kind, `rows` rows of random KV (row i holds context + 37*i tokens)
decode a few steps; then rows leave one at a time (the shortest, the
longest, one in the middle) and it times the filter (with a sync) and the
next two steps. The step after dropping the longest row is where a trimmed
view used to make the step copy the whole batch.

    python benchmarks/probes/batch_leave.py --model /tmp/q3 --rows 32
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from benchmarks.probes.decode_batch import filled_cache
from workers.decode.shifted_rope import ShiftedKVCache
from workers.models.loading import load_model, size_buffer_cache
from workers.models.store import resolve_model


def _sync(gen) -> None:
    batch = gen._generation_batch
    mx.eval([c.state for c in batch.prompt_cache])
    mx.eval(batch._next_tokens)


def _ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def run(model, kind: str, rows: int, context: int, repeats: int) -> None:
    wrap = (lambda c: ShiftedKVCache.of(c, 0)) if kind == "runs" else (lambda c: c)
    gen = BatchGenerator(model, completion_batch_size=rows + 8, prefill_batch_size=rows + 8)
    caches = [wrap(filled_cache(model, context + 37 * i, None, i)) for i in range(rows)]
    uids = gen.insert([[5]] * rows, max_tokens=[100_000] * rows, caches=caches)
    for _ in range(4):
        gen.next_generated()
    _sync(gen)
    _ms(lambda: gen.remove([uids.pop(0)]))  # first filter compiles its kernels
    _sync(gen)
    steps = [_ms(lambda: (gen.next_generated(), _sync(gen))) for _ in range(5)]
    print(f"| {kind} | a step | {sorted(steps)[2]:.1f} ms | | |")
    for where, label in ((0, "shortest"), (-1, "longest"), (rows // 3, "middle")):
        for _ in range(repeats):
            uid = uids.pop(where)
            drop = _ms(lambda: (gen.remove([uid]), _sync(gen)))
            after = [_ms(lambda: (gen.next_generated(), _sync(gen))) for _ in range(2)]
            print(f"| {kind} | drop the {label} row | {drop:.1f} ms | {after[0]:.1f} ms | {after[1]:.1f} ms |")
    gen.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder or id (default: the embedded model)")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=1300)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    model, _ = load_model(str(resolve_model(args.model)))
    size_buffer_cache()
    print("| batch KV | what | filter + sync | next step | the step after |")
    print("|---|---|---|---|---|")
    for kind in ("runs", "mlx-lm"):
        run(model, kind, args.rows, args.context, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
