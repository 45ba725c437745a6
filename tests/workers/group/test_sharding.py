"""Which models split over N ranks (workers/models/sharding.py), by tensor
or by pipeline: refused from the config alone at `tandem serve`, and again on
the loaded model; a pipeline rank reads only its own layers."""

from __future__ import annotations

import json

import pytest

from tests.support.tiny_models import load_tiny_model, make_tiny_llama, make_tiny_model
from workers.models.sharding import (ShardError, folder_shard_problem, is_pipelined, pipeline_problem, shard_model,
                                     shard_problem)

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
    def __init__(self, n: int, rank: int = 0):
        self.n, self.r = n, rank

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def test_shard_model_refuses_before_touching_the_model(tmp_path):
    model = load_tiny_model(make_tiny_llama(tmp_path / "m", num_attention_heads=3, num_key_value_heads=3))
    before = model.layers[0].self_attn.q_proj.weight.shape
    with pytest.raises(ShardError, match="3 attention heads, 3 KV heads"):
        shard_model(model, FakeGroup(2))
    assert model.layers[0].self_attn.q_proj.weight.shape == before
    with pytest.raises(ShardError, match="no tensor-parallel"):
        shard_model(object(), FakeGroup(2))


QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 256,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 2048}


def test_pipelines_need_the_architectures_pipeline_and_a_layer_a_rank():
    assert pipeline_problem(QWEN2, 2) is None and pipeline_problem(QWEN2, 4) is None
    assert pipeline_problem({"model_type": "qwen3_moe", "num_hidden_layers": 48}, 8) is None
    assert pipeline_problem({"model_type": "llama"}, 1) is None  # one rank: nothing to split
    for arch in ("llama", "qwen3", "nonesuch", "../utils"):
        assert "no pipeline-parallel `pipeline` method" in pipeline_problem({**QWEN2, "model_type": arch}, 2), arch
    assert pipeline_problem(QWEN2, 5) == ("its 4 layers are fewer than --pipeline-parallel 5 "
                                          "(each rank takes whole layers)")
    assert "4 layers" in pipeline_problem({"model_type": "x", "text_config": QWEN2}, 5)  # a VLM's text part
    # Heads need not divide: a pipeline rank keeps whole layers.
    assert pipeline_problem({**QWEN2, "num_attention_heads": 9, "num_key_value_heads": 3}, 2) is None


def test_a_folder_is_checked_for_the_mode_asked(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN2, "num_attention_heads": 9, "num_key_value_heads": 3}))
    assert folder_shard_problem(tmp_path, 2, pipeline=True) is None
    assert "9 attention heads" in folder_shard_problem(tmp_path, 2)
    assert "config.json cannot be read" in folder_shard_problem(tmp_path / "none", 2, pipeline=True)


def test_a_pipeline_rank_keeps_and_reads_only_its_layers(tmp_path):
    """Rank 1 of 2 keeps the first two of four layers (mlx-lm gives rank 0 the
    last ones); loaded lazily, the other two are never read from the file."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    folder = make_tiny_model(tmp_path / "q", QWEN2)
    full = load_tiny_model(folder)
    whole = sum(v.nbytes for _, v in tree_flatten(full.parameters()))
    layer = sum(v.nbytes for _, v in tree_flatten(full.layers[0].parameters()))
    del full
    mx.clear_cache()
    before = mx.get_active_memory()
    model, _ = load_model(folder, lazy=True)
    assert not is_pipelined(model)
    shard_model(model, FakeGroup(2, rank=1), pipeline=True)
    assert is_pipelined(model) and len(model.layers) == 2 and model.model.start_idx == 0
    kept = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert kept == whole - 2 * layer
    assert mx.get_active_memory() - before <= kept  # the other two layers' weights were never read


def test_shard_model_refuses_a_pipeline_it_cannot_build(tmp_path):
    llama = load_tiny_model(make_tiny_llama(tmp_path / "m"))
    with pytest.raises(ShardError, match="no pipeline-parallel `pipeline` method"):
        shard_model(llama, FakeGroup(2), pipeline=True)
    qwen2 = load_tiny_model(make_tiny_model(tmp_path / "q", {**QWEN2, "num_hidden_layers": 2}))
    with pytest.raises(ShardError, match="2 layers are fewer than --pipeline-parallel 3"):
        shard_model(qwen2, FakeGroup(3), pipeline=True)
    assert len(qwen2.layers) == 2 and not is_pipelined(qwen2)
