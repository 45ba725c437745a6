"""The router's OpenAI API, driven by the real `openai` client against a real uvicorn
server on 127.0.0.1, with a scripted engine (tests/support/fake_engine.py) behind it."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import httpx
import openai
import pytest

from protos.messages import SamplingParams
from router.api.generation import Generation
from router.routing.engine_api import EngineError, GenerationRequest
from router.text.text_stream import TextStream, TokenBytes
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app, wait_for

MAX_BODY = 64 * 1024
API_KEY = "sk-tandem-test"


# --------------------------------------------------------------------------- #
# Fixtures
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, max_request_bytes=MAX_BODY, request_timeout_s=30) as running:
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
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def chat(client, content="Say hello", **kwargs):
    return client.chat.completions.create(
        model="tandem-test", messages=[{"role": "user", "content": content}], **kwargs
    )


def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]


# --------------------------------------------------------------------------- #
# Text stream (no server)
# --------------------------------------------------------------------------- #


def feed(stream: TextStream, tokens: list[int]) -> list[str]:
    pieces = [stream.add(t) for t in tokens]
    if not stream.stopped:
        pieces.append(stream.flush())
    return pieces


def test_split_emoji_and_cjk_never_emit_broken_characters(tokenizer):
    text = "Hi 😀 你好, the cat 🐈‍⬛!"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokens) > len(text)  # characters really are split across tokens
    pieces = feed(TextStream(tokenizer), tokens)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert "" in pieces  # bytes were held back while a character was incomplete


def test_stop_string_across_tokens_is_cut(tokenizer):
    tokens = tokenizer.encode("Hello XYZSTOP and more", add_special_tokens=False)
    assert len(tokenizer.encode("XYZSTOP", add_special_tokens=False)) > 1
    stream = TextStream(tokenizer, ["XYZSTOP", "never"])
    pieces = feed(stream, tokens)
    assert stream.stopped
    assert "".join(pieces) == "Hello "


def test_stop_string_prefix_is_released_when_ruled_out(tokenizer):
    text = "XYZST is not XYZ STOP"
    pieces = feed(TextStream(tokenizer, ["XYZSTOP"]), tokenizer.encode(text, add_special_tokens=False))
    assert "".join(pieces) == text


def test_stop_string_inside_one_multibyte_run(tokenizer):
    stream = TextStream(tokenizer, ["好"])
    pieces = feed(stream, tokenizer.encode("你好吗", add_special_tokens=False))
    assert stream.stopped and "".join(pieces) == "你"


def test_token_bytes_of_split_emoji(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    tokens = tokenizer.encode("😀", add_special_tokens=False)
    assert len(tokens) > 1
    assert b"".join(token_bytes(t) for t in tokens) == "😀".encode()


def test_generation_deadline_gives_504_and_cancels(tokenizer, engine):
    engine.first_token_delay_s = 5
    request = GenerationRequest("req-timeout", [1, 2, 3], build_sampling(tokenizer))

    async def run():
        generation = Generation(engine, request, TextStream(tokenizer), timeout_s=0.2)
        return [piece async for piece in generation.pieces()]

    with pytest.raises(EngineError) as caught:
        asyncio.run(run())
    assert caught.value.status == 504
    assert engine.cancelled == ["req-timeout"]


def test_the_deadline_is_on_progress_a_long_answer_is_never_cut(tokenizer, engine):
    """Tokens keep coming for 3x the deadline: the answer is whole. Then a
    stall after some tokens: what was generated comes back, ended "length"
    as by a limit (the dispatcher cancels it on the workers as for any failure)."""
    text = "the quick brown fox jumps over the lazy dog; a cat sat on the mat."
    engine.say(text)
    engine.token_delay_s = 0.1
    timeout_s = 0.5
    assert len(engine.script) * engine.token_delay_s > 3 * timeout_s

    async def run(request_id):
        request = GenerationRequest(request_id, [1, 2, 3], build_sampling(tokenizer))
        request.sampling.max_tokens = 100
        generation = Generation(engine, request, TextStream(tokenizer), timeout_s=timeout_s)
        return [piece async for piece in generation.pieces()]

    pieces = asyncio.run(run("long"))
    assert "".join(p.text for p in pieces) == text
    assert pieces[-1].finish_reason == "stop" and engine.finished == ["long"]

    engine.token_delay_s = 0.0
    engine.error_after = (3, EngineError(504, "request made no progress for 600s", code="timeout"))
    pieces = asyncio.run(run("stalled"))
    assert "".join(p.text for p in pieces) == tokenizer.decode(engine.script[:3])
    assert pieces[-1].finish_reason == "length"


def test_a_stalled_non_streamed_answer_returns_what_it_has(client, engine):
    engine.say("Paris is the capital of France")
    engine.error_after = (2, EngineError(504, "request made no progress for 600s", code="timeout"))
    answer = chat(client)
    assert answer.choices[0].message.content == tokenizer_text(engine, 2)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 2


def tokenizer_text(engine, n: int) -> str:
    return engine.tokenizer.decode(engine.script[:n]).lstrip(" ")


def build_sampling(tokenizer):
    return SamplingParams(max_tokens=10, stop_token_ids=sorted(tokenizer.eos_token_ids))


# --------------------------------------------------------------------------- #
# Chat and completions, the main paths
# --------------------------------------------------------------------------- #


def test_chat_non_streamed(client, engine, tokenizer):
    engine.cached_tokens = 4
    response = chat(client, "Say hello", max_tokens=20)
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == "tandem-test"
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "Hello world."
    assert choice.finish_reason == "stop"
    assert choice.logprobs is None
    generated = len(engine.script) + 1  # the EOS counts
    request = engine.requests[-1]
    expected_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello"}], add_generation_prompt=True, tokenize=True
    )
    assert request.prompt_tokens == list(expected_prompt)
    assert request.sampling.max_tokens == 20
    assert request.sampling.stop_token_ids == [engine.eos_id]
    assert response.usage.prompt_tokens == len(expected_prompt)
    assert response.usage.completion_tokens == generated
    assert response.usage.total_tokens == len(expected_prompt) + generated
    assert response.usage.prompt_tokens_details.cached_tokens == 4
    assert engine.finished == [request.request_id] and not engine.cancelled


def test_chat_streamed_with_usage(client, engine):
    engine.say("Hi 😀 你好!")
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Hi 😀 你好!"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(engine.script) + 1
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_content_parts_and_system_message(client, engine, tokenizer):
    client.chat.completions.create(
        model="default",  # the alias
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        ],
    )
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one\ntwo"}],
        add_generation_prompt=True,
        tokenize=True,
    )
    assert engine.requests[-1].prompt_tokens == list(expected)


def test_max_tokens_gives_length_and_default_fills_context(client, engine):
    engine.say("the quick brown fox jumps over the lazy dog")
    response = chat(client, max_completion_tokens=3)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 3
    chat(client)
    request = engine.requests[-1]
    assert request.sampling.max_tokens == engine.max_context - len(request.prompt_tokens)


def test_completions_non_streamed_and_streamed(client, engine, tokenizer):
    response = client.completions.create(model="tandem-test", prompt="The capital of France is", max_tokens=50)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.choices[0].text == "Hello world."
    assert response.choices[0].finish_reason == "stop"
    assert engine.requests[-1].prompt_tokens == tokenizer.encode("The capital of France is")

    chunks = list(client.completions.create(model="tandem-test", prompt=[[5, 6, 7]], stream=True, max_tokens=2))
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(engine.script[:2])
    assert chunks[-1].choices[0].finish_reason == "length"
    assert engine.requests[-1].prompt_tokens == [5, 6, 7]


def test_the_models_recommended_sampling_fills_what_a_request_leaves_out(engine, tokenizer, tmp_path):
    """A model folder's generation_config.json gives the defaults (shown in
    /v1/models); a request's own fields win; the answer's length defaults to
    the model's max_new_tokens, on every endpoint."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.3, "top_p": 0.85, "top_k": 40, "max_new_tokens": 7}))
    with serve_app(engine, tokenizer, model_dir=str(tmp_path)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=10)
        card = client.models.list().data[0]
        assert card.model_extra["generation_defaults"] == {"temperature": 0.3, "top_p": 0.85, "top_k": 40, "max_tokens": 7}
        chat(client)
        s = engine.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0.3, 0.85, 40, 7)
        chat(client, temperature=0, top_p=1, max_tokens=3, extra_body={"top_k": 0})
        s = engine.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (0, 1, 0, 3)
        client.completions.create(model="tandem-test", prompt="The capital of France is")
        s = engine.requests[-1].sampling
        assert (s.temperature, s.top_p, s.max_tokens) == (0.3, 0.85, 7)
        httpx.post(running.url + "/v1/messages", json={"model": "tandem-test", "max_tokens": 5,
                   "messages": [{"role": "user", "content": "Hi"}]}, timeout=10).raise_for_status()
        s = engine.requests[-1].sampling
        assert (s.temperature, s.top_p, s.max_tokens) == (0.3, 0.85, 5)
        served = httpx.post(running.url + "/v1/responses", json={"model": "tandem-test", "input": "Hi"}, timeout=10).json()
        assert (served["temperature"], served["top_p"]) == (0.3, 0.85)  # what it ran with, not OpenAI's 1.0


