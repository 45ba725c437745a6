"""Measure MLX CPU speed with OpenBLAS preloaded versus the wheel's own BLAS.

    python benchmarks/probes/blas_preload.py [--repeats N]

Runs one child process per setting (a preload only takes effect at process
start), each loading the embedded SmolLM2-135M-Instruct the way Tandem does
on the CPU (dequantized to float32), then timing a 101-token prefill and a
64-token greedy decode. Prints one JSON line per setting and a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from deploy.blas import openblas_path
from workers.models.store import resolve_model

PROMPT_TOKENS = 101
DECODE_TOKENS = 64
TEXT = (
    "Disaggregated serving splits the prefill of a prompt from the decoding of "
    "its answer, so that a long prompt arriving does not stall every stream "
    "that is already producing tokens. "
)


def child(repeats: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from workers.models.loading import load_model

    t = time.perf_counter()
    model, tokenizer = load_model(resolve_model(None))
    load_s = time.perf_counter() - t

    ids = []
    while len(ids) < PROMPT_TOKENS:
        ids += tokenizer.encode(TEXT)
    prompt = mx.array(ids[:PROMPT_TOKENS])[None]

    def once():
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(prompt, cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        t1 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            token = mx.argmax(model(token[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.eval(token)
        return t1 - t0, time.perf_counter() - t1

    once()  # warm-up: first-call allocation and kernel set-up
    runs = [once() for _ in range(repeats)]
    prefill = min(r[0] for r in runs)
    decode = min(r[1] for r in runs)
    return {
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
        "load_s": round(load_s, 2),
        "prefill_s": round(prefill, 3),
        "prefill_tok_s": round(PROMPT_TOKENS / prefill, 1),
        "decode_s": round(decode, 3),
        "decode_tok_s": round(DECODE_TOKENS / decode, 1),
        "repeats": repeats,
    }


def parent(repeats: int) -> None:
    lib = openblas_path()
    if lib is None:
        sys.exit("OpenBLAS (libopenblas0-pthread) is not installed here; nothing to compare")
    base = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    settings = {
        "bundled BLAS": dict(base, TANDEM_NO_OPENBLAS="1"),
        "OpenBLAS preload": dict(base, LD_PRELOAD=lib),
    }
    print(f"# {platform.machine()} {platform.system()}, {os.cpu_count()} cores, python {platform.python_version()}")
    results = {}
    for name, env in settings.items():
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--repeats", str(repeats)],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[-1]
        results[name] = json.loads(out)
        print(name, out, flush=True)
    print(f"\n| setting | prefill {PROMPT_TOKENS} tok | decode {DECODE_TOKENS} tok |")
    print("|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['prefill_s']} s ({r['prefill_tok_s']} tok/s) | {r['decode_s']} s ({r['decode_tok_s']} tok/s) |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.repeats)))
    else:
        parent(a.repeats)
