"""Ollama's API on a real `tandem serve` (the embedded model, one server for
the module) driven by the real `ollama` client: chat whole and streamed,
greedy and token for token /v1/chat/completions' answer; generate; a JSON
schema answer that parses; list, ps, show, version; an unknown model's 404;
pull (streamed progress) and delete against the stand-in Hub on loopback
(tests/support/hub_standin.py, HF_ENDPOINT pointed at it)."""

from __future__ import annotations

import json
import struct

import httpx
import ollama
import pytest

from tests.support.hub_standin import HubStandIn
from tests.support.server import TandemServer

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
GREEDY = {"temperature": 0, "num_predict": 8}
PULLED = "tests/ollama-tiny"
CAPITAL = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
           "required": ["capital"], "additionalProperties": False}


def tiny_repo() -> dict[str, bytes]:
    """Files a pull takes (a safetensors header naming one tensor is enough: nothing loads it)."""
    header = json.dumps({"w": {"dtype": "F16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    return {"config.json": b'{"model_type": "llama", "max_position_embeddings": 128}',
            "model.safetensors": struct.pack("<Q", len(header)) + header + bytes(32),
            "tokenizer.json": b"{}", "tokenizer_config.json": b"{\"chat_template\": \"x\"}", "README.md": b"# not taken\n"}


@pytest.fixture(scope="module")
def hub():
    with HubStandIn() as stand_in:
        stand_in.add_repo(PULLED, tiny_repo())
        yield stand_in


@pytest.fixture(scope="module")
def server(hub, tmp_path_factory, embedded_model_dir):
    folder = tmp_path_factory.mktemp("ollama")
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(folder / "hf"), "HF_HUB_OFFLINE": "0", "HF_TOKEN": ""}
    srv = TandemServer("--colocate", "--no-disk-cache", log_path=folder / "server.log", env=env)
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.base_url, timeout=120)


def test_pull_streams_progress_then_lists_shows_and_deletes(client, hub):
    statuses = list(client.pull(PULLED, stream=True))
    assert statuses[0].status == "pulling manifest" and statuses[-1].status == "success"
    files = {s.digest: s for s in statuses if s.digest}
    assert len(files) == 4 and all(s.completed == s.total > 0 for s in files.values())  # not the README
    assert "verifying sha256 digest" in [s.status for s in statuses]
    assert f"{PULLED}:latest" in [m.model for m in client.list().models]
    assert client.show(f"{PULLED}:latest").details.family == "llama"
    assert client.delete(PULLED).status == "success"
    with pytest.raises(ollama.ResponseError) as info:
        client.delete(PULLED)
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as info:
        list(client.pull("tests/no-such-model", stream=True))
    assert "no such model" in info.value.error


def test_greedy_chat_is_v1s_answer_token_for_token(client, server):
    reply = client.chat(MODEL, ASK, options=GREEDY, logprobs=True)
    v1 = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": ASK, "temperature": 0, "max_tokens": 8, "logprobs": True}).json()
    assert reply.message.content == v1["choices"][0]["message"]["content"] and reply.message.content
    assert [lp.token for lp in reply.logprobs] == [t["token"] for t in v1["choices"][0]["logprobs"]["content"]]
    assert reply.eval_count == v1["usage"]["completion_tokens"]
    assert reply.prompt_eval_count == v1["usage"]["prompt_tokens"]
    parts = list(client.chat(f"{MODEL}:latest", ASK, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == reply.message.content
    assert parts[-1].done and parts[-1].done_reason == reply.done_reason and parts[-1].eval_duration > 0


def test_generate_and_a_json_schema_answer(client):
    reply = client.generate(MODEL, "The capital of France is", options=GREEDY)
    assert reply.response and reply.done
    answer = client.chat(MODEL, ASK, format=CAPITAL, options={"temperature": 0, "num_predict": 24})
    assert isinstance(json.loads(answer.message.content)["capital"], str)


def test_list_ps_show_version_and_an_unknown_model(client, server):
    assert f"{MODEL}:latest" in [m.model for m in client.list().models]
    [loaded] = [m for m in client.ps().models if m.model == f"{MODEL}:latest"]
    assert loaded.details.family == "llama" and loaded.size > 0
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and shown.template and shown.details.parameter_size.endswith("M")
    assert httpx.get(server.base_url + "/api/version", timeout=10).json()["version"]
    with pytest.raises(ollama.ResponseError) as info:
        client.chat("nobody/nothing", ASK)
    assert info.value.status_code == 404 and "try pulling it first" in info.value.error
