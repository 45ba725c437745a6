"""workers/kernels/cuda_attention.py: a prefill's attention on MLX's CUDA backend
without cuDNN. For float32 inputs it must compute exactly what MLX computes
where no fused kernel applies (on this CPU, MLX's own attention for several
queries is that computation: compared bit for bit); for half precision it
keeps the scores in float32, so it must be closer to exact attention than
that fallback (written out here with MLX's ops: on a CUDA device
`mx.fast.scaled_dot_product_attention` would take cuDNN's fused kernel
instead, which keeps its scores in float32 too). The routing through workers/kernels/mlx_hooks.py is tested with the
backend check answering "CUDA" (the CUDA kernels themselves cannot run on
this machine)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tests.support.tiny_models import load_tiny_model, make_tiny_llama
from workers.kernels import cuda_attention, mlx_hooks


SHAPES = [
    (16, 8, 65, 1537, "causal"),  # a follow-up turn after a cached picture (Qwen2.5-VL-3B's heads)
    (9, 3, 31, 895, "causal"),  # a warm chat turn
    (4, 4, 7, 7, "causal"),  # a whole short prompt
    (8, 2, 5, 40, None),
]


def _qkv(heads, kv_heads, n, length, dtype, spread=1.0):
    k0, k1, k2 = mx.random.split(mx.random.key(n), 3)
    q = (mx.random.normal((1, heads, n, 64), key=k0) * spread).astype(dtype)
    k = (mx.random.normal((1, kv_heads, length, 64), key=k1) * spread).astype(dtype)
    v = mx.random.normal((1, kv_heads, length, 64), key=k2).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads,n,length,mask", SHAPES)
def test_float32_equals_mlx_bit_for_bit(heads, kv_heads, n, length, mask):
    q, k, v = _qkv(heads, kv_heads, n, length, mx.float32)
    got = cuda_attention.attention(q, k, v, 0.125, mask)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert got.dtype == ref.dtype and mx.array_equal(got, ref).item()


def _exact(q, k, v, scale, mask):
    """Attention in float64 (numpy) over the same rounded inputs."""
    q, k, v = (np.array(a.astype(mx.float32), dtype=np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if mask == "causal":
        n, total = q.shape[2], k.shape[2]
        s = np.where(np.arange(total - n, total)[:, None] >= np.arange(total)[None], s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def _fallback(q, k, v, scale, mask):
    """MLX's attention where no fused kernel applies: scores in the inputs'
    dtype, masked, a precise softmax, then the values."""
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q * mx.array(scale, q.dtype)) @ k.swapaxes(-1, -2)
    if mask == "causal":
        n, total = q.shape[2], k.shape[2]
        s = mx.where(mx.arange(total - n, total)[:, None] >= mx.arange(total)[None], s,
                     mx.array(-mx.inf, s.dtype))
    return mx.softmax(s, axis=-1, precise=True) @ v


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("heads,kv_heads,n,length,mask", SHAPES)
def test_half_precision_scores_stay_float32(dtype, heads, kv_heads, n, length, mask):
    # Spread 2.5: scores of ~10, as trained models' are, where bfloat16 scores lose the weights' precision.
    q, k, v = _qkv(heads, kv_heads, n, length, dtype, spread=2.5)
    got = cuda_attention.attention(q, k, v, 0.125, mask)
    fallback = _fallback(q, k, v, 0.125, mask)
    exact = _exact(q, k, v, 0.125, mask)
    err = lambda out: float(np.abs(np.array(out.astype(mx.float32), dtype=np.float64) - exact).max())  # noqa: E731
    rounded = mx.array(exact.astype(np.float32)).astype(dtype)  # the best a result in `dtype` can be
    assert got.dtype == dtype
    assert err(got) < err(fallback)  # (up to 8x here: scores rounded to 8 bits before the softmax)
    assert err(got) <= 3 * err(rounded)


def test_one_query_array_masks_and_large_scores_are_left_to_mlx():
    q, kv = mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 5, 8))
    assert cuda_attention.attention(q[:, :, :1], kv, kv, 1.0, None) is None  # decode: MLX's vector kernel
    assert cuda_attention.attention(q, kv, kv, 1.0, mx.ones((3, 5), dtype=mx.bool_)) is None
    big = mx.zeros((1, 8, 1024, 8))
    long_kv = mx.zeros((1, 8, cuda_attention.MAX_SCORES // (8 * 1024) + 1, 8))
    assert cuda_attention.attention(big, long_kv, long_kv, 1.0, "causal") is None


@pytest.fixture
def as_if_cuda(monkeypatch):
    """mlx_hooks' backend check answers "CUDA" (what runs is still the CPU)."""
    monkeypatch.setattr(mlx_hooks, "on_cpu", lambda: False)
    monkeypatch.setattr(mlx_hooks, "on_cuda", lambda: True)
    yield
    monkeypatch.undo()
    mlx_hooks._set_backend()  # back to this machine's own


def test_on_cuda_a_prefill_takes_it_and_decode_does_not(as_if_cuda, tmp_path, monkeypatch):
    model = load_tiny_model(make_tiny_llama(tmp_path, seed=1))
    assert mlx_hooks.install(model) and mlx_hooks._CUDA["on"] and not mlx_hooks._CPU["on"]
    took = []
    real = cuda_attention.attention
    monkeypatch.setattr(cuda_attention, "attention", lambda *a: took.append(real(*a)) or took[-1])
    layers = len(model.layers)
    cache = make_prompt_cache(model)
    logits = model(mx.arange(1, 41)[None], cache=cache)  # a 40-token prompt
    assert len(took) == layers and all(t is not None for t in took)
    model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)  # one decode step: MLX's kernel
    assert len(took) == 2 * layers and all(t is None for t in took[layers:])
    # The same logits as MLX's own attention.
    monkeypatch.setenv("TANDEM_CUDNN_PREFILL", "1")
    mlx_hooks.install(model)
    assert not mlx_hooks._CUDA["on"]
    again = model(mx.arange(1, 41)[None], cache=make_prompt_cache(model))
    assert mx.array_equal(logits, again).item() and len(took) == 2 * layers
