"""The router's Anthropic Messages API (/v1/messages, /v1/messages/count_tokens),
driven by the real `anthropic` client against a real uvicorn server on 127.0.0.1,
with a scripted engine (tests/support/fake_engine.py) behind it."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import anthropic
import httpx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from router.api.anthropic_format import MessagesFormat
from router.routing.engine_api import EngineError
from router.api.generation import Piece
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app
from tests.support.tiny_vlms import synthetic_image, tiny_vlm

API_KEY = "sk-tandem-test"
MODEL = "tandem-test"
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, max_context=4096)  # room for the tools section


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, max_request_bytes=64 * 1024, request_timeout_s=30) as running:
        yield running


@pytest.fixture(scope="module")
def auth_server(engine, tokenizer):
    with serve_app(engine, tokenizer, api_keys=(API_KEY,)) as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_engine(engine):
    engine.reset()
    engine.say("Hello world.")
    yield


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=10)


def ask(client, content="Say hello", **kwargs):
    kwargs.setdefault("max_tokens", 200)
    return client.messages.create(model=MODEL, messages=[{"role": "user", "content": content}], **kwargs)


def prompt_text(engine, tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1].prompt_tokens)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each event, checking that the name is the data's type."""
    out = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


# --------------------------------------------------------------------------- #
# Text
# --------------------------------------------------------------------------- #


def test_message_text_usage_and_sampling(client, engine, tokenizer):
    engine.cached_tokens = 4
    message = ask(client, system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                  metadata={"user_id": "u1"}, extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello world.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    request = engine.requests[-1]
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Say hello"}],
                                             add_generation_prompt=True, tokenize=True)
    assert request.prompt_tokens == list(expected)
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (200, 0.5, 0.9, 7)
    assert sampling.grammar == ""
    # Anthropic's input_tokens leave out what the prefix cache gave: the three add up to the prompt.
    usage = message.usage
    assert usage.cache_read_input_tokens == 4 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens == len(expected) - 4
    assert usage.output_tokens == len(engine.script) + 1  # the EOS counts


def test_stop_sequence_and_max_tokens(client, engine):
    engine.say("Hello world. The capital of France is Paris.")
    message = ask(client, stop_sequences=["Paris", "capital"])
    assert message.content[0].text == "Hello world. The "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "capital"
    message = ask(client, max_tokens=2)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


def test_max_tokens_past_the_context_is_a_ceiling_not_an_error(client, engine):
    """Anthropic clients send large max_tokens whatever the model: the answer
    may run to the context's end; only a prompt that leaves no room is a 400."""
    message = ask(client, max_tokens=32000)
    request = engine.requests[-1]
    assert request.sampling.max_tokens == engine.max_context - len(request.prompt_tokens)
    assert message.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as caught:
        ask(client, "word " * 5000, max_tokens=10)
    assert "context" in caught.value.message


def test_streamed_text_through_the_sdk(client, engine):
    engine.cached_tokens = 3
    with client.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Hi"}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1 and "".join(texts) == "Hello world."
    assert [(b.type, b.text) for b in final.content] == [("text", "Hello world.")]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(engine.script) + 1 and final.usage.cache_read_input_tokens == 3


def test_stream_event_sequence(server, engine):
    engine.say("Hello world. The capital")
    body = {"model": MODEL, "max_tokens": 50, "stream": True, "stop_sequences": ["capital"],
            "messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(server.url + "/v1/messages", json=body, timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == "Hello world. The "
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "capital"}
    assert delta["usage"]["output_tokens"] > 0


def test_error_mid_stream_is_an_error_event(client, engine):
    engine.error_after = (2, EngineError(503, "The decode worker died"))
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Hi"}]) as s:
            list(s.text_stream)
    assert caught.value.body == {"type": "error", "error": {"type": "overloaded_error",
                                                            "message": "The decode worker died"}}


def test_queue_full_before_the_stream_is_a_429(client, engine):
    engine.error_before = EngineError(429, "Queue full, retry later", retry_after=1.5, code="queue_full")
    with pytest.raises(anthropic.RateLimitError) as caught:
        ask(client, stream=True)
    assert caught.value.body["error"]["type"] == "rate_limit_error"
    assert caught.value.response.headers["retry-after"] == "2"


# --------------------------------------------------------------------------- #
# Tools
# --------------------------------------------------------------------------- #


