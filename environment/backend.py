"""Which backend MLX runs on: the one definition every process asks.

`import mlx.core` waits for the first call, so a process that never asks
(the supervisor with explicit settings, the router) does not load MLX for it.
"""

from __future__ import annotations


def on_cpu() -> bool:
    """MLX runs on its CPU backend (no Metal or CUDA device as the default)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def on_cuda() -> bool:
    """MLX runs on its CUDA backend (an NVIDIA GPU), not Metal or the CPU."""
    import mlx.core as mx

    return not on_cpu() and mx.cuda.is_available()
