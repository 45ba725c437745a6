"""Agents against a real `tandem serve` (router, prefill and decode workers,
cache service): forced tool calls and JSON answers decoded under their
grammars in the continuous batch, schema-valid however the model would have
answered; free requests untouched beside them; and a tool loop run by an
agent framework (the OpenAI Agents SDK, from the package index);
structured-output clients (instructor, LangChain's `with_structured_output`)
at the max_tokens they send.

Two servers. What only the grammars decide (a call's shape, its deltas, a
client's parsing) is asked of a float32 random tiny llama with the embedded
tokenizer and chat template (the same grammars over the same vocabulary; a
random model tries every continuation a grammar leaves open, and a token costs
~1 ms of model instead of ~0.1 s: a forced call is ~40 tokens). What needs a
model that follows the conversation (the agent framework's arguments, a
second turn re-rendering the call as generated) is asked of the embedded model."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
from typing import Annotated, Literal

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.groups import random_model
from tests.support.server import module_server

WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                  "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 40},
                                 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                            "parameters": WEATHER_SCHEMA}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
                 "properties": {"city": {"type": "string", "maxLength": 40},
                                "country": {"type": "string", "maxLength": 40},
                                "population": {"type": "integer", "minimum": 0},
                                "rivers": {"type": "array", "items": {"type": "string", "maxLength": 30},
                                           "maxItems": 3}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris this week?"}]
# The agent framework's tools' argument (module level: the SDK resolves the annotations from the module).
# Bounded: a random model's string ends only where its schema ends it.
City = Annotated[str, Field(max_length=40)]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, embedded_model_dir):
    """The embedded model, for the tests whose model must follow the conversation: colocated (half the
    processes to start); the split layout's grammars (prefill samples the first token) are the tiny server's."""
    return module_server(request, tmp_path_factory, "--colocate", "--prefill-chunk", "64")


@pytest.fixture(scope="module")
def tiny_server(request, tmp_path_factory, embedded_model_dir):
    """The random tiny llama (tests/support/groups.py): for what the grammars alone decide."""
    tiny = random_model(tmp_path_factory, "tiny-llama", embedded_model_dir)
    return module_server(request, tmp_path_factory, "--model", str(tiny), "--prefill-chunk", "64")


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", timeout=180, max_retries=0)


def valid_call(call, schemas: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schemas[call.function.name])
    return arguments


def test_a_named_tool_returns_a_schema_valid_call(client):
    # Sampled (the streamed test below is greedy): any draw is a valid call.
    reply = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], temperature=1.0, seed=7, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    valid_call(call, {"get_weather": WEATHER_SCHEMA})


def test_a_required_call_streams_as_deltas_that_make_a_valid_call(client):
    stream = client.chat.completions.create(
        model="default", messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=120, stream=True)
    name, fragments, content, finish = None, [], "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            name = d.function.name if d.id is not None else name
            fragments.append(d.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not content.strip()
    assert name in ("get_weather", "get_time") and len([f for f in fragments if f]) > 1
    jsonschema.validate(json.loads("".join(fragments)), {"get_weather": WEATHER_SCHEMA,
                                                          "get_time": TIME["function"]["parameters"]}[name])


def test_a_json_schema_answer_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": ANSWER_SCHEMA, "strict": True}}
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    reply = client.chat.completions.create(model="default", messages=messages, response_format=fmt, temperature=0,
                                           max_tokens=200)
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), ANSWER_SCHEMA)


def test_free_requests_decode_the_same_beside_constrained_ones(client):
    """Constrained rows share the batch; a free greedy request's answer is the
    one it gets alone."""
    free = [{"role": "user", "content": f"Name {n} animals that live in the sea."} for n in ("two", "three")]

    def ask_free(m):
        return client.chat.completions.create(model="default", messages=[m], temperature=0,
                                              max_tokens=40).choices[0].message.content

    def ask_forced(i):
        return client.chat.completions.create(
            model="default", messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=i, max_tokens=120).choices[0].message.tool_calls

    alone = [ask_free(m) for m in free]
    with cf.ThreadPoolExecutor(6) as pool:
        forced = [pool.submit(ask_forced, i) for i in range(4)]
        together = [pool.submit(ask_free, m) for m in free]
        assert [f.result() for f in together] == alone
        for f in forced:
            for call in f.result():
                valid_call(call, {"get_weather": WEATHER_SCHEMA})


def test_an_agent_framework_runs_tool_loops_to_final_answers(server, tiny_server):
    """The OpenAI Agents SDK over chat completions, two loops:
    - a forced first call (tool_choice names the tool; the SDK resets it to
      auto after a call), its result, then the model's own final answer
      (the embedded model: it must name Paris and answer);
    - call -> result -> next call -> result, each turn forced to some call
      (`required`), until the agent's tool-use policy takes the results as
      its final output (the random tiny model: the loop's turns, not the
      calls' sense, are under test).
    Every call the SDK gets parses and fits its function's schema (the SDK
    checks them with pydantic), because Tandem decodes forced calls under
    their grammars; the results reach the model under the calls' ids."""
    import agents

    calls: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: City) -> str:
        """Weather forecast for a city."""
        calls.append(("get_weather", city))
        return f"Sunny and 21 C in {city}."

    @agents.function_tool
    def get_time(city: City) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"It is 14:05 in {city}."

    def two_results(context, results) -> agents.ToolsToFinalOutputResult:
        done = len(calls) >= 2  # the agent's policy: two results make the answer
        return agents.ToolsToFinalOutputResult(is_final_output=done,
                                               final_output=" ".join(r.output for r in results) if done else None)

    def model_of(srv):
        client = openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=180, max_retries=0)
        return agents.OpenAIChatCompletionsModel(model="default", openai_client=client)

    model, tiny_model = model_of(server), model_of(tiny_server)
    settings = dict(temperature=0, max_tokens=120, parallel_tool_calls=False)
    question = "What is the weather in Paris, and what time is it there?"
    answer_after_one = agents.Agent(
        name="forecaster", instructions="Call get_weather, then answer the user in one sentence.",
        tools=[get_weather, get_time], model=model,
        model_settings=agents.ModelSettings(tool_choice="get_weather", **settings))
    two_calls = agents.Agent(
        name="planner", instructions="Call get_weather, then call get_time.", tools=[get_weather, get_time],
        model=tiny_model, reset_tool_choice=False, tool_use_behavior=two_results,
        model_settings=agents.ModelSettings(tool_choice="required", **settings))
    agents.set_tracing_disabled(True)

    async def run_both():
        out = []
        for agent in (answer_after_one, two_calls):
            calls.clear()
            out.append((await agents.Runner.run(agent, question, max_turns=6), list(calls)))
        return out

    (result, first_calls), (second, second_calls) = asyncio.run(run_both())
    assert first_calls == [("get_weather", "Paris")]
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output.strip()

    assert len(second_calls) == 2 and all(city for _, city in second_calls)
    kinds = [type(item).__name__ for item in second.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem"] * 2
    assert len(second.raw_responses) == 2  # two model turns, the second after the first's result
    assert "Sunny" in second.final_output or "14:05" in second.final_output


def test_anthropic_sdk_tool_use_is_schema_valid(tiny_server):
    client = anthropic.Anthropic(base_url=tiny_server.base_url, api_key="unused", timeout=180, max_retries=0)
    tools = [{"name": "get_weather", "description": "Weather forecast for a city", "input_schema": WEATHER_SCHEMA}]
    message = client.messages.create(model="default", max_tokens=32000, tools=tools,
                                     tool_choice={"type": "tool", "name": "get_weather",
                                                  "disable_parallel_tool_use": True},
                                     messages=[{"role": "user", "content": "Weather in Paris this week?"}])
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)


