"""Tool calls and structured output on /v1/chat/completions, through the real
`openai` client against the router on a real uvicorn, with a scripted engine
(tests/support/fake_engine.py) saying what a model would: the prompt the
engine gets (tools rendered, earlier calls and results in it), the grammar it
is asked to follow, and the calls parsed out of its text, whole or streamed."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import llguidance
import openai
import pytest

from protos.grammar import ll_tokenizer
from router.api.tools import ToolFormat, ToolRequest, call_grammar_lark
from tests.support.fake_engine import FakeEngine, build_tokenizer
from tests.support.router_server import serve_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TWO = CALL + "\n" + CALL.replace("Paris", "Lyon")  # the second is cut short below


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, max_context=8192)


@pytest.fixture(scope="module")
def client(engine, tokenizer):
    with serve_app(engine, tokenizer, request_timeout_s=30) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def servers(engine, tokenizer):
    """The same router for the three APIs' clients: (openai, anthropic)."""
    with serve_app(engine, tokenizer, request_timeout_s=30) as server:
        yield (openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10),
               anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=10))


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


# --------------------------------------------------------------------------- #
# Forced calls: how many, and calls cut short on every API
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("choice, parallel, several", [
    ("get_weather", True, False), ("get_weather", False, False), ("required", True, True), ("required", False, False)])
def test_a_named_choice_gives_one_call_and_required_may_end_after_any(tokenizer, choice, parallel, several):
    """llguidance itself: a named function's grammar refuses a second call
    whatever parallel_tool_calls says; every forced grammar takes EOS once
    one call is whole, and "required" with parallel calls takes another."""
    lark = call_grammar_lark(ToolRequest([WEATHER["function"], TIME["function"]], choice, parallel),
                             ToolFormat.of(tokenizer))
    assert lark.splitlines()[0] == ('calls: call ("\\n" call)*' if several else "calls: call")
    m = llguidance.LLMatcher(ll_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark("start: calls\n" + lark))
    assert accepts(m, tokenizer, CALL) and m.is_accepting()
    eos = m.deep_copy()
    assert eos.consume_token(min(tokenizer.eos_token_ids)) and not eos.is_error()
    assert accepts(m.deep_copy(), tokenizer, "\n" + CALL.replace("Paris", "Lyon")) == several


def test_a_named_choice_with_parallel_calls_on_is_one_call(client, engine, tokenizer):
    engine.say(CALL)
    reply = ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                parallel_tool_calls=True)
    assert reply.choices[0].finish_reason == "tool_calls"
    m = matcher(engine, tokenizer)
    assert accepts(m, tokenizer, CALL) and not accepts(m, tokenizer, "\n<tool_call>")
    ask(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True)
    m = matcher(engine, tokenizer)
    assert accepts(m, tokenizer, CALL + "\n" + CALL)


def test_objects_that_list_their_properties_are_decoded_closed(client, engine, tokenizer):
    """pydantic's schemas (instructor's, LangChain's) leave additionalProperties
    out: under the grammar an object has only the properties it lists, else a
    small model adds keys until max_tokens. An object that says otherwise keeps its way."""
    open_call = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}
    engine.say(CALL)
    ask(client, tools=[open_call], tool_choice="required")
    assert accepts(matcher(engine, tokenizer), tokenizer, CALL)
    assert not accepts(matcher(engine, tokenizer), tokenizer, CALL.replace('"days": 2', '"days": 2, "note": "x"'))
    nested = {"type": "object", "properties": {"at": {"$ref": "#/$defs/place"}, "extra": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}},
        "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    ask(client, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": nested}})
    assert accepts(matcher(engine, tokenizer), tokenizer, '{"at": {"city": "Paris"}, "extra": {"a": 1, "b": 2}}')
    assert not accepts(matcher(engine, tokenizer), tokenizer, '{"at": {"city": "Paris", "zip": 1}}')
    assert not accepts(matcher(engine, tokenizer), tokenizer, '{"other": 1}')


