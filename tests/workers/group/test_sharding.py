"""Which models split over N ranks (workers/models/sharding.py): refused from
the config alone at `tandem serve`, and again on the loaded model."""

from __future__ import annotations

import pytest

from tests.support.tiny_models import load_tiny_model, make_tiny_llama
from workers.models.sharding import ShardError, folder_shard_problem, shard_model, shard_problem

QWEN3 = {"model_type": "qwen3", "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 3072}


def test_a_model_whose_sizes_divide_splits():
    assert shard_problem(QWEN3, 2) is None and shard_problem(QWEN3, 8) is None
    assert shard_problem({"model_type": "nonesuch"}, 1) is None  # one rank: nothing to split


def test_heads_or_mlp_that_do_not_divide_are_named():
    smollm2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    why = shard_problem(smollm2, 2)
    assert "9 attention heads, 3 KV heads do not divide by --tensor-parallel 2" in why
    assert "intermediate" not in why
    assert shard_problem({**QWEN3, "intermediate_size": 3071}, 2).endswith(
        "3071 intermediate size do not divide by --tensor-parallel 2 (each rank takes an equal share of the heads "
        "and of the MLP)")
    nested = {"model_type": "x", "text_config": {**QWEN3, "num_key_value_heads": 2}}  # a VLM's text part
    assert "2 KV heads" in shard_problem(nested, 4)


def test_an_architecture_without_shard_is_refused():
    assert "no tensor-parallel `shard` method" in shard_problem({**QWEN3, "model_type": "nonesuch"}, 2)


def test_a_folder_without_a_config_says_so(tmp_path):
    assert "config.json cannot be read" in folder_shard_problem(tmp_path, 2)


class FakeGroup:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def test_shard_model_refuses_before_touching_the_model(tmp_path):
    model = load_tiny_model(make_tiny_llama(tmp_path / "m", num_attention_heads=3, num_key_value_heads=3))
    before = model.layers[0].self_attn.q_proj.weight.shape
    with pytest.raises(ShardError, match="3 attention heads, 3 KV heads"):
        shard_model(model, FakeGroup(2))
    assert model.layers[0].self_attn.q_proj.weight.shape == before
    with pytest.raises(ShardError, match="no tensor-parallel"):
        shard_model(object(), FakeGroup(2))
