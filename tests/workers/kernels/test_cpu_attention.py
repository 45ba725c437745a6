"""workers/kernels/cpu_attention.py against MLX's own attention."""

from __future__ import annotations

import mlx.core as mx
import pytest

from workers.kernels import cpu_attention


@pytest.mark.parametrize("n,length,heads,kv_heads", [(1, 700, 9, 3), (37, 300, 9, 3), (64, 64, 4, 4), (5, 90, 8, 2)])
@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_matches_mlx(n, length, heads, kv_heads, mask):
    k0, k1, k2 = mx.random.split(mx.random.key(n + length), 3)
    q = mx.random.normal((2, heads, n, 32), key=k0)
    k = mx.random.normal((2, kv_heads, length, 32), key=k1)
    v = mx.random.normal((2, kv_heads, length, 32), key=k2)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.17, mask=mask)
    got = cpu_attention.attention(q, k, v, 0.17, mask)
    assert got.shape == ref.shape
    assert mx.allclose(got, ref, atol=2e-6, rtol=1e-5).item()


def test_masked_positions_get_exactly_zero_weight():
    scores = mx.array([[0.0, 5.0, 1.0, 100.0]])
    keep = mx.array([[True, True, True, False]])
    e, total = cpu_attention.softmax_weights(mx.where(keep, scores, -mx.inf))
    probs = e / total
    assert probs[0, 3].item() == 0.0
    assert abs(probs.sum().item() - 1.0) < 1e-6
    assert mx.allclose(probs[:, :3], mx.softmax(scores[:, :3], axis=-1)).item()


def test_other_masks_and_dtypes_are_left_to_mlx():
    q = mx.zeros((1, 2, 3, 8))
    kv = mx.zeros((1, 2, 5, 8))
    assert cpu_attention.attention(q, kv, kv, 1.0, mx.ones((3, 5), dtype=mx.bool_)) is None
    assert cpu_attention.attention(q.astype(mx.float16), kv.astype(mx.float16), kv.astype(mx.float16), 1.0, None) is None


def test_prompt_attention_over_a_cache_buffer_view():
    """Keys and values as a KV cache hands them over: views of a larger
    buffer. A prompt's softmax goes through numpy here (enough scores), which
    reads MLX's buffers in place."""
    n, length = 40, 700
    k0, k1, k2 = mx.random.split(mx.random.key(7), 3)
    q = mx.random.normal((1, 9, n, 64), key=k0)
    kbuf, vbuf = mx.random.normal((1, 3, 1024, 64), key=k1), mx.random.normal((1, 3, 1024, 64), key=k2)
    k, v = kbuf[..., :length, :], vbuf[..., :length, :]
    assert 3 * 3 * n * length >= cpu_attention.NUMPY_MIN_SCORES
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = cpu_attention.attention(q, k, v, 0.125, "causal")
    assert mx.allclose(got, ref, atol=2e-6, rtol=1e-5).item()
