"""Two processes on one GPU, as the split layout runs them: does a decode
step slow down while another process prefills?

A decode worker's step on an H100 is MLX's host work (~840 kernels queued one
by one; docs/benchmarks-log.md, session 15), and the GPU itself idles most of the
time. Two processes' kernels still do not run side by side on one GPU: the
driver gives each process's context its own time slices. This measures, each
role in a child process of its own, over the same seconds:
  * decode: Tandem's DecodeEngine stepping `--rows` rows of `--context`+
    tokens (medians of its steps, ms);
  * prefill: a forward pass of `--new` tokens over `--context` cached ones,
    then its last token's logits (what a follow-up turn's prefill does);
first each alone, then both at once.

    python benchmarks/probes/gpu_share.py --model /tmp/q3 [--rows 24] [--context 1200] [--new 130]
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


def _decode(model, args, until: float) -> list:
    from benchmarks.probes.decode_batch import _TandemBatch, filled_cache

    batch = _TandemBatch(model, args.rows, ragged=False)
    for i in range(args.rows):
        n = args.context + 37 * i
        batch.add(f"r{i}", list(range(n)), filled_cache(model, n, None, i))
    for _ in range(5):
        batch.step()
    times = []
    while time.perf_counter() < until:
        t = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - t)
    return times


def _prefill(model, args, until: float) -> list:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 1000, (1, args.context)), cache=cache))
    new = mx.random.randint(0, 1000, (1, args.new))
    times = []
    while time.perf_counter() < until:
        t = time.perf_counter()
        mx.eval(model(new, cache=cache)[:, -1, :].argmax(-1))
        times.append(time.perf_counter() - t)
        for c in cache:
            c.offset -= args.new  # the same context every pass
    return times


def child(args) -> dict:
    from workers.models.loading import load_model, set_cuda_graphs, size_buffer_cache

    set_cuda_graphs()  # as every worker does
    model, _ = load_model(args.model)
    size_buffer_cache()
    run = _decode if args.child == "decode" else _prefill
    run(model, args, time.perf_counter() + 2.0)  # warm: shapes met once
    print("READY", flush=True)
    sys.stdin.readline()  # the parent starts every child at once
    times = run(model, args, time.perf_counter() + args.seconds)
    return {"role": args.child, "passes": len(times), "median_ms": round(statistics.median(times) * 1000, 2),
            "p90_ms": round(sorted(times)[int(len(times) * 0.9)] * 1000, 2)}


def together(args, roles) -> list:
    argv = [sys.executable, __file__, "--model", args.model, "--rows", str(args.rows), "--context",
            str(args.context), "--new", str(args.new), "--seconds", str(args.seconds)]
    procs = [subprocess.Popen(argv + ["--child", r], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ)) for r in roles]
    for p in procs:  # each has loaded and warmed up
        while not p.stdout.readline().startswith("READY"):
            if p.poll() is not None:
                raise RuntimeError(f"a {roles} child exited with {p.returncode}")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=args.seconds + 300)
        line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        out.append(json.loads(line[0][7:]) if line else {"error": p.returncode})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--context", type=int, default=1200)
    ap.add_argument("--new", type=int, default=130)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--child", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT", json.dumps(child(args)), flush=True)
        return
    for roles in (["decode"], ["prefill"], ["decode", "prefill"]):
        print(" + ".join(roles), json.dumps(together(args, roles)), flush=True)


if __name__ == "__main__":
    main()
