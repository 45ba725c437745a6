"""Tool calls and structured output on /v1/chat/completions, through the real
`openai` client against the router on a real uvicorn, with a scripted engine
(tests/support/fake_engine.py) saying what a model would: the prompt the
engine gets (tools rendered, earlier calls and results in it), the grammar it
is asked to follow, and the calls parsed out of its text, whole or streamed."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import openai
import pytest

from protos.grammar import ll_tokenizer
from tests.support.fake_engine import FakeEngine, build_tokenizer
from tests.support.router_server import serve_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, max_context=8192)


@pytest.fixture(scope="module")
def client(engine, tokenizer):
    with serve_app(engine, tokenizer, request_timeout_s=30) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture(autouse=True)
def fresh_engine(engine):
    engine.reset()
    yield


def ask(client, content="What is the weather in Paris?", **kwargs):
    return client.chat.completions.create(
        model="tandem-test", messages=[{"role": "user", "content": content}], **kwargs)


def prompt_text(engine, tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1].prompt_tokens)


def matcher(engine, tokenizer):
    """A matcher over the grammar the engine was asked to follow."""
    grammar = engine.requests[-1].sampling.grammar
    assert grammar
    return llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar)


def accepts(m, tokenizer, text: str) -> bool:
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(tokens) == len(tokens) and not m.is_error()


def test_a_call_comes_back_as_tool_calls_and_the_tools_are_in_the_prompt(client, engine, tokenizer):
    engine.say(CALL)
    reply = ask(client, tools=[WEATHER, TIME])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    prompt = prompt_text(engine, tokenizer)
    # The fake model's template has no tools section: Tandem's default rendering.
    assert "<tools>" in prompt and '"get_time"' in prompt and "<tool_call>" in prompt
    assert engine.requests[-1].sampling.grammar == ""  # "auto": free text


def test_streamed_call_arrives_as_deltas_and_no_markup_leaks(client, engine):
    engine.say("Let me look.\n" + CALL)
    stream = ask(client, tools=[WEATHER], stream=True)
    content, starts, fragments, finish = "", [], [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                starts.append((d.index, d.id, d.function.name))
            elif d.function.arguments:
                fragments.append(d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look." and "<" not in content
    assert [(i, name) for i, _, name in starts] == [(0, "get_weather")]
    # Arguments stream as the model writes them, not as one block at the end.
    assert len(fragments) > 3 and json.loads("".join(fragments)) == {"city": "Paris", "days": 2}
    assert finish == "tool_calls"


def test_parallel_calls_get_their_own_index_and_id(client, engine):
    engine.say(CALL + "\n" + CALL.replace("Paris", "Lyon"))
    calls = ask(client, tools=[WEATHER]).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Lyon"]
    assert len({c.id for c in calls}) == 2


def test_parallel_calls_off_ends_the_answer_after_its_first_call(client, engine):
    engine.say(CALL + "\n" + CALL.replace("Paris", "Lyon"))
    choice = ask(client, tools=[WEATHER], parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in choice.message.tool_calls] == ["Paris"]
    assert choice.finish_reason == "tool_calls" and engine.cancelled == [engine.requests[-1].request_id]


def test_text_without_a_call_is_content(client, engine):
    engine.say("It is sunny in Paris.")
    choice = ask(client, tools=[WEATHER]).choices[0]
    assert choice.message.content == "It is sunny in Paris." and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_history_with_calls_and_results_goes_into_the_prompt(client, engine, tokenizer):
    engine.say("It is sunny.")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    client.chat.completions.create(model="tandem-test", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    prompt = prompt_text(engine, tokenizer)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "sunny, 21 C" in prompt
    assert prompt.index("get_weather", prompt.index("</tools>")) < prompt.index("sunny, 21 C")


def test_a_call_sent_back_goes_in_as_written_unless_the_client_changed_it(client, engine, tokenizer):
    """The model's own text for its call makes the next prompt a prefix the
    cache holds; a call (or the text before it) the client edited goes in as sent."""
    written = 'Checking.\n<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    engine.say(written)
    call = ask(client, tools=[WEATHER]).choices[0].message.tool_calls[0]
    history = [{"role": "user", "content": "What is the weather in Paris?"}, None,
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    sent = {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}
    edited = {**sent, "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    for content, calls, kept in [("Checking.", [sent], True), ("Checking.", [edited], False),
                                 ("Something else.", [sent], False)]:
        engine.say("ok")
        history[1] = {"role": "assistant", "content": content, "tool_calls": calls}
        client.chat.completions.create(model="tandem-test", tools=[WEATHER], messages=history)
        prompt = prompt_text(engine, tokenizer)
        assert (written in prompt) == kept
        assert content in prompt and ("Lyon" in prompt) == (calls == [edited])


def test_required_and_named_choices_constrain_to_valid_calls(client, engine, tokenizer):
    engine.say(CALL)
    ask(client, tools=[WEATHER, TIME], tool_choice="required")
    assert accepts(matcher(engine, tokenizer), tokenizer, CALL)
    assert not accepts(matcher(engine, tokenizer), tokenizer, "It is sunny")
    # Arguments that break the tool's schema are refused: an unknown property.
    bad = CALL.replace('"days": 2', '"weeks": 2')
    assert not accepts(matcher(engine, tokenizer), tokenizer, bad)

    engine.say(CALL)
    ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False)
    m = matcher(engine, tokenizer)
    assert not accepts(m, tokenizer, CALL)  # only get_time may be called
    m = matcher(engine, tokenizer)
    assert accepts(m, tokenizer, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(m, tokenizer, "\n<tool_call>")  # one call only


def test_choice_none_renders_no_tools_and_parses_none(client, engine, tokenizer):
    engine.say(CALL)
    choice = ask(client, tools=[WEATHER], tool_choice="none").choices[0]
    assert "<tools>" not in prompt_text(engine, tokenizer)
    assert choice.message.content == CALL and not choice.message.tool_calls


def test_response_format_json_schema_is_a_grammar(client, engine, tokenizer):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}, "score": {"type": "integer"}},
              "required": ["answer", "score"], "additionalProperties": False}
    engine.say('{"answer": "Paris", "score": 3}')
    reply = ask(client, response_format={"type": "json_schema",
                                          "json_schema": {"name": "result", "schema": schema, "strict": True}})
    assert json.loads(reply.choices[0].message.content) == {"answer": "Paris", "score": 3}
    assert accepts(matcher(engine, tokenizer), tokenizer, '{"answer": "x", "score": 1}')
    assert not accepts(matcher(engine, tokenizer), tokenizer, '{"answer": 1}')
    ask(client, response_format={"type": "json_object"})
    assert accepts(matcher(engine, tokenizer), tokenizer, '{"any": [1, 2]}')
    assert not accepts(matcher(engine, tokenizer), tokenizer, '[1]')
    # With tools offered: a call or the JSON answer, each under its schema.
    ask(client, tools=[WEATHER], response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    assert accepts(matcher(engine, tokenizer), tokenizer, CALL)
    assert accepts(matcher(engine, tokenizer), tokenizer, '{"answer": "x", "score": 1}')


@pytest.mark.parametrize("kwargs, param, error", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name", openai.BadRequestError),
    (dict(tool_choice="required"), "tool_choice", openai.BadRequestError),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type", openai.BadRequestError),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name", openai.BadRequestError),
    (dict(tools={"get_weather": WEATHER}), "tools", openai.UnprocessableEntityError),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "wat"}}}),
     "response_format", openai.BadRequestError),
    (dict(response_format={"type": "xml"}), "response_format.type", openai.BadRequestError),
])
def test_bad_tools_and_formats_are_errors_naming_the_field(client, engine, kwargs, param, error):
    with pytest.raises(error) as caught:
        ask(client, **kwargs)
    assert caught.value.body["param"] == param
    assert not engine.requests


def test_a_call_with_unparseable_arguments_is_returned_as_text(client, engine):
    engine.say('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>')
    choice = ask(client, tools=[WEATHER]).choices[0]
    assert not choice.message.tool_calls and "Paris" in choice.message.content
    assert choice.finish_reason == "stop"


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A reasoning model's tokenizer (its template opens <think>) behind its own server."""
    tok = build_tokenizer(Path(tmp_path_factory.mktemp("thinking")), thinking=True)
    engine = FakeEngine(tok, max_context=8192)
    with serve_app(engine, tok, request_timeout_s=30) as server:
        yield engine, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def test_a_reasoning_models_thinking_is_reasoning_content(thinking):
    engine, client = thinking
    engine.reset()
    engine.say("The user wants Paris.</think>\n\nThe capital is Paris.")
    message = ask(client).choices[0].message
    assert message.content == "The capital is Paris."
    assert message.model_extra["reasoning_content"] == "The user wants Paris."
    engine.say("Paris it is.</think>\n\n" + CALL)
    reasoning, content, calls = "", "", []
    for chunk in ask(client, tools=[WEATHER], stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
    assert reasoning == "Paris it is." and content == "" and calls[0].function.name == "get_weather"