def test_sampling_parameters_reach_the_engine(client, engine):
    chat(
        client,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        presence_penalty=1.0,
        frequency_penalty=-1.0,
        logit_bias={"5": -100, "6": 50},
        user="someone",
        extra_body={"top_k": -1, "min_p": 0.1, "repetition_penalty": 1.1},
    )
    s = engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.seed, s.top_k, s.min_p, s.repetition_penalty) == (0.5, 0.9, 7, 0, 0.1, 1.1)
    assert (s.presence_penalty, s.frequency_penalty) == (1.0, -1.0)
    assert s.logit_bias == {"5": -100.0, "6": 50.0}


def test_chat_logprobs(client, engine, tokenizer):
    engine.say("Hi 😀")
    response = chat(client, logprobs=True, top_logprobs=2)
    entries = response.choices[0].logprobs.content
    assert [e.token for e in entries] == [TokenBytes(tokenizer).text(t) for t in engine.script]
    assert b"".join(bytes(e.bytes) for e in entries).decode() == "Hi 😀"
    assert all(e.logprob == -0.25 and len(e.top_logprobs) == 2 for e in entries)

    chunks = list(chat(client, logprobs=True, stream=True))
    streamed = [e for c in chunks for e in (c.choices[0].logprobs.content if c.choices[0].logprobs else [])]
    assert len(streamed) == len(engine.script) and all(e.top_logprobs == [] for e in streamed)


