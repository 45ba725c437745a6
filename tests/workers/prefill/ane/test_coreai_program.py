"""The chunk program built with coreai-core (workers/prefill/ane/coreai_program.py)
and run by the wheel's Linux CPU runtime (coreai_runner.py): its declared
inputs and outputs, its numerics against the NumPy reference and against
MLX's prefill, and greedy decode after it through the KV bridge (bridge.py).

Two builds: compute "fp16" (what the Neural Engine runs) and "fp32" (float32
between the same float16 inputs, outputs and weights). The CPU runtime sums
a float16 matmul one term at a time in float16 (reference.py's "fp16acc"),
~100x slower than float32 and ~1e-2 relative per long dot product; so the
embedded model (30 layers) runs here in "fp32" (~2 s a chunk; "fp16" takes
~2 min a chunk, measured once and reported, not run in CI).

Errors are relative (coreai_mlx.relative: max |ours - theirs| / max |theirs|).
Tolerances, against MLX with the model's weights rounded to float16 (so both
compute the same function):
- "fp32": the outputs are float16 (one rounding, at most 2^-11 ~ 4.9e-4
  relative): 6e-4 on the first chunk, 2e-3 after it (it reads a float16
  cache) and on the logits. Measured <= 5.5e-4 (tiny and embedded); against
  the reference's "fp32" (rounded to float16 too: one ulp, 2^-10 ~ 9.8e-4,
  apart at most) 1.2e-3, measured <= 6.4e-4.
- "fp16": float16 accumulation compounds over the layers: 3e-2 (measured
  <= 3e-3 on the tiny models; the embedded model, run once outside CI with
  its weights unrounded: <= 2.8e-2, the same greedy tokens); against the
  reference's "fp16acc" 2e-2 (measured <= 2.5e-3).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

# coreai-core's wheels are for Linux x86-64 and macOS 26+ on arm64 (pyproject.toml):
# elsewhere (macOS 15) Core AI does not exist and its checks cannot run.
pytest.importorskip("coreai", reason="coreai-core has no wheel for this platform (Linux x86-64, macOS 26+ only)")

from tests.support.ane import fp16_weights, tiny
from workers.prefill.ane.bridge import AneBody
from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.coreai_mlx import (chunked_prefill, greedy_decode, head_logits, mlx_prefill,
                                            prefill_differences, relative)
from workers.prefill.ane.coreai_program import OUTPUTS, io_shapes, save_program
from workers.prefill.ane.coreai_runner import CoreAIChunkRunner
from workers.prefill.ane.reference import ReferenceRunner
from workers.prefill.ane.weights import body_weights

TINY_BUCKET = Bucket(8, 32)
EMBEDDED_BUCKET = Bucket(16, 64)
PARTS = ("k_first", "v_first", "h_first", "k_rest", "v_rest", "h_rest")
TOLERANCE = {
    "fp32": {**dict.fromkeys(PARTS[:3], 6e-4), **dict.fromkeys(PARTS[3:], 2e-3), "logits": 2e-3},
    "fp16": dict.fromkeys(PARTS + ("logits",), 3e-2),
}
REFERENCE_OF = {"fp32": "fp32", "fp16": "fp16acc"}  # the reference precision a build should track
TO_REFERENCE = {"fp32": 1.2e-3, "fp16": 2e-2}  # fp32: both round to float16, at most one ulp (2^-10) apart
DECODE_STEPS = 16


def check(diffs: dict, compute: str) -> None:
    print(compute, {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in diffs.items()})
    for name, value in diffs.items():
        if name != "same_token":
            assert value <= TOLERANCE[compute][name], f"{compute} {name}: {value:.3e} ({diffs})"
    assert diffs["same_token"], diffs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny(tmp_path_factory.mktemp("llama"), "llama")


def test_program_declares_the_contract(tiny_llama, tmp_path):
    """The saved asset's one function and the loaded program's inputs and
    outputs: the contract's names, shapes and dtypes, no states."""
    weights = body_weights(tiny_llama, TINY_BUCKET.cache + TINY_BUCKET.chunk)
    asset = save_program(weights, TINY_BUCKET, tmp_path / "chunk.aimodel")
    summary = asset.summary()
    assert summary.function_names == ["main"]
    assert summary.function_states("main") == []
    ops = dict(summary.operation_distribution)
    assert ops["batch_matmul"] >= 7 * weights.config.layers  # 7 projections a layer, at least
    assert {"softmax", "gather_nd", "concat", "rsqrt"} <= ops.keys()
    storage = dict(summary.storage_types)
    params = sum(a.size for layer in weights.layers for a in layer.values()) + weights.final_norm.size
    assert storage["Float16"] >= params and storage.get("Float32", 0) < 16  # weights kept in float16
    with CoreAIChunkRunner(weights, TINY_BUCKET, asset.path) as runner:
        signature = runner.signature()
    expected = {name: (shape, np.dtype(dtype).name) for name, (shape, dtype) in
                io_shapes(weights.config, TINY_BUCKET).items()}
    assert signature == expected
    assert list(signature)[-3:] == list(OUTPUTS)
    assert expected["k_cache"][0] == (2, 2, 32, 16) and expected["k_new"][0] == (2, 2, 8, 16)


