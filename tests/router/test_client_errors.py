"""What a client sends is a 400 (or 404, 413, 422) in the API's own shape,
never a 500 (issue 42, finding 5): the router over a checking engine (the
scripted one of tests/support/fake_engine.py, which also checks every request
as the workers will: its sampling as workers/sampling.py check_sampling takes
it, its PrefillRequest through the wire codec, its grammar compiled by a
worker's Grammars), on a real uvicorn.

First the findings one by one, then a fuzz (hypothesis, as
tests/protos/test_codec_fuzz.py fuzzes the wire codec) of the HTTP schemas of
all three APIs with hostile values, which asserts no 500, errors in each API's
shape and no traceback in the log."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.codec import decode, encode
from protos.messages import PrefillRequest
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app
from workers.grammar import Grammars
from workers.sampling import check_sampling

ANTHROPIC = "/v1/messages"


class CheckingEngine(FakeEngine):
    """The scripted engine, refusing (and keeping in `problems`) a request a
    worker would fail on."""

    def reset(self) -> None:
        super().reset()
        self.problems: list[str] = []

    async def generate(self, req):
        try:
            check_sampling(req.sampling, len(self.tokenizer))
            decode(encode(PrefillRequest(req.request_id, req.prompt_tokens, req.sampling, "w",
                                         cache_salt=req.cache_salt)))
            if req.sampling.grammar:
                self.grammars.matcher(req.sampling.grammar)
        except Exception as exc:  # noqa: BLE001 - every way a worker would refuse it
            self.problems.append(f"{type(exc).__name__}: {exc}")
            raise
        async for event in super().generate(req):
            yield event


class Errors(logging.Handler):
    """Records at ERROR or with a traceback, from any logger (uvicorn's own
    do not reach the root logger, where caplog listens)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def engine(tokenizer):
    engine = CheckingEngine(tokenizer, max_context=4096)
    engine.grammars = Grammars(tokenizer)
    return engine


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, request_timeout_s=30) as running:
        errors = Errors()
        loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "uvicorn.asgi")]
        for logger in loggers:
            logger.addHandler(errors)
        running.errors = errors
        with httpx.Client(base_url=running.url, timeout=30) as http:
            running.http = http
            yield running
        for logger in loggers:
            logger.removeHandler(errors)


@pytest.fixture(autouse=True)
def fresh_engine(engine):
    engine.reset()
    engine.say("Hello world.")


def post(server, path: str, body: dict | bytes) -> httpx.Response:
    """The body sent (bytes as they are), the answer read whole; asserted to
    be no 5xx, in its API's shape, with nothing logged as an error."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = server.http.post(path, content=content, headers={"Content-Type": "application/json"})
    problems = [f"{r.name}: {r.getMessage()}" for r in server.errors.records]
    server.errors.records.clear()
    assert response.status_code < 500 and not problems, (response.status_code, response.text[:500], problems)
    if response.status_code != 200:
        error = response.json()
        if path.startswith(ANTHROPIC):
            assert error["type"] == "error" and isinstance(error["error"]["message"], str), error
        else:
            assert isinstance(error["error"]["message"], str) and "param" in error["error"], error
    return response


def refused(server, path: str, body: dict | bytes, param: str, status: int = 400) -> str:
    """The refusal's message, asserted a `status` naming `param`."""
    response = post(server, path, body)
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    if not path.startswith(ANTHROPIC):
        assert error["param"] == param, error
    assert param in error["message"], error
    return error["message"]


def chat(**fields) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": "Hello"}], **fields}


def anthropic(**fields) -> dict:
    return {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}], **fields}


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


# --------------------------------------------------------------------------- #
# The findings, one by one
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("key", ["²", "٣", "1²", "-1", "400", "9" * 5000, " 1", ""])
def test_a_logit_bias_key_that_is_no_token_id_is_a_400(server, key):
    refused(server, "/v1/chat/completions", chat(logit_bias={key: 1}), "logit_bias")
    refused(server, "/v1/completions", {"model": "default", "prompt": "Hi", "logit_bias": {key: 1}}, "logit_bias")


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**64, 2**70])
def test_a_seed_the_workers_prng_cannot_take_is_a_400(server, seed):
    refused(server, "/v1/chat/completions", chat(seed=seed, temperature=1.0), "seed")
    post(server, "/v1/chat/completions", chat(seed=2**64 - 1, temperature=1.0))  # the largest it takes


