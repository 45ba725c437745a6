"""Where a GPU decode step's time goes: building the graph in Python,
`mx.async_eval` (MLX encoding the kernels), and the wait for the device; and
a whole step of Tandem's DecodeEngine, per MLX setting, each in a child
process (MLX reads its variables once).

    python benchmarks/probes/decode_host.py --model /tmp/q3 [--rows 1,24] [--context 1200]

Each child prints one JSON line: for each row count, the plain mlx-lm
pass's medians (ms) of build / encode / wait over `--context` cached tokens,
and the engine's step (rows of context + 37*i tokens). docs/benchmarks-log.md,
session 15, has the H100's figures: there a step is MLX's host work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

SETTINGS = [{}, {"MLX_MAX_OPS_PER_BUFFER": "100"}, {"MLX_MAX_OPS_PER_BUFFER": "400"},
            {"MLX_MAX_OPS_PER_BUFFER": "2000", "MLX_MAX_MB_PER_BUFFER": "8000"}, {"MLX_USE_CUDA_GRAPHS": "0"}]


def child(model_dir: str, rows_list, context: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.probes.decode_batch import _TandemBatch, filled_cache
    from workers.models.loading import load_model, size_buffer_cache

    model, _ = load_model(model_dir)
    size_buffer_cache()
    out = {}
    for rows in rows_list:
        cache = make_prompt_cache(model)
        mx.eval(model.model(mx.random.randint(0, 1000, (rows, context)), cache=cache))
        x = mx.array([[5]] * rows)
        parts = []
        for i in range(40):
            t0 = time.perf_counter()
            logits = model(x, cache=cache)
            t1 = time.perf_counter()
            mx.async_eval(logits)
            t2 = time.perf_counter()
            mx.eval(logits)
            t3 = time.perf_counter()
            for c in cache:
                c.offset -= 1  # the same context every pass
            if i >= 10:
                parts.append((t1 - t0, t2 - t1, t3 - t2))
        build, encode, wait = (round(statistics.median(p[j] for p in parts) * 1000, 2) for j in range(3))
        out[f"plain {rows}"] = dict(build=build, encode=encode, wait=wait)
        del cache
        batch = _TandemBatch(model, rows, ragged=False)
        for i in range(rows):
            n = context + 37 * i
            batch.add(f"r{i}", list(range(n)), filled_cache(model, n, None, i))
        for _ in range(5):
            batch.step()
        steps = []
        for _ in range(30):
            t = time.perf_counter()
            batch.step()
            steps.append(time.perf_counter() - t)
        out[f"engine {rows}"] = round(statistics.median(steps) * 1000, 2)
        del batch
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", default="1,24")
    ap.add_argument("--context", type=int, default=1200)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print("RESULT", json.dumps(child(args.model, rows, args.context)), flush=True)
        return
    for setting in SETTINGS:
        r = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--rows", args.rows,
                            "--context", str(args.context)], env={**os.environ, **setting},
                           capture_output=True, text=True, timeout=600)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        print(setting or "default", line[0][7:] if line else r.stderr[-800:], flush=True)


if __name__ == "__main__":
    main()
