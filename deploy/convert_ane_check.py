"""`tandem convert-ane --check`: a converted prefill against MLX's on one
prompt, for each runner this machine has: the NumPy reference with float16
rounding (what any fp16 program computes, roughly), Core AI's CPU runtime
(Linux x86-64, macOS 26+; its fp32 build: the program's structure, not its
fp16 arithmetic, which that runtime runs ~100x slower), and on a Mac the
converted Core ML package itself. Prints the relative differences of the
KV, the hidden states and the last logits, and where greedy decoding after
the converted prefill first differs from decoding after MLX's (none: same).
"""

from __future__ import annotations

import sys
import tempfile

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from environment.settings import default_cache_dir
from workers.prefill.ane.bridge import AneBody
from workers.prefill.ane.coreai_mlx import greedy_decode, prefill_differences


def _runners(weights, bucket, model_dir=None):
    """(name, runner) for each way this machine can run the chunk."""
    from workers.prefill.ane.reference import ReferenceRunner

    yield "reference, fp16 rounding", ReferenceRunner(weights, "fp16")
    try:
        import coreai  # noqa: F401
    except ImportError:
        print("Core AI: not installed here (coreai-core: Linux x86-64, macOS 26+)")
    else:
        from workers.prefill.ane.coreai_runner import CoreAIChunkRunner

        scratch = tempfile.mkdtemp(prefix="tandem-ane-check-")
        yield "Core AI runtime, fp32 build", CoreAIChunkRunner(weights, bucket, f"{scratch}/check.aimodel",
                                                                compute="fp32", rebuild=True)
    if sys.platform == "darwin" and model_dir is not None:
        from workers.prefill.ane.backend import COREML_PACKAGE
        from workers.prefill.ane.coreml_runner import CoreMLChunkRunner
        from workers.prefill.ane.packages import PackageStore

        path = PackageStore(default_cache_dir(), model_dir).path("coreml", COREML_PACKAGE)
        if path.exists():
            yield "Core ML, this Mac (CPU_AND_NE)", CoreMLChunkRunner(path, bucket)


def greedy_after(model, run, weights, bucket, tokens: list, steps: int) -> list[int]:
    cfg = weights.config
    body = AneBody(model, lambda b: run, [bucket], cfg.kv_heads, cfg.head_dim)
    cache = make_prompt_cache(model)
    logits = body.last_logits(mx.array(tokens, dtype=mx.int32)[None], cache)
    return greedy_decode(model, cache, int(mx.argmax(logits[0])), steps)


def check(model, tokenizer, weights, bucket, prompt: str, steps: int, model_dir=None) -> list[dict]:
    tokens = tokenizer.encode(prompt)[: min(bucket.chunk + bucket.chunk // 2, bucket.cache - bucket.chunk)]
    cache = make_prompt_cache(model)
    logits = model(mx.array(tokens, dtype=mx.int32)[None], cache=cache)[:, -1, :]
    expected = greedy_decode(model, cache, int(mx.argmax(logits[0])), steps)
    print(f"Prompt of {len(tokens)} tokens in chunks of {bucket.chunk} over a cache of {bucket.cache}; "
          f"relative differences (max |ours - MLX| / max |MLX|), {steps + 1} greedy tokens after")
    print(f"{'runner':34} {'k':>9} {'v':>9} {'h':>9} {'logits':>9}  tokens")
    rows = []
    for name, run in _runners(weights, bucket, model_dir):
        d = prefill_differences(run, model, tokens, weights.config, bucket)
        ours = greedy_after(model, run, weights, bucket, tokens, steps)
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, expected)) if a != b), None)
        k = max(v for key, v in d.items() if key.startswith("k_"))
        v = max(v for key, v in d.items() if key.startswith("v_"))
        h = max(v for key, v in d.items() if key.startswith("h_"))
        said = "same" if first_diff is None else f"differ from token {first_diff}"
        print(f"{name:34} {k:9.2e} {v:9.2e} {h:9.2e} {d['logits']:9.2e}  {said}")
        rows.append({"runner": name, "k": k, "v": v, "h": h, "logits": d["logits"], "first_difference": first_diff})
    return rows
