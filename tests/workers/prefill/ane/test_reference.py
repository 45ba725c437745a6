"""The NumPy reference of the chunk contract (workers/prefill/ane/reference.py)
against MLX's own prefill of the same tokens: tiny llama, tiny qwen3 (q/k
norms), a tiny llama with attention biases and the embedded model (interleaved, "traditional" rope). A prompt of
Q + m tokens runs as a first chunk over an empty cache and a second, padded
to Q, over the first's KV (pos = Q > 0), with garbage in every cache slot and
padded row the mask must hide.

Errors are relative: max |ours - MLX| / max |MLX| per tensor (coreai_mlx.relative).
Tolerances:
- "fp32" with the model's weights rounded to float16 in MLX too (so both
  compute the same function): the first chunk's hidden states agree to
  float32 rounding (1e-5; measured <= 1e-6); its k and v are kept in the
  contract's float16 cache, one rounding (at most 2^-11 ~ 4.9e-4 relative;
  6e-4); later rows read that float16 cache (2e-3; measured <= 4e-4),
  logits likewise.
- "fp16" (every intermediate rounded to float16, a model of the Neural
  Engine): ~10 roundings a layer, compounding over up to 30 layers: 1.5e-2
  (measured <= 7e-3); the greedy token must not change.
- "fp16acc" (dot products summed in float16 term by term, as Core AI's CPU
  runtime does): 3e-2 (measured <= 3e-3 on the tiny models; on the embedded
  model it runs ~1 min, so only the tiny ones here).
These separate layout errors (rope pairs, head order, GQA groups, masks: all
O(1) relative) from rounding by orders of magnitude.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.support.ane import fp16_weights, tiny
from workers.prefill.ane.contract import Bucket
from workers.prefill.ane.coreai_mlx import prefill_differences
from workers.prefill.ane.reference import ReferenceRunner, attention_mask, rope, run_chunk
from workers.prefill.ane.weights import body_weights

TOLERANCE = {
    "fp32": {"h_first": 1e-5, "k_first": 6e-4, "v_first": 6e-4, "k_rest": 2e-3, "v_rest": 2e-3, "h_rest": 2e-3,
             "logits": 2e-3},
    "fp16": dict.fromkeys(("h_first", "k_first", "v_first", "k_rest", "v_rest", "h_rest", "logits"), 1.5e-2),
    "fp16acc": dict.fromkeys(("h_first", "k_first", "v_first", "k_rest", "v_rest", "h_rest", "logits"), 3e-2),
}
TINY_BUCKET = Bucket(8, 32)
EMBEDDED_BUCKET = Bucket(16, 64)


def check(diffs: dict, precision: str) -> None:
    print(precision, {k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in diffs.items()})
    limit = TOLERANCE[precision]
    for name, value in diffs.items():
        if name != "same_token":
            bound = limit[name]
            assert value <= bound, f"{precision} {name}: {value:.3e} > {bound:.0e} ({diffs})"
    assert diffs["same_token"], diffs


def reference_differences(model, tokens, bucket, precision: str) -> dict:
    weights = body_weights(model, bucket.cache + bucket.chunk)
    runner = ReferenceRunner(weights, precision)
    return prefill_differences(runner, model, tokens, weights.config, bucket, garbage=100.0)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "fp16acc"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "llama_bias"])
def test_reference_matches_mlx_on_tiny_models(tmp_path, model_type, precision):
    model = tiny(tmp_path / model_type, model_type)
    tokens = mx.random.randint(0, 512, (TINY_BUCKET.chunk + 5,), key=mx.random.key(1)).tolist()
    with fp16_weights(model):
        check(reference_differences(model, tokens, TINY_BUCKET, precision), precision)


@pytest.mark.parametrize("precision", ["fp16"])  # fp32: the Core AI program's embedded test covers it
def test_reference_matches_mlx_on_the_embedded_model(embedded_model, precision):
    model, tokenizer = embedded_model
    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then the fox runs into the woods.")
    tokens = tokens[:EMBEDDED_BUCKET.chunk + 9]
    assert len(tokens) > EMBEDDED_BUCKET.chunk
    with fp16_weights(model):
        check(reference_differences(model, tokens, EMBEDDED_BUCKET, precision), precision)


def test_a_wrong_layout_is_caught(tmp_path):
    """The check can fail: rotating halves where the model rotates pairs
    (the embedded model's traditional rope) or the reverse is far outside it."""
    model = tiny(tmp_path / "llama", "llama")
    tokens = list(range(3, 3 + TINY_BUCKET.chunk + 5))
    weights = body_weights(model, TINY_BUCKET.cache + TINY_BUCKET.chunk)
    weights.config.rope_traditional = not weights.config.rope_traditional

    def run(x, pos, k_cache, v_cache):
        return run_chunk(weights, x, pos, k_cache, v_cache)

    with fp16_weights(model):
        diffs = prefill_differences(run, model, tokens, weights.config, TINY_BUCKET)
    assert diffs["h_first"] > 1000 * TOLERANCE["fp32"]["h_first"], diffs


def test_mask_and_rope_pieces():
    mask = attention_mask(pos=2, chunk=3, cache=4)
    assert mask.tolist() == [[True, True, False, False, True, False, False],
                             [True, True, False, False, True, True, False],
                             [True, True, False, False, True, True, True]]
    x = np.array([[1.0, 2.0, 3.0, 4.0]])
    cos, sin = np.array([[0.0, 1.0]]), np.array([[1.0, 0.0]])  # pair 0 turned 90 degrees, pair 1 kept
    assert rope(x, cos, sin, traditional=True).tolist() == [[-2.0, 1.0, 3.0, 4.0]]
    assert rope(x, cos, sin, traditional=False).tolist() == [[-3.0, 2.0, 1.0, 4.0]]