def test_runner_refuses_wrong_shapes(tiny_llama, tmp_path):
    weights = body_weights(tiny_llama, TINY_BUCKET.cache + TINY_BUCKET.chunk)
    with CoreAIChunkRunner(weights, TINY_BUCKET, tmp_path / "chunk.aimodel") as runner:
        (_, dtype), kv = runner.shapes["x"], runner.shapes["k_cache"][0]
        with pytest.raises(ValueError, match="x: shape"):
            runner(np.zeros((1, 4, 64), dtype), 0, np.zeros(kv, np.float16), np.zeros(kv, np.float16))
        with pytest.raises(ValueError, match="rope rows"):
            runner(np.zeros((1, 8, 64), dtype), 33, np.zeros(kv, np.float16), np.zeros(kv, np.float16))


@pytest.mark.parametrize("model_type, compute", [("llama", "fp32"), ("llama", "fp16"), ("qwen3", "fp32"),
                                                 ("qwen3", "fp16"), ("llama_bias", "fp32")])
def test_program_matches_reference_and_mlx_on_tiny_models(tmp_path, model_type, compute):
    """Two chunks (the second over the first's KV at pos = Q, padded to Q,
    garbage wherever the mask must not look) against the reference and MLX."""
    model = tiny(tmp_path / model_type, model_type)
    tokens = mx.random.randint(0, 512, (TINY_BUCKET.chunk + 5,), key=mx.random.key(1)).tolist()
    with fp16_weights(model):
        weights = body_weights(model, TINY_BUCKET.cache + TINY_BUCKET.chunk)
        with CoreAIChunkRunner(weights, TINY_BUCKET, tmp_path / "chunk.aimodel", compute=compute) as runner:
            ours = chunked_prefill(runner, model, tokens, weights.config, TINY_BUCKET, garbage=100.0)
            reference = chunked_prefill(ReferenceRunner(weights, REFERENCE_OF[compute]), model, tokens,
                                        weights.config, TINY_BUCKET, garbage=100.0)
            to_reference = [relative(a, b) for a, b in zip(ours, reference)]
            print(compute, "to the reference (k, v, h):", [f"{e:.2e}" for e in to_reference])
            assert max(to_reference) <= TO_REFERENCE[compute], to_reference
            check(prefill_differences(runner, model, tokens, weights.config, TINY_BUCKET, garbage=100.0), compute)


@pytest.fixture(scope="module")
def embedded_runner(embedded_model, tmp_path_factory):
    """The embedded model's program, compute "fp32", bucket (16, 64)."""
    model, _ = embedded_model
    weights = body_weights(model, EMBEDDED_BUCKET.cache + EMBEDDED_BUCKET.chunk)
    path = tmp_path_factory.mktemp("coreai") / f"smollm2_{EMBEDDED_BUCKET.name}.aimodel"
    with CoreAIChunkRunner(weights, EMBEDDED_BUCKET, path, compute="fp32") as runner:
        yield runner, weights


def test_program_matches_mlx_on_the_embedded_model(embedded_model, embedded_runner):
    """25 tokens in two chunks; MLX's weights rounded to float16 as the
    program's are (as workers load it, MLX holds the float32 dequantization
    of the GGUF's: measured 1.0e-3 on v and 6.8e-4 on the logits then)."""
    model, tokenizer = embedded_model
    runner, weights = embedded_runner
    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then the fox runs into the woods.")
    tokens = tokens[:EMBEDDED_BUCKET.chunk + 9]
    assert len(tokens) > EMBEDDED_BUCKET.chunk
    with fp16_weights(model):
        check(prefill_differences(runner, model, tokens, weights.config, EMBEDDED_BUCKET, garbage=100.0), "fp32")


def test_greedy_decode_after_the_program_prefill_matches_mlx(embedded_model, embedded_runner):
    """A chat prompt (several chunks) through the program and the KV bridge into
    mlx-lm caches in the model's dtype; the first token from MLX's head on
    the last row; then 16 greedy tokens decoded by MLX, against MLX's own
    prefill and decode."""
    model, tokenizer = embedded_model
    runner, weights = embedded_runner
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True)
    assert EMBEDDED_BUCKET.chunk < len(prompt) <= EMBEDDED_BUCKET.cache - EMBEDDED_BUCKET.chunk
    body = AneBody(model, lambda bucket: runner, [EMBEDDED_BUCKET], weights.config.kv_heads, weights.config.head_dim)
    cache = make_prompt_cache(model)
    first = int(mx.argmax(body.last_logits(mx.array([prompt]), cache)[0]).item())
    assert body.chunks == -(-len(prompt) // EMBEDDED_BUCKET.chunk) > 1 and cache[0].offset == len(prompt)
    ours = greedy_decode(model, cache, first, DECODE_STEPS)
    _, _, h, mlx_cache = mlx_prefill(model, prompt)
    theirs = greedy_decode(model, mlx_cache, int(head_logits(model, h[0, -1]).argmax()), DECODE_STEPS)
    print("program:", ours, repr(tokenizer.decode(ours)))
    print("mlx:    ", theirs, repr(tokenizer.decode(theirs)))
    assert ours == theirs
