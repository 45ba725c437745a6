"""workers/loading.py set_cuda_graphs: a prefill-only worker runs MLX's CUDA
backend without CUDA graphs (a graph per new prompt shape cost 25-85 ms on an
H100); a worker that decodes keeps them; an operator's setting stands. The
CUDA backend itself cannot run here: this tests the choice and the variable
MLX reads, not the graphs."""

from __future__ import annotations

import pytest

from workers.loading import cuda_graphs_wanted, set_cuda_graphs


@pytest.mark.parametrize("roles, wanted", [
    (["prefill"], False),
    (["decode"], True),
    (["prefill", "decode"], True),  # --colocate: decode steps replay graphs
    (["vision"], True),
    (["prefill", "vision"], False),
])
def test_only_a_worker_that_prefills_and_does_not_decode_turns_graphs_off(roles, wanted):
    env: dict = {}
    set_cuda_graphs(roles, env)
    assert cuda_graphs_wanted(roles) is wanted
    assert env == ({} if wanted else {"MLX_USE_CUDA_GRAPHS": "0"})


def test_an_operator_s_setting_stands():
    env = {"MLX_USE_CUDA_GRAPHS": "1"}
    set_cuda_graphs(["prefill"], env)
    assert env == {"MLX_USE_CUDA_GRAPHS": "1"}