@pytest.mark.parametrize("top_k", [2**64, 2**70, 401, -2])
def test_top_k_past_the_vocabulary_is_a_400_on_both_apis(server, tokenizer, top_k):
    top_k = top_k if top_k != 401 else len(tokenizer) + 1
    refused(server, "/v1/chat/completions", chat(top_k=top_k), "top_k")
    assert "top_k" in refused(server, ANTHROPIC, anthropic(top_k=top_k), "top_k")
    post(server, ANTHROPIC, anthropic(top_k=len(tokenizer)))  # the whole vocabulary: off


def test_deeply_nested_tool_call_arguments_are_a_400(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep(100_000)}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "and?"}]
    param = "messages[1].tool_calls[0].function.arguments"
    refused(server, "/v1/chat/completions", chat(messages=messages), param)
    call["function"]["arguments"] = deep(500)  # parses, and would have broken what renders it
    refused(server, "/v1/chat/completions", chat(messages=messages), param)
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep(100_000)}]
    refused(server, "/v1/responses", {"model": "default", "input": items}, "input[0].arguments")


def test_a_deeply_nested_body_is_a_400_on_every_api(server):
    schema = {"type": "object"}
    for _ in range(400):  # a schema 400 levels deep (closing its objects recursed ~2 frames a level)
        schema = {"type": "object", "properties": {"a": schema}}
    for path, body in (("/v1/chat/completions", chat(response_format={
            "type": "json_schema", "json_schema": {"name": "deep", "schema": schema}})),
            (ANTHROPIC, anthropic(tools=[{"name": "f", "input_schema": schema}])),
            ("/v1/responses", {"model": "default", "input": "Hi", "tools": [
                {"type": "function", "name": "f", "parameters": schema}]})):
        response = post(server, path, body)
        assert response.status_code == 400 and "levels deep" in response.text, (path, response.text[:300])
    bracket_body = b'{"model": "default", "messages": ' + deep(100_000).encode() + b"}"
    assert post(server, "/v1/chat/completions", bracket_body).status_code == 400


REF_LOOPS = [
    {"$ref": "#"},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
     "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}}},
]


@pytest.mark.parametrize("schema", REF_LOOPS, ids=["root", "defs", "inner"])
def test_a_ref_loop_schema_is_refused_in_the_router(server, engine, schema):
    """The router compiled such schemas and the worker's grammar refused
    them (a 500): now the router computes each $ref target's first mask."""
    for path, body, param in (
            ("/v1/chat/completions", chat(response_format={
                "type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}), "response_format"),
            ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {
                "name": "f", "parameters": schema}}], tool_choice="required"), "tools"),
            (ANTHROPIC, anthropic(tools=[{"name": "f", "input_schema": schema}], tool_choice={"type": "any"}),
             "tools"),
            ("/v1/responses", {"model": "default", "input": "Hi", "text": {"format": {
                "type": "json_schema", "name": "loop", "schema": schema}}}, "text.format")):
        message = refused(server, path, body, param)
        assert "nothing can be generated" in message, message
    assert engine.requests == []


def test_a_forced_call_of_a_function_with_nested_models_compiles(server, engine):
    """pydantic's nested models refer to their root's $defs: inside the
    call's grammar the function's schema is no longer the root, so its refs
    are rebased (they named a pointer that did not exist: a 400)."""
    schema = {"$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}},
                                    "required": ["city"]}},
              "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}, "required": ["home"]}
    tools = [{"type": "function", "function": {"name": "move", "parameters": schema}}]
    for choice in ("required", {"type": "function", "function": {"name": "move"}}):
        assert post(server, "/v1/chat/completions", chat(tools=tools, tool_choice=choice)).status_code == 200
    assert engine.problems == [] and all(r.sampling.grammar for r in engine.requests)