def test_completion_legacy_logprobs(client, engine):
    engine.say("Hello world.")
    response = client.completions.create(model="tandem-test", prompt="x", logprobs=3)
    lp = response.choices[0].logprobs
    assert "".join(lp.tokens) == "Hello world."
    assert lp.token_logprobs == [-0.25] * len(engine.script)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_stop_string_across_tokens_ends_and_cancels(client, engine, tokenizer):
    engine.say("Hello XYZSTOP and many more words that the engine would go on with")
    response = chat(client, stop=["XYZSTOP"])
    assert response.choices[0].message.content == "Hello "
    assert response.choices[0].finish_reason == "stop"
    assert engine.cancelled == [engine.requests[-1].request_id]

    chunks = list(client.completions.create(model="tandem-test", prompt="x", stop="XYZSTOP", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Hello "
    assert chunks[-1].choices[0].finish_reason == "stop"


def _next_turn(client, question, answer, again):
    """Ask `question`, then send the answer back with `again`; the engine's two prompts."""
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    client.chat.completions.create(model="tandem-test", messages=messages + [{"role": "user", "content": again}])


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_an_answer_sent_back_goes_in_as_the_tokens_it_was_generated_as(client, engine, tokenizer, stream):
    """The answer as generated (one token per character: not how the tokenizer
    cuts the same text) is what the next turn's prompt holds, so the KV that
    decode committed for it matches: the same text, the model's own tokens."""
    text = "Hello world. The capital of France is Paris."
    engine.script = [t for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]
    canonical = tokenizer.encode(text, add_special_tokens=False)
    assert len(canonical) < len(engine.script)  # really a different tokenization
    kwargs = dict(model="tandem-test", messages=[{"role": "user", "content": "Where is Paris?"}])
    if stream:
        answer = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    else:
        answer = client.chat.completions.create(**kwargs).choices[0].message.content
    assert answer == text
    first_prompt = engine.requests[-1].prompt_tokens
    _next_turn(client, "Where is Paris?", answer, "And Rome?")
    prompt = engine.requests[-1].prompt_tokens
    n = len(first_prompt)
    assert prompt[:n] == first_prompt
    assert prompt[n : n + len(engine.script)] == engine.script  # the answer as generated
    want = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where is Paris?"}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "And Rome?"}], add_generation_prompt=True, tokenize=True)
    assert prompt != list(want) and tokenizer.decode(prompt) == tokenizer.decode(want)


def test_an_answer_with_broken_utf8_comes_back_as_its_bytes(client, engine, tokenizer):
    """Half an emoji's bytes reach the client as U+FFFD, which tokenizes to
    other bytes: only the remembered tokens give decode's KV back."""
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1
    engine.script = tokenizer.encode("Hello there, ", add_special_tokens=False) + emoji[:-1] + \
        tokenizer.encode(" the quick brown fox.", add_special_tokens=False)
    answer = chat(client, "Hi").choices[0].message.content
    assert "\ufffd" in answer
    _next_turn(client, "Hi", answer, "What?")
    assert engine.script == engine.requests[-1].prompt_tokens[len(engine.requests[-2].prompt_tokens):][
        : len(engine.script)]


def test_an_answer_cut_by_a_stop_string_is_not_remembered(client, engine, tokenizer):
    engine.say("Hello world, the quick brown fox XYZSTOP jumps over the lazy dog")
    answer = chat(client, "Go", stop=["XYZSTOP"]).choices[0].message.content
    assert answer == "Hello world, the quick brown fox "
    _next_turn(client, "Go", answer, "More")
    want = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Go"}, {"role": "assistant", "content": answer},
         {"role": "user", "content": "More"}], add_generation_prompt=True, tokenize=True)
    assert engine.requests[-1].prompt_tokens == list(want)