def test_tool_use(client, engine, tokenizer):
    engine.say(CALL)
    message = ask(client, "Weather in Paris?", tools=[WEATHER])
    assert message.stop_reason == "tool_use"
    [call] = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.input == {"city": "Paris"}
    assert call.id
    prompt = prompt_text(engine, tokenizer)
    assert '"name": "get_weather"' in prompt and '"description": "The weather in a city"' in prompt
    assert engine.requests[-1].sampling.grammar == ""  # tool_choice auto: free


def test_streamed_tool_use_sends_the_input_as_it_is_written(client, engine):
    engine.say("Let me check.\n" + CALL)
    with client.messages.stream(model=MODEL, max_tokens=200, tools=[WEATHER],
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    fragments = [e.partial_json for e in events if e.type == "input_json"]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == {"city": "Paris"}
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"]
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Let me check."
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_history_with_tool_use_and_tool_result_renders_into_the_prompt(client, engine, tokenizer):
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "no such city"}],
             "is_error": True},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    client.messages.create(model=MODEL, max_tokens=20, tools=[WEATHER], messages=messages)
    prompt = prompt_text(engine, tokenizer)
    assert ('<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>') in prompt
    # Both results in one user turn, each in <tool_response> tags (router/api/tools.py's default rendering).
    assert ("<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response>\n"
            "<tool_response>\nError: no such city\n</tool_response><|im_end|>") in prompt
    assert prompt.endswith("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("choice, parallel", [({"type": "any"}, True), ({"type": "tool", "name": "get_weather"}, False),
                                              ({"type": "any", "disable_parallel_tool_use": True}, False)])
def test_forced_tool_choice_sets_a_grammar(client, engine, choice, parallel):
    engine.say(CALL)
    message = ask(client, tools=[WEATHER], tool_choice=choice)
    grammar = engine.requests[-1].sampling.grammar
    assert "get_weather" in grammar and ('("\\n" call)*' in grammar) == parallel
    assert message.content[0].input == {"city": "Paris"}


def test_tool_choice_none_hides_the_tools(client, engine, tokenizer):
    ask(client, tools=[WEATHER], tool_choice={"type": "none"})
    assert "get_weather" not in prompt_text(engine, tokenizer) and not engine.requests[-1].sampling.grammar


# --------------------------------------------------------------------------- #
# Errors, auth, count_tokens
# --------------------------------------------------------------------------- #


def test_unsupported_fields_are_400_in_anthropics_shape(client, server, engine):
    cases = [
        (dict(thinking={"type": "enabled", "budget_tokens": 1024}), "'thinking'"),
        (dict(extra_body={"service_tier": "auto"}), "'service_tier'"),
        (dict(metadata={"user_id": "u", "session": "s"}), "'metadata.session'"),
        (dict(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "web_search_20250305"),
        (dict(stop_sequences=["a", "b", "c", "d", "e"]), "stop_sequences"),
        (dict(extra_body={"temperature": 1.5}), "temperature"),
    ]
    for kwargs, named in cases:
        with pytest.raises(anthropic.BadRequestError) as caught:
            ask(client, **kwargs)
        assert caught.value.status_code == 400
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
        assert named in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:  # images: only where the model takes them
        ask(client, [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
                     {"type": "text", "text": "What is this?"}])
    assert "images" in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:  # prefill: answered differently, so refused
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"},
                                                                    {"role": "assistant", "content": "Hel"}])
    assert "prefill" in caught.value.message
    assert not engine.requests


