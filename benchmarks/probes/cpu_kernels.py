"""What Tandem changes on MLX's CPU backend, each against MLX's own, in one process:

  * SwiGLU over a prefill's MLP activations: mlx-lm's `swiglu` (MLX's scalar
    exp) vs workers/kernels/cpu_math.py's silu_mul;
  * BatchGenerator's logsumexp over the vocabulary for a 16-row decode step;
  * the embedded model's prefill of 130 and 512 tokens with MLX's default
    buffer cache (32 MB) and with workers/models/loading.py's CPU_BUFFER_CACHE.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/probes/cpu_kernels.py
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import make_prompt_cache

from workers.kernels import cpu_math, mlx_hooks
from workers.models.loading import CPU_BUFFER_CACHE, load_model
from workers.models.store import resolve_model


def best_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> int:
    model, _ = load_model(str(resolve_model(None)))
    mlx_hooks.install(model)
    hidden = model.layers[0].mlp.gate_proj.weight.shape[0]
    layers = len(model.layers)
    print("| what | MLX's own | Tandem's |")
    print("|---|---|---|")
    gate, up = mx.random.normal((1, 130, hidden)) * 4, mx.random.normal((1, 130, hidden))
    print(f"| SwiGLU, 130 tokens x {layers} layers | {best_ms(lambda: swiglu(gate, up)) * layers:.1f} ms "
          f"| {best_ms(lambda: cpu_math.silu_mul(gate, up)) * layers:.1f} ms |")
    logits = mx.random.normal((16, model.args.vocab_size)) * 5
    print(f"| logsumexp, 16 rows x {model.args.vocab_size} | "
          f"{best_ms(lambda: mx.logsumexp(logits, axis=-1, keepdims=True)):.2f} ms "
          f"| {best_ms(lambda: cpu_math.logsumexp(logits, axis=-1, keepdims=True)):.2f} ms |")
    for tokens in (130, 512):
        prompt = mx.array([list(range(100, 100 + tokens))])

        def prefill():
            cache = make_prompt_cache(model)
            model(prompt, cache=cache)
            return [c.state for c in cache]

        times = []
        for limit in (32 << 20, CPU_BUFFER_CACHE):
            mx.set_cache_limit(limit)
            mx.clear_cache()
            times.append(best_ms(prefill, repeats=3))
        print(f"| prefill of {tokens} tokens, buffer cache 32 MB vs {CPU_BUFFER_CACHE >> 20} MB "
              f"| {times[0]:.0f} ms | {times[1]:.0f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