def test_responses_sdk_calls_and_previous_response_id_reuses_the_cached_conversation(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
              "parameters": WEATHER_SCHEMA}]
    first = client.responses.create(model="default", input="What is the weather like in Paris?", tools=tools,
                                    tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_output_tokens=120)
    [call] = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    second = client.responses.create(
        model="default", previous_response_id=first.id, tools=tools, temperature=0, max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}])
    assert second.status in ("completed", "incomplete")
    # The second turn's prompt is the first prompt and the call as generated,
    # then the result: everything but the result and the few tokens after the
    # last full prefix-cache block comes from the cache.
    computed = second.usage.input_tokens - second.usage.input_tokens_details.cached_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert computed < 64, second.usage


class Forecast(BaseModel):
    """What the structured-output clients ask for."""

    city: str = Field(min_length=1, max_length=40)
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)


FORECAST_ASK = [{"role": "user", "content": "Give the forecast for Paris for the next 3 days, in celsius."}]


# instructor, LangChain and the Agents SDK are imported where used: each costs every test process
# ~1-3 s at collection otherwise. The modes by name: instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA.
@pytest.mark.parametrize("mode, max_tokens, served", [("TOOLS", None, "tiny_server"), ("TOOLS", 64, "server"),
                                                       ("JSON_SCHEMA", None, "tiny_server")])
def test_instructor_gets_a_schema_valid_object(request, mode, max_tokens, served):
    """instructor forces one named function (TOOLS: tool_choice names it,
    parallel_tool_calls left at its default, on) or sends a json_schema
    response_format; it sends no max_tokens of its own (the model's default
    applies) and fails on finish_reason "length" or more than one call. 64:
    the issue's case, where the grammar let a named function be called twice
    (this case fails with that grammar back), on the embedded model, which
    calls again where a grammar lets it (the random model stops or goes on by
    chance: it passed with that grammar). Sampled at the model's default
    temperature, seeded."""
    import instructor

    srv = request.getfixturevalue(served)
    client = instructor.from_openai(openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=180,
                                                  max_retries=0), mode=instructor.Mode[mode])
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    forecast = client.chat.completions.create(model="default", response_model=Forecast, messages=FORECAST_ASK,
                                              max_retries=0, seed=3, **extra)
    assert isinstance(forecast, Forecast)
    Forecast.model_validate(forecast.model_dump())


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_gets_a_schema_valid_object(tiny_server, method):
    """LangChain's ChatOpenAI at its defaults (no max_tokens, no temperature
    sent): `json_schema` (its default method) and `function_calling` (a named
    tool forced)."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="default", base_url=tiny_server.base_url + "/v1", api_key="unused", timeout=180,
                     max_retries=0, seed=3)
    forecast = llm.with_structured_output(Forecast, method=method).invoke(FORECAST_ASK)
    assert isinstance(forecast, Forecast)
    Forecast.model_validate(forecast.model_dump())
