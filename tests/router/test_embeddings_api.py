"""/v1/embeddings' body and answer (router/api/embeddings.py) against a fake
engine, with a Qwen3-Embedding-like tokenizer (the embedded model's, which
appends <|endoftext|>): inputs of every shape OpenAI takes, tokenized as
sentence-transformers does, base64, dimensions, and every refusal a 4xx in
OpenAI's shape."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from environment.embedding_config import EmbeddingConfig
from router.api.embeddings import MAX_INPUTS, parse_embeddings, serve_embeddings
from router.api.errors import ApiError
from router.text.tokenizer import ModelTokenizer
from tokenizers import processors
from tests.support.tiny_embedders import EOT, InlineTicket, last_token_embedder_files

LAST, MEAN = EmbeddingConfig("last"), EmbeddingConfig("mean")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return last_token_embedder_files(tmp_path_factory.mktemp("embedder"))


@pytest.fixture(scope="module")
def tok(folder):
    return ModelTokenizer.load(folder)


class Engine:
    """Answers each input with [its length, its first id, 0, ...] normalised-ish, as float32."""

    def __init__(self):
        self.calls = []

    async def embed(self, inputs, dimensions, deadline):
        self.calls.append((inputs, dimensions))
        width = dimensions or 8
        vectors = np.zeros((len(inputs), width), np.float32)
        for i, ids in enumerate(inputs):
            vectors[i, :2] = [len(ids) / 3, ids[0] / 7]
        return vectors, sum(len(ids) for ids in inputs)


@dataclass
class Model:
    tokenizer: object
    model_dir: str
    kind: str = "embedding"
    model_id: str = "tiny-embedder"
    max_context: int = 64
    engine: Engine = field(default_factory=Engine)


def call(model, body) -> dict:
    response = asyncio.run(serve_embeddings(InlineTicket(), body, model, timeout_s=5))
    return json.loads(response.body)


def test_text_is_tokenized_with_the_models_end_token_and_answered_in_openais_shape(tok, folder):
    model = Model(tok, str(folder))
    out = call(model, {"model": "tiny-embedder", "input": ["hello world", "a"], "user": "me"})
    (inputs, dims), = model.engine.calls
    eot = tok.convert_tokens_to_ids(EOT)
    assert inputs == [tok.encode("hello world", add_special_tokens=False) + [eot],
                      tok.encode("a", add_special_tokens=False) + [eot]] and dims == 0
    n = sum(map(len, inputs))
    assert out["object"] == "list" and out["model"] == "tiny-embedder"
    assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert [(d["object"], d["index"]) for d in out["data"]] == [("embedding", 0), ("embedding", 1)]
    assert out["data"][0]["embedding"][:2] == pytest.approx([len(inputs[0]) / 3, inputs[0][0] / 7], rel=1e-6)


def test_every_input_shape_openai_takes(tok, folder):
    ids = tok.encode("hi there")
    for given, expected in [("hi there", [ids]), (["hi there", "hi there"], [ids, ids]), ([5, 6, 7], [[5, 6, 7]]),
                            ([[5, 6], [7]], [[5, 6], [7]])]:
        assert parse_embeddings({"input": given}, tok, 64, LAST).inputs == expected


def test_a_last_token_model_whose_tokenizer_adds_nothing_gets_its_end_token_here(folder):
    old = ModelTokenizer.load(folder)
    old.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1",
                                                                         special_tokens=[])  # files before June 2025
    eot = old.convert_tokens_to_ids(EOT)
    assert old.encode("a") == old.encode("a", add_special_tokens=False)
    assert parse_embeddings({"input": "a"}, old, 64, LAST).inputs == [old.encode("a") + [eot]]
    assert parse_embeddings({"input": "a"}, old, 64, MEAN).inputs == [old.encode("a")]  # an encoder's tokenizer decides


def test_base64_is_the_vectors_little_endian_float32_bytes(tok, folder):
    model = Model(tok, str(folder))
    plain = call(model, {"input": ["one", "two words"]})
    packed = call(model, {"input": ["one", "two words"], "encoding_format": "base64"})
    for p, b in zip(plain["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(p["embedding"], dtype=np.float32))


def test_dimensions_go_to_the_worker_for_a_matryoshka_model_and_are_refused_otherwise(tok, folder):
    model = Model(tok, str(folder))
    out = call(model, {"input": "x", "dimensions": 4})
    assert model.engine.calls[0][1] == 4 and len(out["data"][0]["embedding"]) == 4
    with pytest.raises(ApiError) as err:
        parse_embeddings({"input": "x", "dimensions": 4}, tok, 64, MEAN)
    assert err.value.status == 400 and err.value.param == "dimensions"


@pytest.mark.parametrize("body, status, param", [
    ({"input": ""}, 400, "input[0]"),
    ({"input": []}, 400, "input"),
    ({"input": ["a", ""]}, 400, "input[1]"),
    ({"input": [[]]}, 400, "input[0]"),
    ({}, 400, "input"),
    ({"input": 5}, 422, "input"),
    ({"input": ["a", 5]}, 422, "input[1]"),
    ({"input": [[1, "2"]]}, 422, "input[0]"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, 400, "input"),
    ({"input": [10**9]}, 400, "input[0]"),
    ({"input": [-1]}, 400, "input[0]"),
    ({"input": list(range(1, 70))}, 400, "input"),  # past the 64-token context
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "dimensions": 0}, 400, "dimensions"),
    ({"input": "x", "dimensions": "8"}, 422, "dimensions"),
    ({"input": "x", "stream": True}, 400, "stream"),
])
def test_bad_bodies_are_4xx_in_openais_shape_naming_the_field(tok, body, status, param):
    with pytest.raises(ApiError) as err:
        parse_embeddings(body, tok, 64, LAST)
    assert err.value.status == status and err.value.param == param
    assert set(err.value.body()["error"]) == {"message", "type", "param", "code"}


def test_an_embeddings_request_to_a_chat_model_is_a_400_saying_so(tokenizer):
    """Through the router's app (its pool's one model a scripted chat engine)."""
    import httpx

    from tests.support.fake_engine import FakeEngine
    from tests.support.router_server import serve_app

    engine = FakeEngine(tokenizer)
    with serve_app(engine, tokenizer) as server:
        r = httpx.post(server.url + "/v1/embeddings", json={"model": engine.model_id, "input": "hi"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "makes no embeddings" in r.json()["error"]["message"]
