"""/api/embed and the legacy /api/embeddings (router/ollama/embed.py) over
the embeddings path /v1/embeddings runs on, against a fake engine and pool:
Ollama's shapes, truncate, a chat model refused, unknown fields refused."""

from __future__ import annotations

import asyncio
import json
import types

import numpy as np
import pytest

from router.api.errors import ApiError
from router.ollama.embed import serve_embed
from router.text.tokenizer import ModelTokenizer
from tests.support.tiny_embedders import EOT, InlineTicket, last_token_embedder_files


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return last_token_embedder_files(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def tok(folder):
    return ModelTokenizer.load(folder)


class Engine:
    def __init__(self):
        self.calls = []

    async def embed(self, inputs, dimensions, deadline):
        self.calls.append(inputs)
        vectors = np.zeros((len(inputs), 4), np.float32)
        vectors[:, 0] = [len(ids) for ids in inputs]
        return vectors, sum(map(len, inputs))


def api_for(model):
    leases = []

    async def acquire(name, keep_alive):
        leases.append((name, keep_alive))
        return types.SimpleNamespace(model=model, release=lambda: None)

    return types.SimpleNamespace(models=types.SimpleNamespace(acquire=acquire, leases=leases),
                                 settings=types.SimpleNamespace(request_timeout_s=5))


def embed(api, body, legacy=False) -> dict:
    request = types.SimpleNamespace(state=types.SimpleNamespace())
    return json.loads(asyncio.run(serve_embed(api, InlineTicket(), body, legacy, 0, request)).body)


def model_of(tok, folder, kind="embedding", max_context=64):
    return types.SimpleNamespace(tokenizer=tok, model_dir=str(folder), kind=kind, model_id="tiny-embedder",
                                 max_context=max_context, engine=Engine())


def test_embed_answers_in_ollamas_shape_with_keep_alive_to_the_pool(tok, folder):
    model = model_of(tok, folder)
    api = api_for(model)
    out = embed(api, {"model": "tiny-embedder:latest", "input": ["hello world", "a"], "keep_alive": "1m",
                      "options": {"num_thread": 2}})
    assert api.models.leases == [("tiny-embedder", 60.0)]
    assert out["model"] == "tiny-embedder:latest" and len(out["embeddings"]) == 2
    assert [v[0] for v in out["embeddings"]] == [len(ids) for ids in model.engine.calls[0]]
    assert out["prompt_eval_count"] == sum(map(len, model.engine.calls[0])) and out["total_duration"] > 0
    assert embed(api, {"model": "tiny-embedder", "prompt": "hello"}, legacy=True)["embedding"][0] > 0


def test_truncate_cuts_to_the_context_keeping_the_end_token_or_refuses(tok, folder):
    model = model_of(tok, folder, max_context=4)
    long = "the quick brown fox jumps over the lazy dog"
    embed(api_for(model), {"model": "m", "input": long})
    [ids] = model.engine.calls[0]
    assert len(ids) == 4 and ids[-1] == tok.convert_tokens_to_ids(EOT)
    with pytest.raises(ApiError) as info:
        embed(api_for(model), {"model": "m", "input": long, "truncate": False})
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"


def test_a_chat_model_and_unknown_fields_are_refused(tok, folder):
    for body, model, param in (({"model": "m", "input": "x"}, model_of(tok, folder, kind="chat"), "model"),
                               ({"model": "m", "input": "x", "encoding_format": "base64"}, model_of(tok, folder),
                                "encoding_format"),
                               ({"model": "m", "input": "x", "options": {"temperature": 0}}, model_of(tok, folder),
                                "options")):
        with pytest.raises(ApiError) as info:
            embed(api_for(model), body)
        assert info.value.status == 400 and info.value.param == param


class ServedEngine(Engine):
    """The fake embed engine as the app serves it (its model's id, context, health)."""

    model_id, max_context = "tiny-embedder", 64

    def health(self):
        return True, {"model": self.model_id, "workers": []}

    async def metrics_text(self):
        return ""


def test_the_ollama_clients_embed_and_embeddings_through_the_app(tok, folder):
    import ollama

    from tests.support.router_server import serve_app

    engine = ServedEngine()
    with serve_app(engine, tok, model_dir=str(folder), request_timeout_s=10) as server:
        client = ollama.Client(host=server.url, timeout=10)
        out = client.embed("tiny-embedder:latest", ["hello world", "a"])
        assert [v[0] for v in out.embeddings] == [len(ids) for ids in engine.calls[0]] and out.prompt_eval_count
        assert client.embeddings("tiny-embedder", "hello").embedding[0] == len(engine.calls[1][0])
        assert client.show("tiny-embedder").capabilities == ["embedding"]
        with pytest.raises(ollama.ResponseError) as info:
            client.chat("tiny-embedder", [{"role": "user", "content": "hi"}])
        assert info.value.status_code == 400 and "embedding model" in info.value.error