def test_missing_fields_unknown_model_route_and_bad_json(server, client):
    def post(path, **kwargs):
        response = httpx.post(server.url + path, timeout=10, **kwargs)
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return response.status_code, body["error"]

    status, error = post("/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and error["type"] == "invalid_request_error" and "max_tokens" in error["message"]
    status, error = post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": [{"role": "user"}]})
    assert status == 400 and "messages[0].content" in error["message"]
    status, error = post("/v1/messages", json={"model": MODEL, "max_tokens": "5",
                                               "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400 and "max_tokens" in error["message"]  # OpenAI's 422, Anthropic's 400
    status, error = post("/v1/messages", content=b'{"model": "tandem-test", "mess',
                         headers={"content-type": "application/json"})
    assert status == 400 and "JSON" in error["message"]
    status, error = post("/v1/messages/batches", json={})
    assert status == 404 and error["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error" and MODEL in caught.value.message
    # The OpenAI routes keep OpenAI's shape.
    assert "type" not in httpx.post(server.url + "/v1/chat/completions", content=b"{").json()


def test_api_key_by_x_api_key_or_bearer(auth_server):
    wrong = anthropic.Anthropic(base_url=auth_server.url, api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        ask(wrong)
    assert caught.value.status_code == 401 and caught.value.body["error"]["type"] == "authentication_error"
    by_header = anthropic.Anthropic(base_url=auth_server.url, api_key=API_KEY, max_retries=0, timeout=10)
    assert ask(by_header, extra_headers={"anthropic-version": "2023-06-01"}).content[0].text == "Hello world."
    by_bearer = anthropic.Anthropic(base_url=auth_server.url, auth_token=API_KEY, max_retries=0, timeout=10)
    assert by_bearer.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}]).input_tokens
    # x-api-key is Anthropic's header: the OpenAI routes still want a Bearer token, in their shape.
    response = httpx.get(auth_server.url + "/v1/models", headers={"x-api-key": API_KEY})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_count_tokens_is_the_prompt_the_same_body_gets(client, engine):
    body = dict(model=MODEL, system="Be brief.", tools=[WEATHER],
                messages=[{"role": "user", "content": "Weather in Paris?"}])
    counted = client.messages.count_tokens(**body)
    assert not engine.requests  # counted without generating
    ask(client, **{k: v for k, v in body.items() if k not in ("model", "messages")}, content="Weather in Paris?")
    assert counted.input_tokens == len(engine.requests[-1].prompt_tokens)
    bare = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert bare.input_tokens < counted.input_tokens  # the tools are in the count
    long = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Paris " * 5000}])
    assert long.input_tokens > engine.max_context  # a prompt too long to answer is still counted
    with pytest.raises(anthropic.BadRequestError):  # no generation fields
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"max_tokens": 5})


def test_an_image_block_takes_the_vision_path(tmp_path_factory):
    """On a model that takes images (a tiny random VLM's folder), an image
    block becomes a picture in the prompt and an image for the engine."""
    folder = tiny_vlm(tmp_path_factory)
    tokenizer = load_tokenizer(folder)
    engine = FakeEngine(tokenizer, max_context=4096)
    engine.say("A picture.")
    png = io.BytesIO()
    synthetic_image(32, 32).save(png, "PNG")
    image = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png.getvalue()).decode()}
    with serve_app(engine, tokenizer, model_dir=str(folder)) as server:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=30)
        message = ask(client, [{"type": "image", "source": image}, {"type": "text", "text": "What is this?"}])
    assert message.content[0].text == "A picture."
    assert len(engine.requests[-1].images) == 1
    assert "<|vision_start|><|image_pad|>" in tokenizer.decode(engine.requests[-1].prompt_tokens)


# --------------------------------------------------------------------------- #
# Shapes alone: a reasoning model's thinking
# --------------------------------------------------------------------------- #


def test_reasoning_streams_as_a_thinking_block_before_the_text():
    generation = SimpleNamespace(request=SimpleNamespace(prompt_tokens=[1, 2, 3]), cached_tokens=0,
                                 completion_tokens=4, text=SimpleNamespace(stopped=False), output=None, calls=[])
    fmt = MessagesFormat("msg_1", MODEL, generation)
    pieces = [Piece("", reasoning="Paris is "), Piece("", reasoning="in France."),
              Piece("Paris.", finish_reason="stop")]
    raw = b"".join(b"".join(fmt.stream_piece(p, i == 0)) for i, p in enumerate(pieces))
    raw += b"".join(fmt.stream_end(generation))
    events = [json.loads(block.split("data: ", 1)[1]) for block in raw.decode().strip().split("\n\n")]
    blocks = [(e["type"], e.get("index"), e.get("content_block", e.get("delta", {})).get("type")) for e in events]
    assert blocks == [("message_start", None, None), ("ping", None, None),
                      ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
                      ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
                      ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
                      ("content_block_stop", 1, None), ("message_delta", None, None), ("message_stop", None, None)]
    whole = MessagesFormat("msg_1", MODEL, generation).full(pieces, generation)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "Paris is in France." and whole["stop_reason"] == "end_turn"
