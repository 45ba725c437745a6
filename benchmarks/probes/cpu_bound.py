"""The most output tokens/s one level of `tandem bench --workload sweep` can
reach on this machine when prefill and decode take turns on its cores and
nothing else costs anything: each request's prefill alone, plus its share of
full decode steps alone, on the kernels every MLX server here runs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/probes/cpu_bound.py [--clients 16] [--max-tokens 64] [--bench sweep.json]

One level sends 2 x clients requests (closed loop), each a seeded 100-word
prompt (benchmarks/bench/workloads.py) answered with max_tokens tokens. Measured
here, in this process, medians:
  * prefill: a forward pass of one of those prompts and its first token's
    logits, as a prefill worker computes it (workers/kernels/mlx_hooks.py installed);
  * decode: one step of Tandem's DecodeEngine with `clients` rows at the
    prompts' length plus half an answer.
bound = requests x max_tokens / (requests x prefill + requests / clients x
max_tokens x step). With `--bench`, each system's measured tok/s at that
level is shown as a share of it: what a system's scheduling leaves on the
table, and how far above the peers any system can get.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
from benchmarks.bench.workloads import user_prompt  # noqa: E402
from workers.models.store import resolve_model  # noqa: E402


def measure(clients: int, max_tokens: int, prompt_words: int, repeats: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.probes import decode_batch
    from workers.kernels import mlx_hooks
    from workers.models.loading import load_model, size_buffer_cache

    model, tokenizer = load_model(resolve_model(None))
    size_buffer_cache()
    mlx_hooks.install(model)
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": user_prompt(0, f"sweep-c{clients}-client{i}-req0", prompt_words)}],
        add_generation_prompt=True) for i in range(repeats)]

    def prefill(ids) -> float:
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        mx.eval(model(mx.array(ids)[None], cache=cache)[:, -1, :])
        return time.perf_counter() - t

    prefill(prompts[0])  # first shapes
    prefill_s = statistics.median(prefill(ids) for ids in prompts)
    prompt_len = round(statistics.mean(len(ids) for ids in prompts))

    # Rows of the prompts' length plus half an answer, no prefix shared (as
    # in a sweep), in the CPU's decode batch (ragged rows).
    context = prompt_len + max_tokens // 2
    step_s = decode_batch.run("ragged", clients, context, 0, repeats, spread=0)["step_ms"] / 1000
    requests = 2 * clients
    work_s = requests * prefill_s + requests / clients * max_tokens * step_s
    return {"clients": clients, "requests": requests, "max_tokens": max_tokens, "prompt_tokens": prompt_len,
            "prefill_s": round(prefill_s, 4), "decode_step_s": round(step_s, 4), "work_s": round(work_s, 2),
            "bound_tok_s": round(requests * max_tokens / work_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--bench", help="a `tandem bench --workload sweep --json` file to compare with")
    args = ap.parse_args()
    out = measure(args.clients, args.max_tokens, args.prompt_words, args.repeats)
    print(json.dumps(out))
    if args.bench:
        for system in json.loads(Path(args.bench).read_text())["systems"]:
            for level in (system.get("results") or {}).get("sweep", []):
                if level["concurrency"] == args.clients:
                    tok_s = level.get("output_tok_s") or level.get("tok_s")
                    print(f"{system['name']}: {tok_s:.1f} tok/s, {tok_s / out['bound_tok_s']:.2f} of the bound")


if __name__ == "__main__":
    main()
