"""OpenAI's Responses API (`/v1/responses`), through the real `openai` client
against the router on a real uvicorn, with a scripted engine
(tests/support/fake_engine.py): text and tool calls, streamed and not, a
conversation continued by previous_response_id from the prompt's cached
prefix, grammars for forced calls and JSON formats, errors naming the field."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import llguidance
import openai
import pytest

from protos.grammar import ll_tokenizer
from router.routing.engine_api import EngineError
from router.api.errors import ApiError
from router.api.generation import Piece
from router.api.response_store import ResponseStore, StoredResponse
from router.api.responses_format import ResponsesFormat, answer_message
from router.api.responses_request import responses_turn
from tests.support.fake_engine import FakeEngine
from tests.support.router_server import serve_app

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# A call written unlike Tandem renders one: a prompt that repeats it must hold the model's own text.
OWN_CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
ANSWER = "Hello world. The capital of France is Paris."


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
    engine.say(ANSWER)
    yield


def create(client, input="What is the capital of France?", **kwargs):
    return client.responses.create(model="tandem-test", input=input, **kwargs)


def prompt_text(engine, tokenizer, request=-1) -> str:
    return tokenizer.decode(engine.requests[request].prompt_tokens)


def accepts(engine, tokenizer, text: str) -> bool:
    """Whether the grammar the engine was asked to follow accepts `text`."""
    grammar = engine.requests[-1].sampling.grammar
    assert grammar
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(tokens) == len(tokens) and not matcher.is_error()


# --------------------------------------------------------------------------- #
# Text
# --------------------------------------------------------------------------- #


def test_create_answers_text_with_usage(client, engine, tokenizer):
    engine.cached_tokens = 5
    response = create(client, instructions="Answer briefly.", max_output_tokens=100, temperature=0.5,
                      metadata={"run": "7"})
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == ANSWER
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    request = engine.requests[-1]
    assert response.usage.input_tokens == len(request.prompt_tokens)
    assert response.usage.output_tokens == len(engine.script) + 1  # the end-of-sequence token counts
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.input_tokens_details.cached_tokens == 5
    assert request.sampling.max_tokens == 100 and request.sampling.temperature == 0.5
    prompt = prompt_text(engine, tokenizer)
    assert prompt.index("Answer briefly.") < prompt.index("What is the capital of France?")
    assert response.instructions == "Answer briefly." and response.metadata == {"run": "7"}
    assert response.max_output_tokens == 100 and response.temperature == 0.5


def test_content_parts_and_roles_go_into_the_prompt(client, engine, tokenizer):
    create(client, input=[
        {"role": "developer", "content": "Be kind."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "first"},
                                                        {"type": "input_text", "text": "second"}]}])
    prompt = prompt_text(engine, tokenizer)
    assert "<|im_start|>developer\nBe kind." in prompt and "<|im_start|>user\nfirst\nsecond" in prompt


def test_stream_sends_the_event_sequence(client, engine):
    events = list(create(client, stream=True))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-5:] == ["response.output_text.delta", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == ANSWER
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == ANSWER and final.usage.output_tokens == len(engine.script) + 1
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"


def test_stream_helper_gives_the_final_response(client):
    with client.responses.stream(model="tandem-test", input="Hi") as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == ANSWER == final.output_text


def test_max_output_tokens_makes_it_incomplete(client, engine):
    response = create(client, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = list(create(client, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_an_error_mid_stream_is_an_error_event(client, engine):
    engine.error_after = (3, EngineError(502, "decode worker died"))
    events = list(create(client, stream=True))
    assert events[-2].type == "error" and "decode worker died" in events[-2].message
    assert events[-1].type == "response.failed" and events[-1].response.status == "failed"


def test_an_error_before_the_stream_is_an_http_error(client, engine):
    engine.error_before = EngineError(429, "Queue full, retry later", retry_after=1.0, code="queue_full")
    with pytest.raises(openai.RateLimitError) as caught:
        create(client, stream=True)
    assert caught.value.body["code"] == "queue_full"


# --------------------------------------------------------------------------- #
# Tool calls
# --------------------------------------------------------------------------- #


def test_a_call_is_a_function_call_item(client, engine, tokenizer):
    engine.say(CALL)
    response = create(client, input="Weather in Paris?", tools=[WEATHER, TIME])
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": "Paris"}
    prompt = prompt_text(engine, tokenizer)
    assert "<tools>" in prompt and '"get_time"' in prompt  # the tools in Tandem's default rendering
    assert [t.name for t in response.tools] == ["get_weather", "get_time"] and response.tool_choice == "auto"


def test_a_streamed_call_sends_argument_deltas(client, engine):
    engine.say("Let me look.\n" + CALL)
    with client.responses.stream(model="tandem-test", input="Weather?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call"] and added[1].name == "get_weather"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and json.loads("".join(deltas)) == {"city": "Paris"}
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == "".join(deltas) and done.item_id == added[1].id
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me look." and final.output[1].arguments == done.arguments


def test_a_call_that_does_not_parse_comes_back_as_text(client, engine):
    engine.say('<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>')
    response = create(client, tools=[WEATHER])
    assert [o.type for o in response.output] == ["message"] and "Paris" in response.output_text
    with client.responses.stream(model="tandem-test", input="Weather?", tools=[WEATHER]) as stream:
        final = stream.get_final_response()
    # Streamed, its item had begun: it ends incomplete, its text comes as the message.
    assert [(o.type, o.status) for o in final.output] == [("function_call", "incomplete"), ("message", "completed")]
    assert "Paris" in final.output_text
    create(client, previous_response_id=final.id, input="Try again.")  # the conversation goes on


def test_previous_response_id_continues_from_the_cached_prefix(client, engine, tokenizer):
    engine.say(OWN_CALL)
    first = create(client, input="Weather in Paris?", tools=[WEATHER], instructions="Use tools.")
    answer_tokens = list(engine.script)
    [call] = first.output
    engine.say("It is sunny in Paris today, enjoy your walk.")
    second = create(client, previous_response_id=first.id, tools=[WEATHER], instructions="Use tools.",
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    p1, p2 = engine.requests[0].prompt_tokens, engine.requests[1].prompt_tokens
    # The prompt repeats the first prompt and the first answer's own tokens:
    # the prefix cache holds their KV.
    assert p2[:len(p1) + len(answer_tokens)] == p1 + answer_tokens
    assert "sunny, 21 C" in prompt_text(engine, tokenizer)
    assert second.previous_response_id == first.id and second.output_text.startswith("It is sunny")

    answer_tokens = list(engine.script)
    engine.say(ANSWER)
    create(client, previous_response_id=second.id, tools=[WEATHER], instructions="Use tools.", input="Thanks!")
    p3 = engine.requests[2].prompt_tokens
    assert p3[:len(p2) + len(answer_tokens)] == p2 + answer_tokens
    # Instructions are not carried over.
    create(client, previous_response_id=second.id, tools=[WEATHER], input="Thanks!")
    assert "Use tools." not in prompt_text(engine, tokenizer) and "sunny, 21 C" in prompt_text(engine, tokenizer)


def test_output_items_sent_back_as_input_give_the_same_prompt(client, engine):
    def first_turn(**kwargs):
        engine.say("Let me look.\n" + OWN_CALL)
        response = create(client, input="Weather?", tools=[WEATHER], **kwargs)
        engine.say(ANSWER)
        return response, {"type": "function_call_output", "call_id": response.output[1].call_id, "output": "sunny"}

    first, result = first_turn(store=False)
    items = [o.model_dump(exclude_none=True) for o in first.output]
    create(client, tools=[WEATHER], input=[{"role": "user", "content": "Weather?"}, *items, result])
    stateless = engine.requests[-1].prompt_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)  # store=false: not kept
    stored, result = first_turn()
    create(client, previous_response_id=stored.id, tools=[WEATHER], input=[result])
    assert engine.requests[-1].prompt_tokens == stateless


def test_required_and_named_tool_choice_constrain(client, engine, tokenizer):
    engine.say(CALL)
    create(client, tools=[WEATHER, TIME], tool_choice="required")
    assert accepts(engine, tokenizer, CALL) and not accepts(engine, tokenizer, "It is sunny")
    create(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_time"})
    assert not accepts(engine, tokenizer, CALL)
    assert accepts(engine, tokenizer, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    create(client, tools=[WEATHER])
    assert engine.requests[-1].sampling.grammar == ""  # auto: free text


def test_text_format_json_schema_is_a_grammar(client, engine, tokenizer):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    engine.say('{"answer": "Paris"}')
    response = create(client, text={"format": {"type": "json_schema", "name": "result", "schema": schema,
                                               "strict": True}})
    assert json.loads(response.output_text) == {"answer": "Paris"}
    assert accepts(engine, tokenizer, '{"answer": "x"}') and not accepts(engine, tokenizer, '{"answer": 1}')
    assert response.text.format.type == "json_schema"
    create(client, text={"format": {"type": "json_object"}})
    assert accepts(engine, tokenizer, '{"any": [1]}') and not accepts(engine, tokenizer, "[1]")


# --------------------------------------------------------------------------- #
# Stored responses and errors
# --------------------------------------------------------------------------- #


def test_a_stored_response_is_retrieved_and_deleted(client):
    response = create(client)
    assert client.responses.retrieve(response.id).output_text == ANSWER
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_an_unknown_previous_response_id_is_an_error_naming_it(client, engine):
    with pytest.raises(openai.NotFoundError) as caught:
        create(client, previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id" and "resp_nope" in caught.value.body["message"]
    assert not engine.requests


@pytest.mark.parametrize("kwargs, param", [
    (dict(reasoning={"effort": "low"}), "reasoning"),
    (dict(extra_body={"truncation": "auto"}), "truncation"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(tools=[{**WEATHER, "defer_loading": True}]), "tools[0].defer_loading"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].name"),
    (dict(text={"format": {"type": "json_schema", "name": "r", "schema": {"type": "wat"}}}), "text.format"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]),
     "input[0].content[0].type"),
    (dict(input=[{"role": "user", "content": "hi"}, {"role": "robot", "content": "hi"}]), "input[1].role"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]), "input[0].arguments"),
    (dict(max_output_tokens=10_000), "max_output_tokens"),
])
def test_a_refused_field_is_a_400_naming_it(client, engine, kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, **kwargs)
    assert caught.value.body["param"] == param, caught.value.body
    assert not engine.requests


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(max_responses=2, max_tokens=100)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, [], 10))
    store.get("a")  # now the most recent
    store.put(StoredResponse({"id": "c"}, [], 10))
    assert [store.get(i).response["id"] for i in ("a", "c")] == ["a", "c"] and len(store) == 2
    with pytest.raises(ApiError, match="not found"):
        store.get("b")
    store.put(StoredResponse({"id": "d"}, [], 95))  # over the token bound: only it stays
    assert len(store) == 1 and store.get("d")


def test_the_store_is_bounded_in_bytes_and_counts_metadata():
    store = ResponseStore(max_bytes=10_000, max_key_bytes=10_000)
    big = StoredResponse({"id": "big", "metadata": {"k": "x" * 4000}}, [{"role": "user", "content": "hi"}], 10)
    store.put(big)
    assert 4000 < store.size == big.size < 5500  # its objects, the metadata most of them
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name, "metadata": {"k": "y" * 3000}}, [], 10))
    assert store.size <= 10_000 and [store.get(i).response["id"] for i in ("a", "b")] == ["a", "b"]
    with pytest.raises(ApiError, match="not found"):
        store.get("big")  # the least recently used went to make room
    store.put(StoredResponse({"id": "huge", "metadata": {"k": "z" * 20_000}}, [], 10))  # larger than all: not kept
    with pytest.raises(ApiError, match="not found"):
        store.get("huge")
    assert len(store) == 2 and store.refused == 1


def test_a_key_past_its_share_evicts_its_own_responses_never_another_keys():
    store = ResponseStore(max_responses=4, max_bytes=20_000, max_key_bytes=8_000)
    store.put(StoredResponse({"id": "theirs"}, [{"role": "user", "content": "t" * 1000}], 10), tenant="b")
    for i in range(30):  # a flood, in bytes and in number
        store.put(StoredResponse({"id": f"mine{i}"}, [{"role": "user", "content": "m" * 1000}], 10), tenant="a")
        assert store.held("a") <= 8_000 and store.size <= 20_000 and len(store) <= 4
    assert store.get("theirs", tenant="b").response["id"] == "theirs"
    assert store.get("mine29", tenant="a") and len(store) == 4
    with pytest.raises(ApiError, match="not found"):
        store.get("mine0", tenant="a")
    with pytest.raises(ApiError, match="not found"):
        store.get("theirs", tenant="a")  # and a key never reads another's


OVER_METADATA = [
    ({f"k{i}": "v" for i in range(17)}, "metadata", "at most 16 keys"),
    ({"k" * 65: "v"}, "metadata", "at most 64 characters"),
    ({"note": "v" * 513}, "metadata.note", "at most 512 characters"),
]


@pytest.mark.parametrize("metadata, param, says", OVER_METADATA)
def test_metadata_past_openais_bounds_is_a_400_naming_it(client, engine, metadata, param, says):
    with pytest.raises(openai.BadRequestError) as caught:
        create(client, metadata=metadata)
    assert caught.value.body["param"] == param and says in caught.value.body["message"], caught.value.body
    assert not engine.requests


def test_metadata_at_openais_bounds_is_kept():
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    turn = responses_turn({"model": "m", "input": "hi", "metadata": metadata}, ResponseStore(), images=False)
    assert turn.echo["metadata"] == metadata


def test_a_flooding_key_keeps_within_its_share_and_another_keys_conversation_goes_on(engine, tokenizer):
    share, total = 64 << 10, 96 << 10
    with serve_app(engine, tokenizer, api_keys=("sk-a", "sk-b"), request_timeout_s=30,
                   stored_responses_key_bytes=share, stored_responses_bytes=total) as server:
        a, b = (openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=10)
                for key in ("sk-a", "sk-b"))
        theirs = create(b, input="What is the capital of France?")
        flood = [create(a, input="the quick brown fox " * 600, metadata={"n": "x" * 512}) for _ in range(6)]
        with pytest.raises(openai.NotFoundError):
            a.responses.retrieve(flood[0].id)  # its own oldest went
        assert a.responses.retrieve(flood[-1].id).id == flood[-1].id
        held = httpx.get(server.url + "/metrics", timeout=10).text
        stored = float(re.search(r"^tandem_stored_response_bytes (\S+)$", held, re.M).group(1))
        assert 0 < stored <= total
        assert create(b, previous_response_id=theirs.id, input="Thanks!").output_text == ANSWER


# --------------------------------------------------------------------------- #
# Reasoning (the fake tokenizer has no thinking markers: pieces fed directly)
# --------------------------------------------------------------------------- #


def test_reasoning_is_a_reasoning_item_before_the_message():
    turn = responses_turn({"model": "m", "input": "Why?"}, ResponseStore(), images=False)
    store = ResponseStore()
    fmt = ResponsesFormat("resp_1", "m", turn, store, count_tokens=lambda text: len(text.split()))
    generation = SimpleNamespace(calls=[], output=None, cached_tokens=0, usage=lambda: {
        "prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10})
    events = []
    for i, piece in enumerate([Piece("", reasoning="Because it"), Piece("", reasoning=" is."),
                               Piece("It is."), Piece("", finish_reason="stop")]):
        events += fmt.stream_piece(piece, first=i == 0)
    events += fmt.stream_end(generation)
    parsed = [json.loads(e.decode().split("data: ", 1)[1]) for e in events]
    types = [e["type"] for e in parsed]
    assert types.index("response.reasoning_text.delta") < types.index("response.output_text.delta")
    final = parsed[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Because it is."}]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    conversation = store.get("resp_1").conversation
    assert conversation[-1] == {"role": "assistant", "content": "It is.", "reasoning_content": "Because it is."}


def test_reasoning_and_calls_come_back_as_one_assistant_message():
    output = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Think."}]},
              {"type": "function_call", "status": "completed", "call_id": "call_1", "name": "f", "arguments": "{}"}]
    message = answer_message(output)
    turn = responses_turn({"model": "m", "input": [
        {"role": "user", "content": "Go"}, {"type": "reasoning", "id": "rs_1", "summary": [],
                                            "content": [{"type": "reasoning_text", "text": "Think."}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]}, ResponseStore(), images=False)
    assert turn.chat["messages"][1] == message
    assert turn.chat["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