# --------------------------------------------------------------------------- #
# The fuzz
# --------------------------------------------------------------------------- #

# A bounded number of examples: a few seconds in all; no example database in the checkout.
FUZZ = settings(deadline=None, max_examples=25, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def _nested(levels: int):
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def edges(values: list, other: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the edge cases a field has gone wrong on, sometimes anything of its kind."""
    return st.one_of(st.sampled_from(values), st.sampled_from(values), other)


INTS = edges([0, 1, -1, -2, 399, 400, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63), -(2**63) - 1,
              -(2**70)], st.integers())
NUMBERS = edges([1e308, -1e308, 5e-324, -0.0, 0.0, 0.5, 2.0, 2**64, -(2**70)],
                st.floats(allow_nan=False, allow_infinity=False) | INTS)
STRINGS = edges(["", "²", "٣", "0", "007", "1e3", " 1", "-1", "9" * 5000, "\x00", "default", "f", "{", deep(200)],
                st.text(max_size=12))
SCALARS = st.none() | st.booleans() | INTS | NUMBERS | STRINGS
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(STRINGS, inner, max_size=3),
                    max_leaves=6)
# What the body as a whole is refused for (nested too deep, a lone surrogate), in the fields that carry text.
DEEP = st.sampled_from([_nested(70), _nested(300), {"a": _nested(900)}, "\ud800"])
SCHEMAS = edges(REF_LOOPS + [
    {"type": "object"}, {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}},
    {"type": "integer", "minimum": 5, "maximum": 1}, {"enum": []}, {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}}, {"$ref": "http://example.com/schema"}, {"type": ["string", "null"]},
    {"type": "object", "properties": {"k": {"type": "array", "items": {"$ref": "#"}}}}, {"a": _nested(200)},
], JSON | DEEP)
ARGUMENTS = edges(["{}", '{"a": 1}', deep(100_000), "{" * 1000, '{"a":' * 900 + "1" + "}" * 900, deep(500),
                   "not json", "", "[]", "null"], STRINGS)
NAMES = edges(["f", "get_weather", "a" * 65, "bad name", ""], STRINGS)
BIAS_KEYS = edges(["²", "٣", "1²", "-1", "400", "9" * 20, "0", "5", ""], STRINGS)


@st.composite
def bodies(draw, base: dict, fields: dict) -> dict:
    """`base` with one of `fields` hostile, now and then two (mostly a value
    of the field's own kind, sometimes any JSON): the first field refused
    hides what the others would have done."""
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=draw(st.sampled_from([1, 1, 2])),
                              unique=True)):
        body[name] = draw(st.one_of(fields[name], fields[name], fields[name], JSON))
    if draw(st.integers(0, 19)) == 0:
        body["x_unknown"] = draw(JSON)
    return body


def _tool_call():
    return st.fixed_dictionaries({"id": STRINGS, "type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": NAMES, "arguments": ARGUMENTS | JSON | DEEP})})


CHAT_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]),
     "content": STRINGS | JSON | DEEP | st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": STRINGS}), max_size=2)},
    optional={"tool_calls": st.lists(_tool_call(), max_size=2), "tool_call_id": STRINGS, "name": STRINGS})
# A conversation that reaches its calls' arguments: the call, its result, the next question.
CALLS = _tool_call().map(lambda call: [
    {"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
    {"role": "tool", "tool_call_id": call["id"], "content": "ok"}, {"role": "user", "content": "and?"}])
SAMPLING = {**{k: INTS for k in ("seed", "top_k", "n", "max_tokens")},
            **{k: NUMBERS for k in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                    "frequency_penalty")},
            "logit_bias": st.dictionaries(BIAS_KEYS, NUMBERS, min_size=1, max_size=2),
            "stop": STRINGS | st.lists(STRINGS), "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSON}),
            "model": st.sampled_from(["default", "tandem-test", "gpt-4"]), "user": STRINGS, "cache_salt": STRINGS}
TOOLS = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": NAMES, "parameters": SCHEMAS})}), min_size=1, max_size=2)
CHAT_FIELDS = {
    **SAMPLING, "messages": CALLS | st.lists(CHAT_MESSAGE, max_size=3), "max_completion_tokens": INTS,
    "logprobs": st.booleans(), "top_logprobs": INTS, "tools": TOOLS, "parallel_tool_calls": st.booleans(),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]) | st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": NAMES, "schema": SCHEMAS})}),
}
COMPLETION_FIELDS = {**SAMPLING, "prompt": STRINGS | st.lists(INTS, max_size=4) | st.lists(st.lists(INTS, max_size=2),
                                                                                           max_size=2),
                     "logprobs": INTS, "echo": st.booleans(), "suffix": STRINGS, "best_of": INTS}
ANTHROPIC_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": STRINGS}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": STRINGS, "name": NAMES, "input": JSON | DEEP}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": STRINGS, "content": STRINGS | JSON}),
    st.fixed_dictionaries({"type": st.just("image"), "source": JSON}), JSON)
ANTHROPIC_TOOLS = st.lists(st.fixed_dictionaries({"name": NAMES, "input_schema": SCHEMAS}), min_size=1, max_size=2)
ANTHROPIC_FIELDS = {
    "max_tokens": INTS, "temperature": NUMBERS, "top_p": NUMBERS, "top_k": INTS, "stream": st.booleans(),
    "stop_sequences": st.lists(STRINGS, max_size=5), "system": STRINGS | JSON | DEEP, "metadata": JSON | DEEP,
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                                "content": STRINGS | st.lists(ANTHROPIC_BLOCK, max_size=3)}),
                         max_size=3).map(lambda m: m + [{"role": "user", "content": "Hi"}]),
    "tools": ANTHROPIC_TOOLS,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                         optional={"name": NAMES, "disable_parallel_tool_use": JSON}),
}
RESPONSES_ITEM = st.one_of(
    st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "assistant", "system"]),
                           "content": STRINGS | JSON}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": STRINGS, "name": NAMES,
                           "arguments": ARGUMENTS | JSON | DEEP}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": STRINGS, "output": STRINGS | JSON}),
    JSON)
RESPONSES_FIELDS = {
    "input": STRINGS | st.lists(RESPONSES_ITEM, min_size=1, max_size=3), "instructions": STRINGS,
    "max_output_tokens": INTS, "temperature": NUMBERS, "top_p": NUMBERS, "stream": st.booleans(),
    "store": st.booleans(), "previous_response_id": STRINGS, "metadata": JSON | DEEP, "user": STRINGS,
    "cache_salt": STRINGS,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": NAMES, "parameters": SCHEMAS}),
                      min_size=1, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(["json_schema", "json_object", "text"]), "name": NAMES, "schema": SCHEMAS})}),
}
APIS = {
    "chat": ("/v1/chat/completions", bodies(chat(), CHAT_FIELDS)),
    "completions": ("/v1/completions", bodies({"model": "default", "prompt": "Hello"}, COMPLETION_FIELDS)),
    "messages": (ANTHROPIC, bodies(anthropic(), ANTHROPIC_FIELDS)),
    "count_tokens": (ANTHROPIC + "/count_tokens", bodies({"model": "default", "messages": [
        {"role": "user", "content": "Hello"}]}, {k: ANTHROPIC_FIELDS[k] for k in ("messages", "system", "tools")})),
    "responses": ("/v1/responses", bodies({"model": "default", "input": "Hello"}, RESPONSES_FIELDS)),
}


@pytest.mark.parametrize("api", APIS)
def test_hostile_bodies_get_no_500_and_log_no_traceback(server, engine, api):
    path, strategy = APIS[api]

    @FUZZ
    @given(body=strategy)
    def check(body):
        engine.reset()
        post(server, path, body)
        assert engine.problems == [], (body, engine.problems)

    check()
