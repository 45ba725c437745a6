"""/v1/embeddings end to end: one real `tandem serve` on a tiny random
Qwen3-Embedding-like model (tests/support/tiny_embedders.py: its router,
its one embed worker, the cache service), driven by the `openai` client's
embeddings.create and checked against the same model's forward pass called
here (the final norm's state at the last token, normalised)."""

from __future__ import annotations

import base64
import concurrent.futures as cf

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest

from router.text.tokenizer import ModelTokenizer
from tests.support.server import module_server
from tests.support.tiny_embedders import make_tiny_qwen3_embedder

TEXTS = ["The river flows through the old city.", "Mountains", "A much longer sentence about a festival in spring, "
         "with music, markets and a parade along the harbour."]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_qwen3_embedder(tmp_path_factory.mktemp("tiny-qwen3-embedder"))


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, folder):
    return module_server(request, tmp_path_factory, "--model", str(folder), "--no-disk-cache")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def local(folder):
    """(tokenizer, vector(ids)): the model's own pass here, as the embed worker loads it."""
    from workers.models.loading import load_weights

    model = load_weights(folder)
    tok = ModelTokenizer.load(folder)

    def vector(ids):
        v = np.array(model.model(mx.array([ids]))[0, -1], dtype=np.float64)
        return v / np.linalg.norm(v)

    return tok, vector


def test_strings_are_embedded_as_the_models_own_pass_and_counted(client, local):
    tok, vector = local
    out = client.embeddings.create(model="default", input=TEXTS, encoding_format="float", user="tests")
    ids = [tok.encode(t) for t in TEXTS]
    assert [d.index for d in out.data] == [0, 1, 2] and out.model.startswith("tiny-qwen3-embedder")
    for d, i in zip(out.data, ids):
        np.testing.assert_allclose(d.embedding, vector(i), atol=1e-5)
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model="default", input=TEXTS[1], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, out.data[1].embedding, atol=1e-6)


def test_token_ids_base64_and_dimensions(client, server, local):
    tok, vector = local
    ids = [tok.encode(t) for t in TEXTS[:2]]
    # The client asks for base64 by default and decodes it itself.
    by_ids = client.embeddings.create(model="default", input=ids)
    single = client.embeddings.create(model="default", input=ids[0])
    np.testing.assert_allclose(by_ids.data[0].embedding, vector(ids[0]), atol=1e-5)
    np.testing.assert_allclose(single.data[0].embedding, by_ids.data[0].embedding, atol=1e-6)
    raw = httpx.post(server.base_url + "/v1/embeddings", timeout=30,
                     json={"model": "default", "input": TEXTS[0], "encoding_format": "base64"}).json()
    packed = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(packed, vector(ids[0]), atol=1e-5)
    short = client.embeddings.create(model="default", input=TEXTS[0], dimensions=16, encoding_format="float")
    cut = vector(ids[0])[:16]
    np.testing.assert_allclose(short.data[0].embedding, cut / np.linalg.norm(cut), atol=1e-5)


def test_concurrent_requests_share_the_worker_and_each_gets_its_own(client, local):
    tok, vector = local
    texts = [f"request {i}: " + TEXTS[i % 3] for i in range(8)]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda t: client.embeddings.create(model="default", input=t, encoding_format="float"),
                             texts))
    for t, out in zip(texts, outs):
        np.testing.assert_allclose(out.data[0].embedding, vector(tok.encode(t)), atol=1e-5)


def test_ollamas_client_embeds_through_the_same_worker(server, local):
    """The `ollama` client's embed (/api/embed: a list, Ollama's L2-normalised
    vectors, prompt tokens counted) and its legacy embeddings call
    (/api/embeddings: one prompt), served by the same embed worker."""
    import ollama

    tok, vector = local
    client = ollama.Client(host=server.base_url, timeout=60)
    out = client.embed(model="default", input=TEXTS[:2])
    assert len(out.embeddings) == 2 and out.prompt_eval_count == sum(len(tok.encode(t)) for t in TEXTS[:2])
    for got, text in zip(out.embeddings, TEXTS[:2]):
        np.testing.assert_allclose(got, vector(tok.encode(text)), atol=1e-5)
    legacy = client.embeddings(model="default", prompt=TEXTS[2])
    np.testing.assert_allclose(legacy.embedding, vector(tok.encode(TEXTS[2])), atol=1e-5)


@pytest.mark.parametrize("kwargs, needle", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "dimensions": 65}, "dimensions"),  # past the model's 64
    ({"input": [[1, 2], [10**7]]}, "vocabulary"),
    ({"input": list(range(1, 600))}, "context"),
])
def test_bad_requests_are_400s_in_openais_shape(client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="default", encoding_format="float", **kwargs)
    assert needle in err.value.message


def test_a_chat_request_to_an_embedding_model_is_a_400_saying_so(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in err.value.message
