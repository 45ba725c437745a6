"""A model's recommended sampling (environment/generation_defaults.py): read
from its generation_config.json as transformers means it, hostile values
dropped, and the embedded model given the values its authors recommend."""

from __future__ import annotations

import json

import pytest

from environment.generation_defaults import GenerationDefaults, generation_defaults, write_generation_defaults


def folder_with(tmp_path, config) -> str:
    (tmp_path / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return str(tmp_path)


def test_a_qwen_style_config_gives_every_field(tmp_path):
    d = generation_defaults(folder_with(tmp_path, {
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
        "max_new_tokens": 2048, "bos_token_id": 1, "eos_token_id": [2, 3]}))
    assert d == GenerationDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=2048)
    assert d.given() == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 2048}


def test_do_sample_false_means_greedy_and_top_k_0_means_off(tmp_path):
    d = generation_defaults(folder_with(tmp_path, {"do_sample": False, "temperature": 0.6, "top_k": 0}))
    assert d == GenerationDefaults(temperature=0.0)


def test_no_file_or_no_sampling_keys_leave_the_apis_own_defaults(tmp_path):
    assert generation_defaults(str(tmp_path)) == GenerationDefaults()
    assert generation_defaults(folder_with(tmp_path, {"bos_token_id": 1})).given() == {}


@pytest.mark.parametrize("config", [
    "{not json", "[1, 2]", "null",
    {"temperature": 9}, {"temperature": -1}, {"temperature": "hot"}, {"temperature": True},
    {"top_p": 0}, {"top_p": 1.5}, {"top_k": 2.5}, {"top_k": -3}, {"min_p": 2},
    {"repetition_penalty": 0}, {"max_new_tokens": 0}, {"max_new_tokens": 1e400},
])
def test_a_hostile_or_broken_file_serves_nothing_out_of_range(tmp_path, config):
    assert generation_defaults(folder_with(tmp_path, config)) == GenerationDefaults()


def test_written_defaults_never_replace_a_folders_own(tmp_path):
    write_generation_defaults(tmp_path, {"temperature": 0.2, "top_p": 0.9})
    assert generation_defaults(tmp_path) == GenerationDefaults(temperature=0.2, top_p=0.9)
    write_generation_defaults(tmp_path, {"temperature": 1.0})
    assert generation_defaults(tmp_path).temperature == 0.2
    write_generation_defaults(tmp_path, {"temperature": 0.5}, replace=True)  # a folder that is Tandem's own
    assert generation_defaults(tmp_path) == GenerationDefaults(temperature=0.5)
    assert [p.name for p in tmp_path.iterdir()] == ["generation_config.json"]  # no temporary left


def test_the_embedded_model_answers_with_its_authors_sampling(embedded_model_dir):
    assert generation_defaults(embedded_model_dir) == GenerationDefaults(temperature=0.2, top_p=0.9, max_tokens=256)
