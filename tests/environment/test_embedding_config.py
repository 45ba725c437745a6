"""An embedding model's folder read without MLX (environment/embedding_config.py):
its pooling from sentence-transformers' files or its architecture, which
decides the engine, `dimensions` and its tokenization; and its plan: one embed worker."""

from __future__ import annotations

import json

import pytest

from environment.embedding_config import embedding_config
from environment.model_folder import ModelError
from environment.settings import Settings
from tests.support.tiny_embedders import write_sentence_transformers


def folder_with(tmp_path, config: dict, pooling: str | None = None):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if pooling:
        write_sentence_transformers(tmp_path, pooling, 8)
    return tmp_path


@pytest.mark.parametrize("config, pooling, expected", [
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "last", "last"),
    ({"model_type": "bert", "architectures": ["BertModel"]}, "cls", "cls"),
    ({"model_type": "bert", "architectures": ["BertModel"]}, "mean", "mean"),
    ({"model_type": "bert", "architectures": ["BertModel"]}, None, "mean"),  # no sentence-transformers files
    ({"model_type": "qwen3", "architectures": ["Qwen3Model"]}, None, "last"),
])
def test_the_pooling_comes_from_sentence_transformers_else_the_architecture(tmp_path, config, pooling, expected):
    cfg = embedding_config(folder_with(tmp_path, config, pooling))
    assert cfg.pooling == expected
    assert cfg.decoder == cfg.matryoshka == (expected == "last")


def test_newer_files_name_the_mode_and_one_tandem_does_not_run_is_refused(tmp_path):
    folder = folder_with(tmp_path, {"model_type": "bert"}, "mean")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))
    assert embedding_config(folder).pooling == "last"
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelError, match="pooling_mode_max_tokens"):
        embedding_config(folder)


def test_an_embedding_models_plan_is_one_embed_worker_whatever_the_layout(tmp_path):
    folder = folder_with(tmp_path, {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "last")
    assert Settings(model_dir=str(folder)).worker_plan() == [("embed-0", ["embed"])]
    assert Settings(model_dir=str(folder), colocate=True, prefill_workers=2).worker_plan() == [("embed-0", ["embed"])]
    for name in ("modules.json", "config_sentence_transformers.json"):
        (folder / name).unlink()  # a chat model again
    assert [roles for _, roles in Settings(model_dir=str(folder)).worker_plan()] == [["prefill"], ["decode"]]
