"""Ollama's /api/* routes on the router's app over a scripted engine
(tests/support/fake_engine.py), driven by the real `ollama` client: what
reaches the engine, NDJSON framing, tool calls, errors in Ollama's shape,
and the API key checked on /api/* as on /v1."""

from __future__ import annotations

import httpx
import ollama
import pytest

from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app

KEY = "ollama-key"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
HI = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, max_context=4096)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, api_keys=(KEY,), request_timeout_s=30) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)


@pytest.fixture(autouse=True)
def fresh_engine(engine):
    engine.reset()
    yield


def test_chat_whole_and_streamed_with_options_on_the_engine(client, engine):
    engine.say("Hello world.")
    reply = client.chat("tandem-test:latest", HI, options={"temperature": 0.5, "top_k": 3, "seed": 11,
                                                            "num_predict": 50, "stop": ["zzz"], "num_ctx": 8192})
    assert reply.message.content == "Hello world." and reply.done and reply.done_reason == "stop"
    assert reply.model == "tandem-test:latest" and reply.eval_count == len(engine.script) + 1  # EOS counted
    sampling = engine.requests[-1].sampling
    assert (sampling.temperature, sampling.top_k, sampling.seed, sampling.max_tokens) == (0.5, 3, 11, 50)
    assert reply.prompt_eval_count == len(engine.requests[-1].prompt_tokens)
    assert reply.total_duration >= reply.eval_duration >= 0 and reply.load_duration >= 0

    client.chat("tandem-test", HI, options={"num_predict": -1})  # no limit: the rest of the context
    assert engine.requests[-1].sampling.max_tokens == 4096 - len(engine.requests[-1].prompt_tokens)

    parts = list(client.chat("tandem-test", HI, stream=True))
    assert "".join(p.message.content for p in parts) == "Hello world." and len(parts) > 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].eval_count


def test_the_stream_is_ndjson(server, engine):
    engine.say("Hello world.")
    with httpx.stream("POST", server.url + "/api/generate", json={"model": "tandem-test", "prompt": "Hi"},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as r:
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = list(r.iter_lines())
    assert lines[-1].startswith('{"model":"tandem-test","created_at":') and '"done":true' in lines[-1]


def test_tool_calls_come_back_whole_with_arguments_as_objects(client, engine):
    engine.say(CALL)
    reply = client.chat("tandem-test", [{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER])
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris", "days": 2}
    assert reply.message.content == "" and reply.done_reason == "stop"
    engine.say("Sunny.")
    follow = client.chat("tandem-test", [{"role": "user", "content": "weather in Paris?"}, reply.message,
                                         {"role": "tool", "content": "sunny", "tool_name": "get_weather"}],
                         tools=[WEATHER])
    assert follow.message.content == "Sunny."


def test_generate_format_and_what_is_refused(client, engine):
    engine.say('{"a": 1}')
    reply = client.generate("tandem-test", "Say JSON", format="json", options={"num_predict": 20})
    assert reply.response == '{"a": 1}' and engine.requests[-1].sampling.grammar
    for kwargs, status, words in (
            ({"options": {"mirostat": 2}}, 400, "no such sampler"),
            ({"options": {"bogus": 1}}, 400, "'bogus'"),
            ({"think": True}, 400, '"tandem-test" does not support thinking'),
            ({"context": [1, 2]}, 400, "Ollama deprecated it")):
        with pytest.raises(ollama.ResponseError) as info:
            client.generate("tandem-test", "Hi", **kwargs)
        assert info.value.status_code == status and words in info.value.error, info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat("nobody/nothing:latest", HI)
    assert info.value.status_code == 404
    assert info.value.error == 'model "nobody/nothing:latest" not found, try pulling it first'


def test_an_empty_request_loads_and_listings_name_the_model(client, engine):
    assert client.generate("tandem-test").done_reason == "load" and engine.requests == []
    assert client.chat("tandem-test:latest").done_reason == "load"
    assert [m.model for m in client.list().models] == ["tandem-test:latest"]
    assert [m.model for m in client.ps().models] == ["tandem-test:latest"]
    shown = client.show("tandem-test:latest")
    assert shown.capabilities == ["completion"] and shown.modelinfo is not None


def test_api_paths_need_the_key_and_errors_are_ollamas_shape(server, client):
    r = httpx.get(server.url + "/api/tags", timeout=10)
    assert r.status_code == 401 and set(r.json()) == {"error"} and "API key" in r.json()["error"]
    r = httpx.get(server.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and r.json()["version"]
    r = httpx.get(server.url + "/", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200 and "is running" in r.text
    r = httpx.post(server.url + "/api/chat", content=b"{", headers={"Authorization": f"Bearer {KEY}",
                                                                      "Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    with pytest.raises(ollama.ResponseError) as info:
        client.delete("tandem-test")
    assert info.value.status_code == 409


def test_think_reaches_the_chat_template_through_a_tokenizer_equal_to_the_models(tokenizer):
    from router.ollama.routes import TemplateArgs

    wrapped = TemplateArgs(tokenizer, {"enable_thinking": False})
    assert wrapped == tokenizer and hash(wrapped) == hash(tokenizer) and len(wrapped) == len(tokenizer)
    seen = {}
    stub = type("Stub", (), {"apply_chat_template": lambda self, messages, **kw: seen.update(kw) or [1]})()
    assert TemplateArgs(stub, {"enable_thinking": False}).apply_chat_template(HI, tokenize=True) == [1]
    assert seen == {"tokenize": True, "enable_thinking": False}


def test_keep_alive_0_without_a_prompt_unloads_as_ollama_stop_does(client, engine):
    # Last: with no supervisor behind this app, the model does not load again.
    assert client.generate("tandem-test", keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