def cut_at(tokenizer, text: str, mark: str) -> int:
    """The max_tokens that ends `text` (as the fake engine says it) just past `mark`'s last place."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    end = text.rindex(mark) + len(mark)
    return next(k for k in range(1, len(tokens) + 1) if len(tokenizer.decode(tokens[:k])) >= end)


def openai_stream(stream) -> tuple[str, dict, str]:
    """(content, {index: [id, name, arguments]}, finish_reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_chat_a_call_cut_by_max_tokens_is_the_call_so_far(client, engine, tokenizer, stream):
    engine.say(TWO)
    kwargs = dict(tools=[WEATHER], max_tokens=cut_at(tokenizer, TWO, '"Lyon", "da'))
    if stream:
        content, calls, finish = openai_stream(ask(client, stream=True, **kwargs))
        calls = [calls[i] for i in sorted(calls)]
    else:
        choice = ask(client, **kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        calls = [[c.id, c.function.name, c.function.arguments] for c in choice.message.tool_calls]
    assert finish == "length" and not content
    (first_id, first, whole), (second_id, second, so_far) = calls
    assert (first, second) == ("get_weather", "get_weather") and first_id != second_id
    assert json.loads(whole) == {"city": "Paris", "days": 2}
    assert so_far.startswith('{"city": "Lyon", "da') and "<" not in so_far


@pytest.mark.parametrize("stream", [False, True])
def test_chat_a_call_cut_before_its_name_is_dropped_and_a_cut_marker_is_never_content(client, engine, tokenizer,
                                                                                    stream):
    for text, mark, whole in [(TWO, '<tool_call>\n{"na', 1), ("Let me look.\n" + CALL, "<tool", 0)]:
        engine.say(text)
        kwargs = dict(tools=[WEATHER], max_tokens=cut_at(tokenizer, text, mark))
        if stream:
            content, calls, finish = openai_stream(ask(client, stream=True, **kwargs))
        else:
            choice = ask(client, **kwargs).choices[0]
            content, calls, finish = choice.message.content or "", choice.message.tool_calls or [], choice.finish_reason
        assert finish == "length" and len(calls) == whole
        assert content == ("" if whole else "Let me look.")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_a_call_cut_by_a_stop_string_is_the_call_so_far(client, engine, stream):
    engine.say(CALL)
    kwargs = dict(tools=[WEATHER], stop=['"days"'])
    if stream:
        content, calls, finish = openai_stream(ask(client, stream=True, **kwargs))
        [(_, name, so_far)] = calls.values()
    else:
        choice = ask(client, **kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        [call] = choice.message.tool_calls
        name, so_far = call.function.name, call.function.arguments
    assert finish == "stop" and not content and name == "get_weather"
    assert so_far.rstrip() == '{"city": "Paris",'


ANTHROPIC_WEATHER = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}


def test_messages_a_call_cut_short_is_a_tool_use_with_the_input_so_far(servers, engine, tokenizer):
    _, client = servers
    engine.say(TWO)
    kwargs = dict(model="tandem-test", messages=[{"role": "user", "content": "Weather?"}], tools=[ANTHROPIC_WEATHER],
                  max_tokens=cut_at(tokenizer, TWO, '"Lyon", "da'))
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens"
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Paris", "days": 2}),
                                                            ("tool_use", {"city": "Lyon"})]
    # Streamed: each block's input_json_delta fragments as they came, then max_tokens.
    events = list(client.messages.create(stream=True, **kwargs))
    blocks = [e.content_block.type for e in events if e.type == "content_block_start"]
    fragments: dict[int, str] = {}
    for e in events:
        if e.type == "content_block_delta":
            fragments[e.index] = fragments.get(e.index, "") + e.delta.partial_json
    stop_reason = [e.delta.stop_reason for e in events if e.type == "message_delta"]
    assert blocks == ["tool_use", "tool_use"] and stop_reason == ["max_tokens"]
    assert json.loads(fragments[0]) == {"city": "Paris", "days": 2}
    assert fragments[1].startswith('{"city": "Lyon", "da')
    # The SDK's own accumulation of the stream gives the input the whole answer has.
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.input for b in final.content] == [b.input for b in message.content]
    # Cut by a stop sequence inside the call: the same, stop_sequence.
    engine.say(CALL)
    stopped = client.messages.create(**{**kwargs, "max_tokens": 100}, stop_sequences=['"days"'])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", '"days"')
    assert [(b.type, b.input) for b in stopped.content] == [("tool_use", {"city": "Paris"})]


def test_responses_a_call_cut_short_is_an_incomplete_function_call(servers, engine, tokenizer):
    client, _ = servers
    engine.say(TWO)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    kwargs = dict(model="tandem-test", input="Weather?", tools=tools,
                  max_output_tokens=cut_at(tokenizer, TWO, '"Lyon", "da'))
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.incomplete"
    for response in (whole, events[-1].response):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert [(o.type, o.status) for o in response.output] == [("function_call", "completed"),
                                                                 ("function_call", "incomplete")]
        assert json.loads(response.output[0].arguments) == {"city": "Paris", "days": 2}
        assert response.output[1].arguments.startswith('{"city": "Lyon", "da')
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == whole.output[0].arguments + events[-1].response.output[1].arguments
    # The next turn goes on from whole calls only.
    engine.say("ok")
    client.responses.create(model="tandem-test", previous_response_id=whole.id, input="Go on.")
