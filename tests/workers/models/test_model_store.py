"""Resolving model specs to local folders, and loading them."""

from __future__ import annotations

import hashlib
import json
import shutil
import time

import mlx.core as mx
import mlx.nn as nn
import pytest

from tests.support.gguf_fixtures import write_tiny_llama
from environment.model_folder import ModelError, context_length
from workers.models.loading import load_model
from workers.models.store import embedded_gguf, model_id_for, models_dir, resolve_model


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    # One cache for the whole module, so the embedded model converts once.
    path = tmp_path_factory.getbasetemp() / "tandem-cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(path))
    return path


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_is_the_embedded_gguf_converted_once(cache_dir):
    folder = resolve_model(None)
    assert folder == cache_dir / "models" / sha256(embedded_gguf())
    stamp = (folder / "config.json").stat().st_mtime_ns
    t = time.perf_counter()
    assert resolve_model(None) == folder
    assert time.perf_counter() - t < 1.0  # reused: no conversion, no re-hash
    assert (folder / "config.json").stat().st_mtime_ns == stamp
    assert [p.name for p in (cache_dir / "models").iterdir() if not p.name.startswith(".")] == [folder.name]


def test_gguf_path_is_cached_by_content(tmp_path):
    write_tiny_llama(tmp_path / "tiny-Q8_0.gguf")
    folder = resolve_model(str(tmp_path / "tiny-Q8_0.gguf"))
    assert folder == models_dir() / sha256(tmp_path / "tiny-Q8_0.gguf")
    shutil.copy(tmp_path / "tiny-Q8_0.gguf", tmp_path / "renamed.gguf")
    assert resolve_model(str(tmp_path / "renamed.gguf")) == folder
    assert model_id_for(str(tmp_path / "tiny-Q8_0.gguf"), folder) == "tiny"


def test_local_folder_is_used_as_is(tmp_path):
    folder = resolve_model(None)
    assert resolve_model(str(folder)) == folder
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


@pytest.mark.parametrize("spec", ["./no-such-model", "/no/such/model.gguf", "missing.gguf", "a/b/c"])
def test_missing_path(spec):
    with pytest.raises(ModelError) as e:
        resolve_model(spec)
    assert str(e.value) == f"{spec}: no such file or folder"


def test_uncached_hf_repo():
    repo = "tandem-tests/surely-not-cached-model"
    with pytest.raises(ModelError) as e:
        resolve_model(repo)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(repo) and "not in the local Hugging Face cache" in msg and "offline" in msg


def test_invalid_repo_id():
    with pytest.raises(ModelError, match="neither a local path nor a valid Hugging Face repo id"):
        resolve_model("not a repo!")


def test_model_ids(tmp_path):
    assert model_id_for(None, resolve_model(None)) == "SmolLM2-135M-Instruct"
    assert model_id_for("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    (tmp_path / "Llama-3.2-1B-Instruct-4bit").mkdir()
    assert model_id_for(str(tmp_path / "Llama-3.2-1B-Instruct-4bit"), tmp_path) == "Llama-3.2-1B-Instruct-4bit"
    (tmp_path / "Foo-7B.Q4_K_M.gguf").touch()
    assert model_id_for(str(tmp_path / "Foo-7B.Q4_K_M.gguf"), tmp_path) == "Foo-7B"


def test_load_on_cpu_is_float32_and_context_length():
    folder = resolve_model(None)
    assert context_length(folder) == 8192
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4
    model, tokenizer = load_model(folder)
    modules = [m for _, m in model.named_modules()]
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in modules)
    assert model.model.embed_tokens.weight.dtype == mx.float32
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (576, 576)
    assert tokenizer.eos_token_ids == {2}