def test_models_health_metrics(client, server, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tandem-test"]
    assert client.models.retrieve("tandem-test").id == "tandem-test"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["model"] == "tandem-test"
    engine.ready = False
    assert httpx.get(server.url + "/health").status_code == 503
    metrics = httpx.get(server.url + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "tandem_fake_requests_total" in metrics.text


def test_work_that_loses_its_cancel_after_a_disconnect_is_cancelled_again():
    """uvicorn drops what is sent after a disconnect, so work whose cancel was
    swallowed would run on unseen; it is cancelled again until it ends."""
    from router.api.http_stream import run_until_disconnect

    cancels = []

    async def work():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) == 2:
                    raise  # the first one is swallowed

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def main():
        await asyncio.wait_for(run_until_disconnect(receive, work()), 10)

    asyncio.run(main())
    assert len(cancels) == 2


def test_an_idle_connection_outlives_the_clients_own_keep_alive(server):
    """The openai client (httpx) keeps an idle connection for 5 s. With uvicorn's
    own default, also 5 s, a request sent as the server closed the socket failed
    with 'Connection error' (CI saw it once). The server must keep it longer:
    the running server's keep-alive (the default settings, as served) against the
    client's own, rather than a sleep past both; and an idle connection is reused."""
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    assert server.server.config.timeout_keep_alive > 2 * DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)

    def models():
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        assert response.status == 200 and b"tandem-test" in response.read()

    try:
        models()
        first_socket = conn.sock
        time.sleep(0.2)  # idle, briefly
        models()
        assert conn.sock is first_socket  # the same connection, still open
    finally:
        conn.close()


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


