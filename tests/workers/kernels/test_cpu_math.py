"""workers/kernels/cpu_math.py against MLX's own exp, swiglu and logsumexp, and
workers/kernels/mlx_hooks.py putting them in mlx-lm's place on the CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.activations import swiglu

from workers.kernels import cpu_math, mlx_hooks
from workers.models.loading import CPU_BUFFER_CACHE, buffer_cache_bytes, size_buffer_cache


def test_exp_is_within_two_ulps_of_mlx_exp():
    x = mx.concatenate([mx.linspace(-87.0, 0.0, 100_001), -mx.abs(mx.random.normal((10_000,), key=mx.random.key(0)))])
    ref, got = mx.exp(x), cpu_math.exp_shifted(x, mx.array(0.0))
    rel = mx.abs(got - ref) / ref
    assert rel.max().item() <= 2.5e-7  # ~2 float32 ulps at worst
    assert (got == ref).mean().item() > 0.5  # most values bit-identical
    assert cpu_math.exp_shifted(mx.array([-mx.inf, -1000.0]), mx.array(0.0)).tolist() == [0.0, 0.0]


def test_silu_mul_matches_mlx_lm_swiglu():
    k0, k1 = mx.random.split(mx.random.key(1))
    gate = mx.concatenate([mx.random.normal((4, 3000), key=k0) * 6, mx.linspace(-80.0, 80.0, 3000)[None]])
    x = mx.random.normal(gate.shape, key=k1)
    ref, got = swiglu(gate, x), cpu_math.silu_mul(gate, x)
    assert mx.allclose(got, ref, rtol=1e-6, atol=1e-30).item()
    # Far below zero silu vanishes instead of overflowing e^-gate to inf.
    tail = cpu_math.silu_mul(mx.array([-100.0, -1000.0]), mx.ones((2,)))
    assert mx.all(mx.isfinite(tail)).item() and mx.max(mx.abs(tail)).item() < 1e-30
    # Not float32: mlx-lm's own.
    half = gate.astype(mx.float16)
    assert mx.array_equal(cpu_math.silu_mul(half, half), swiglu(half, half)).item()


@pytest.mark.parametrize("axis,keepdims", [(-1, True), (-1, False), (0, False), (None, False), ((0, 1), True)])
def test_logsumexp_matches_mlx(axis, keepdims):
    a = mx.random.normal((3, 5000), key=mx.random.key(2)) * 8
    ref = mx.logsumexp(a, axis=axis, keepdims=keepdims)
    got = cpu_math.logsumexp(a, axis=axis, keepdims=keepdims)
    assert got.shape == ref.shape
    assert mx.allclose(got, ref, rtol=1e-6, atol=2e-6).item()


def test_logsumexp_rows_of_minus_infinity_and_other_dtypes():
    a = mx.array([[-mx.inf, -mx.inf], [0.0, -mx.inf]])
    assert cpu_math.logsumexp(a, axis=-1).tolist() == [-float("inf"), 0.0]
    b = mx.array([[1.0, 2.0]], dtype=mx.float16)
    assert mx.array_equal(cpu_math.logsumexp(b, axis=-1), mx.logsumexp(b, axis=-1)).item()


def test_install_puts_the_cpu_functions_in_mlx_lm_place(embedded_model):
    """On the CPU backend (these tests' machine) installing reaches the model
    module's swiglu and BatchGenerator's logsumexp; mlx.core itself is untouched."""
    model, _ = embedded_model  # SmolLM2: mlx-lm's llama module
    assert mlx_hooks.install(model)
    assert llama.swiglu is cpu_math.silu_mul
    assert mlx_hooks.mlx_lm_generate.mx.logsumexp is cpu_math.logsumexp
    assert mlx_hooks.mlx_lm_generate.mx.array is mx.array  # everything else is mlx.core's
    assert mx.logsumexp is not cpu_math.logsumexp


def test_each_worker_process_keeps_a_bounded_share_of_freed_buffers():
    """CPU: 128 MB (MLX's 32 MB default made big prefill chunks page-fault fresh
    buffers). GPU: MLX's default is the whole memory limit in every process, so
    workers sharing a device get a bounded share each (a sixteenth of a discrete
    GPU, a thirty-second of a Mac's working set, per process; more cases in
    tests/workers/models/test_memory_budgets.py); the platform call is MLX's,
    fed here with an H100's and an M-series Mac's info."""
    assert buffer_cache_bytes(True, {}, 3) == CPU_BUFFER_CACHE
    h100 = {"total_memory": 85520809984, "device_name": "NVIDIA H100 80GB HBM3"}
    assert buffer_cache_bytes(False, h100, 2) == 85520809984 // 32
    mac = {"memory_size": 68719476736, "max_recommended_working_set_size": 51539607552}
    assert buffer_cache_bytes(False, mac, 3) == 51539607552 // 96  # the working set, not all RAM
    assert buffer_cache_bytes(False, {"device_name": "?"}, 2) is None  # unknown: MLX's default stays
    mx.set_cache_limit(4 * CPU_BUFFER_CACHE)
    size_buffer_cache(5)  # this machine: MLX's CPU backend
    assert mx.set_cache_limit(CPU_BUFFER_CACHE) == CPU_BUFFER_CACHE
