"""workers/models/loading.py set_cuda_graphs: every worker runs MLX's CUDA backend
without CUDA graphs (on an H100 a decode step of the DecodeEngine took 14.8
ms with them and 11.6 ms without, and a graph per new prompt shape cost a
prefill 25-85 ms); an operator's setting stands. The CUDA backend itself
cannot run here: this tests the variable MLX reads, not the graphs."""

from __future__ import annotations

from workers.models.loading import set_cuda_graphs


def test_graphs_are_off_by_default():
    env: dict = {}
    set_cuda_graphs(env)
    assert env == {"MLX_USE_CUDA_GRAPHS": "0"}


def test_an_operator_s_setting_stands():
    env = {"MLX_USE_CUDA_GRAPHS": "1"}
    set_cuda_graphs(env)
    assert env == {"MLX_USE_CUDA_GRAPHS": "1"}