def test_unknown_model_is_404_listing_served_models(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-9" in caught.value.message and "tandem-test" in caught.value.message
    assert caught.value.body["param"] == "model"


@pytest.mark.parametrize(
    "kwargs, param, text",
    [
        ({"temperature": 3}, "temperature", "[0, 2]"),
        ({"top_p": 0}, "top_p", "(0, 1]"),
        ({"n": 2}, "n", "n > 1 is not supported"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "token id"),
        ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ],
)
def test_bad_values_are_400_naming_the_param(client, kwargs, param, text):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, **kwargs)
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param
    assert text in caught.value.message


def test_context_length_exceeded(client, engine):
    long_prompt = "the quick brown fox " * 200
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, long_prompt)
    assert caught.value.code == "context_length_exceeded"
    assert str(engine.max_context) in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, "hi", max_tokens=600)
    assert caught.value.code == "context_length_exceeded"
    assert "600" in caught.value.message and str(engine.max_context) in caught.value.message
    assert not engine.requests


def test_unsupported_content_part_is_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tandem-test",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    assert "image_url" in caught.value.message
    assert caught.value.body["param"] == "messages[0].content[0].type"


def test_fields_tandem_does_not_honour_are_400_naming_them(client, engine, server):
    """Nothing a client sends is silently dropped: the legacy `functions`,
    a peer's extension (`guided_json`), unknown stream_options, a message's
    unknown field, a tool call id on a user message, a completion's unknown
    field: each is a 400 naming it, through the openai SDK, and no request
    reaches the engine."""
    cases = [
        (dict(extra_body={"functions": [{"name": "f"}]}), "functions", "unsupported_parameter"),
        (dict(extra_body={"guided_json": {"type": "object"}}), "guided_json", "unsupported_parameter"),
        (dict(stream=True, stream_options={"include_usage": True, "include_obfuscation": False}),
         "stream_options.include_obfuscation", "unsupported_parameter"),
        (dict(response_format={"type": "json_object", "strict": True}), "response_format.strict",
         "unsupported_parameter"),
    ]
    for kwargs, param, code in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            chat(client, **kwargs)
        assert caught.value.code == code
        assert caught.value.body["param"] == param and f"'{param}'" in caught.value.message
    for message, param in [({"role": "user", "content": "hi", "tool_call_id": "call_1"}, "messages[0].tool_call_id"),
                           ({"role": "user", "content": "hi", "audio": {"id": "a"}}, "messages[0].audio"),
                           ({"role": "tool", "content": "sunny"}, "messages[0].tool_call_id")]:
        with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)) as caught:
            client.chat.completions.create(model="tandem-test", messages=[message])
        assert caught.value.body["param"] == param
    r = httpx.post(server.url + "/v1/completions", timeout=10,
                   json={"model": "tandem-test", "prompt": "hi", "guided_json": {"type": "object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
    assert r.json()["error"]["code"] == "unsupported_parameter"
    assert not engine.requests


def test_a_field_sent_as_null_is_taken_as_not_sent(client, engine):
    """Clients echo back whole message objects (`refusal`, `tool_calls`,
    `audio` as null): those are answered as if absent."""
    reply = client.chat.completions.create(
        model="tandem-test", tools=None,
        messages=[{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "Hello.", "refusal": None, "tool_calls": None, "audio": None},
                  {"role": "user", "content": "again"}],
        extra_body={"response_format": None})
    assert reply.choices[0].message.content == "Hello world." and len(engine.requests) == 1


def test_missing_or_mistyped_fields_are_422(client):
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="tandem-test", messages=None)
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        chat(client, temperature="hot")
    assert caught.value.body["param"] == "temperature" and "number" in caught.value.message
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.chat.completions.create(model="tandem-test", messages=[{"content": "hi"}])
    assert caught.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.UnprocessableEntityError) as caught:
        client.completions.create(model="tandem-test", prompt=None)
    assert caught.value.body["param"] == "prompt"


def test_malformed_json_is_400(server):
    response = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "tandem-test", "mess',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "JSON" in error["message"]
    assert httpx.post(server.url + "/v1/completions", content=b"[1, 2]",
                      headers={"content-type": "application/json"}).status_code == 400


@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", b'{"model": "tandem-test", "messages": [{"role": "user", "content": "hi \\ud800"}]}'),
    ("/v1/chat/completions", b'{"model": "tandem-test", "messages": [], "\\udfffx": 1}'),  # echoed by the 400
    ("/v1/messages", b'{"model": "tandem-test", "max_tokens": 5, "system": "\\uDBFF",'
                     b' "messages": [{"role": "user", "content": "hi"}]}'),
])
def test_a_lone_surrogate_is_a_400_not_a_500(server, path, raw):
    """JSON may escape half a UTF-16 pair: no tokenizer takes it and no JSON
    response can echo it (Starlette's encoder raised: a 500)."""
    response = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "surrogate" in response.text


