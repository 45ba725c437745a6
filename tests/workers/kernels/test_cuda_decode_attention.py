"""workers/kernels/cuda_decode_attention.py: a padded decode batch's attention on
MLX's CUDA backend without mlx-lm's mask.

The CUDA kernels run only where MLX has a CUDA device: there they are
compared with MLX's own masked attention (`mx.fast.scaled_dot_product_attention`
with the left-padding mask) on strided views of padded buffers, as a decode
batch passes them. Everywhere, the routing through workers/kernels/mlx_hooks.py is
tested with the backend check answering "CUDA" and the kernel replaced by a
double that computes the same thing with MLX's masked attention (the kernels
cannot run on a machine without CUDA): a decode step of a padded batch must
give it each row's left padding, and nothing else may go there."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from tests.support.tiny_models import load_tiny_model, make_tiny_llama
from workers.kernels import cuda_decode_attention, mlx_hooks

ON_CUDA = mx.cuda.is_available() and mx.default_device() == mx.gpu


def masked(queries, keys, values, scale, starts):
    """What the kernels compute, as MLX computes it with mlx-lm's mask."""
    mask = (mx.arange(keys.shape[2])[None] >= starts[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


@pytest.fixture
def as_if_cuda(monkeypatch):
    """mlx_hooks' backend check answers "CUDA"; the kernel is the double."""
    took = []
    monkeypatch.setattr(mlx_hooks, "on_cpu", lambda: False)
    monkeypatch.setattr(mlx_hooks, "on_cuda", lambda: True)
    monkeypatch.setattr(cuda_decode_attention, "attention",
                        lambda q, k, v, scale, starts: took.append(starts.tolist()) or masked(q, k, v, scale, starts))
    yield took
    monkeypatch.undo()
    mlx_hooks._set_backend()  # back to this machine's own


def _padded_batch(model, lengths):
    """mlx-lm's left-padded batch of rows holding `lengths` tokens each, and the rows' last tokens."""
    rows, last = [], []
    for i, n in enumerate(lengths):
        cache = make_prompt_cache(model)
        prompt = mx.arange(3 + i, 3 + i + n)[None] % 200 + 1
        model(prompt, cache=cache)
        rows.append(cache)
        last.append(int(prompt[0, -1]))
    return [BatchKVCache.merge([r[i] for r in rows]) for i in range(len(model.layers))], last


def test_a_padded_decode_step_gives_the_kernel_each_rows_padding(as_if_cuda, tmp_path, monkeypatch):
    model = load_tiny_model(make_tiny_llama(tmp_path, seed=3, head_dim=32))
    assert mlx_hooks.install(model) and mlx_hooks._CUDA["decode"]
    cache, last = _padded_batch(model, [5, 12, 9])
    step = mx.array(last)[:, None]
    logits = model(step, cache=cache)
    assert as_if_cuda == [[7, 0, 3]] * len(model.layers)
    # MLX's own masked attention gives the same logits (the double is its
    # computation, so only wrong paddings could tell them apart).
    monkeypatch.setenv("TANDEM_MLX_DECODE_ATTENTION", "1")
    mlx_hooks.install(model)
    again, _ = _padded_batch(model, [5, 12, 9])
    assert mx.array_equal(logits, model(step, cache=again)).item()
    assert len(as_if_cuda) == len(model.layers)


def test_nothing_else_goes_to_the_kernel(as_if_cuda, tmp_path):
    model = load_tiny_model(make_tiny_llama(tmp_path, seed=4, head_dim=32))
    mlx_hooks.install(model)
    cache = make_prompt_cache(model)  # one conversation's own KVCache
    logits = model(mx.arange(1, 20)[None], cache=cache)
    model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
    padded, last = _padded_batch(model, [4, 6])
    assert as_if_cuda == []  # a batch's prompt pass: several queries, mask or not
    q = mx.zeros((1, 4, 1, 48))
    kv = mx.zeros((1, 2, 8, 48))
    assert not cuda_decode_attention.supported(q, kv, kv)  # a head size of no whole warps
    kv64 = mx.zeros((1, 2, 8, 64))
    assert cuda_decode_attention.supported(mx.zeros((1, 4, 1, 64)), kv64, kv64)
    assert not cuda_decode_attention.supported(mx.zeros((1, 4, 2, 64)), kv64, kv64)  # two queries
    big = mx.zeros((1, 64, 1, 256), dtype=mx.bfloat16)
    assert not cuda_decode_attention.supported(big, mx.zeros((1, 1, 8, 256), dtype=mx.bfloat16),
                                               mx.zeros((1, 1, 8, 256), dtype=mx.bfloat16))  # shared memory


def test_splits_depend_on_the_rows_only():
    assert cuda_decode_attention.splits_for(32, 8) == 2
    assert cuda_decode_attention.splits_for(1, 8) == 64
    assert cuda_decode_attention.splits_for(64, 8) == 1
    assert cuda_decode_attention.splits_for(3, 2) == cuda_decode_attention.MAX_SPLITS


@pytest.mark.skipif(not ON_CUDA, reason="the kernels need MLX's CUDA backend")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("rows,heads,kv_heads,dim,length", [
    (32, 16, 8, 128, 1300), (3, 9, 3, 64, 37), (1, 8, 8, 128, 2500), (5, 32, 8, 64, 700)])
def test_the_kernels_compute_mlxs_masked_attention(dtype, rows, heads, kv_heads, dim, length):
    k0, k1, k2, k3 = mx.random.split(mx.random.key(rows * length), 4)
    # Padded buffers with room to spare, viewed as a batch cache hands them over.
    buf_k = mx.random.normal((rows + 4, kv_heads, length + 200, dim), key=k0).astype(dtype)
    buf_v = mx.random.normal((rows + 4, kv_heads, length + 200, dim), key=k1).astype(dtype)
    keys, values = buf_k[:rows, :, :length, :], buf_v[:rows, :, :length, :]
    q = (mx.random.normal((rows, heads, 1, dim), key=k2) * 2).astype(dtype)
    starts = mx.random.randint(0, length, (rows,), key=k3).astype(mx.int32)
    got = cuda_decode_attention.attention(q, keys, values, dim ** -0.5, starts)
    want = masked(q.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32), dim ** -0.5, starts)
    err = mx.abs(got.astype(mx.float32) - want).max().item()
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}[dtype]
    assert got.shape == q.shape and got.dtype == dtype and err < tol


@pytest.mark.skipif(not ON_CUDA, reason="the kernels need MLX's CUDA backend")
def test_a_row_without_keys_gives_zeros():
    q = mx.ones((2, 4, 1, 64))
    kv = mx.ones((2, 2, 10, 64))
    out = cuda_decode_attention.attention(q, kv, kv, 0.125, mx.array([10, 0], mx.int32))
    assert mx.array_equal(out[0], mx.zeros_like(out[0])).item()
    assert mx.allclose(out[1], mx.ones_like(out[1])).item()