def test_body_too_large_is_413(client, server):
    with pytest.raises(openai.APIStatusError) as caught:
        chat(client, "x" * (MAX_BODY + 1))
    assert caught.value.status_code == 413 and str(MAX_BODY) in caught.value.message

    def chunked_body():  # no Content-Length: the bytes actually read are counted
        for _ in range(4):
            yield b" " * (MAX_BODY // 2)

    response = httpx.post(server.url + "/v1/chat/completions", content=chunked_body(),
                          headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_api_key_required_on_all_but_health_and_metrics(auth_server):
    anonymous = openai.OpenAI(base_url=auth_server.url + "/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(anonymous)
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    assert httpx.get(auth_server.url + "/v1/models").status_code == 401
    assert httpx.get(auth_server.url + "/v2/anything").status_code == 401  # closed unless named open
    assert httpx.get(auth_server.url + "/health").status_code == 200
    assert httpx.get(auth_server.url + "/metrics").status_code == 200
    authorized = openai.OpenAI(base_url=auth_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=10)
    assert chat(authorized).choices[0].message.content == "Hello world."


def test_queue_full_is_429_with_retry_after(client, engine):
    engine.error_before = EngineError(429, "Queue full, retry later", retry_after=2.5, code="queue_full")
    with pytest.raises(openai.RateLimitError) as caught:
        chat(client)
    assert caught.value.response.headers["retry-after"] == "3"
    assert caught.value.code == "queue_full"
    with pytest.raises(openai.RateLimitError):  # a stream's status comes before its first byte
        list(chat(client, stream=True))


def test_no_worker_is_503(client, engine):
    engine.error_before = EngineError(503, "No worker is alive", retry_after=1.0)
    with pytest.raises(openai.InternalServerError) as caught:
        chat(client, stream=True)
    assert caught.value.status_code == 503 and "No worker" in caught.value.message
    assert caught.value.response.headers["retry-after"] == "1"


def test_error_mid_stream_is_an_sse_error_event(client, server, engine):
    engine.error_after = (3, EngineError(502, "decode worker died"))
    stream = chat(client, stream=True)
    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            received.append(chunk)
    assert "decode worker died" in caught.value.message
    assert received  # the stream had started

    body = {"model": "tandem-test", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200
    events = sse_events(response)
    assert json.loads(events[-1])["error"]["message"] == "decode worker died"
    assert "[DONE]" not in events


def test_unknown_route_has_openai_error_shape(server):
    response = httpx.get(server.url + "/v1/nothing")
    assert response.status_code == 404 and "error" in response.json()


# --------------------------------------------------------------------------- #
# Client disconnects cancel the request
# --------------------------------------------------------------------------- #


def test_closing_a_stream_cancels_the_request(client, engine):
    engine.say("the quick brown fox " * 20)
    engine.token_delay_s = 0.05
    stream = chat(client, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_for(lambda: engine.cancelled, 5, "the engine request was not cancelled")
    assert engine.cancelled == [engine.requests[-1].request_id]


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_while_engine_is_silent_cancels_promptly(server, engine, stream):
    engine.first_token_delay_s = 30  # a long prefill: nothing to send, so no failed send
    body = json.dumps({"model": "tandem-test", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        wait_for(lambda: engine.requests, 5, "the request did not reach the engine")
    closed_at = time.monotonic()
    wait_for(lambda: engine.cancelled, 10, "the engine request was not cancelled")
    # At once on a quiet box; a missed disconnect would be noticed only when the
    # first token (30 s away) failed to send.
    assert time.monotonic() - closed_at < 5


# --------------------------------------------------------------------------- #
# The embedded model's real tokenizer (skipped where it is not installed)
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def real_tokenizer():
    try:
        from mlx_lm.tokenizer_utils import load

        from workers.models.store import resolve_model

        return load(resolve_model(None))
    except Exception as exc:  # no embedded model package here
        pytest.skip(f"embedded model unavailable: {exc}")


def test_real_tokenizer_streams_split_characters_and_stops(real_tokenizer):
    text = "Hi 😀 你好, 🐈‍⬛ XYZSTOP tail"
    tokens = real_tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(real_tokenizer, ["XYZSTOP"])
    pieces = feed(stream, tokens)
    assert all("\ufffd" not in p for p in pieces)
    assert stream.stopped and "".join(pieces) == "Hi 😀 你好, 🐈‍⬛ "


def test_real_tokenizer_through_the_api(real_tokenizer):
    engine = FakeEngine(real_tokenizer, model_id="smollm2")
    engine.say("Paris 🇫🇷 is the capital.")
    with serve_app(engine, real_tokenizer) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=10)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(client.chat.completions.create(model="smollm2", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Paris 🇫🇷 is the capital."
    expected = real_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert engine.requests[-1].prompt_tokens == list(expected)
    assert engine.requests[-1].sampling.stop_token_ids == sorted(real_tokenizer.eos_token_ids)


def test_remembered_answers_are_bounded_by_tokens(tokenizer):
    from router.api.answer_tokens import AnswerTokens

    texts = [f"the quick brown fox number {i}" for i in range(3)]
    tokens = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    answers = AnswerTokens(TokenBytes(tokenizer), max_tokens=len(tokens[1]) + len(tokens[2]))
    for text, ids in zip(texts, tokens):
        answers.remember(text, ids)
    assert answers.get(texts[0]) is None  # the oldest went first
    assert answers.get(texts[1]).tolist() == tokens[1] and answers.get(texts[2]).tolist() == tokens[2]
    answers.remember("short", tokenizer.encode("short", add_special_tokens=False))  # too short to be worth it
    answers.remember("the lazy dog sat on the mat", tokens[0])  # not that text's tokens
    assert answers.get("short") is None and answers.get("the lazy dog sat on the mat") is None


def test_an_answer_whose_first_space_was_trimmed_comes_back_with_it(client, engine, tokenizer):
    """A chat answer's leading space never reaches the client; the next
    prompt holds the model's own first token, space and all."""
    engine.say(" Hello world, the quick brown fox.")
    answer = chat(client, "Hi").choices[0].message.content
    assert answer == "Hello world, the quick brown fox."
    _next_turn(client, "Hi", answer, "What?")
    n = len(engine.requests[-2].prompt_tokens)
    assert engine.requests[-1].prompt_tokens[n : n + len(engine.script)] == engine.script
