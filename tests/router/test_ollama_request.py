"""Ollama's /api/chat and /api/generate bodies read into the OpenAI bodies
the router parses (router/ollama/request.py, options.py, names.py): pure
functions, no server."""

from __future__ import annotations

import logging

import pytest

from router.api.errors import ApiError
from router.models.keep_alive import FOREVER
from router.ollama.names import listed_name, same_model, tandem_name
from router.ollama.options import sampling_of
from router.ollama.request import ModelFacts, read_call, renamed, translate

TEXT = ModelFacts("m", vision=False, thinking=False, template=True)


def chat(body: dict, facts: ModelFacts = TEXT):
    return translate(read_call({"model": "m", **body}, "chat"), "chat", facts)


def generate(body: dict, facts: ModelFacts = TEXT):
    return translate(read_call({"model": "m", **body}, "generate"), "generate", facts)


def refused(fn, body: dict, facts: ModelFacts = TEXT) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body, facts)
    assert info.value.status == 400
    return info.value


def test_names_latest_is_the_repo_itself_and_every_listed_name_comes_back():
    assert tandem_name("Qwen/Qwen3-0.6B:latest") == "Qwen/Qwen3-0.6B"
    assert tandem_name(" x ") == "x" and tandem_name("x:latest") == "x"
    assert tandem_name("o/r-GGUF:Q4_0") == "o/r-GGUF:Q4_0"  # a GGUF file's tag is Tandem's own :FILE
    for model in ("o/r", "SmolLM2-135M-Instruct", "o/r@v1", "o/r-GGUF:Q4_0"):
        assert tandem_name(listed_name(model)) == model
    assert listed_name("o/r") == "o/r:latest" and listed_name("o/r-GGUF:Q8_0") == "o/r-GGUF:Q8_0"
    assert same_model("o/r", "o/r:latest") and not same_model("o/r", "o/s")


def test_chat_defaults_to_a_stream_and_maps_options_format_and_keep_alive():
    call = chat({"messages": [{"role": "user", "content": "hi"}], "keep_alive": "10m", "format": "json",
                 "options": {"temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 7, "num_predict": 9,
                             "stop": ["x"], "repeat_penalty": 1.2, "presence_penalty": 0.5,
                             "frequency_penalty": 0.25}})
    assert call.stream is True and call.keep_alive == 600 and call.kind == "chat" and call.model == "m"
    assert call.body == {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}],
                         "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 7, "max_tokens": 9,
                         "stop": ["x"], "repetition_penalty": 1.2, "presence_penalty": 0.5,
                         "frequency_penalty": 0.25, "response_format": {"type": "json_object"}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    call = chat({"messages": [{"role": "user", "content": "hi"}], "format": schema, "stream": False,
                 "keep_alive": -1, "options": {"num_predict": -1}})
    assert call.body["response_format"] == {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}
    assert call.stream is False and call.keep_alive == FOREVER and "max_tokens" not in call.body
    assert call.to_the_context and not chat({"messages": [{"role": "user", "content": "x"}]}).to_the_context


def test_hardware_options_are_accepted_and_logged_and_unknown_ones_refused(caplog):
    with caplog.at_level(logging.INFO, "tandem.router"):
        assert sampling_of({"num_ctx": 8192, "num_gpu": 99, "num_thread": 4, "use_mmap": True, "mirostat": 0,
                            "temperature": 0.3}) == {"temperature": 0.3}
    assert "mirostat, num_ctx, num_gpu, num_thread, use_mmap accepted, not applying" in caplog.text
    error = refused(chat, {"messages": [{"role": "user", "content": "hi"}], "options": {"tfs_z": 0.5}})
    assert "options.tfs_z" == error.param and "no such sampler" in error.message
    error = refused(chat, {"messages": [{"role": "user", "content": "hi"}], "options": {"temperatur": 0.5}})
    assert error.param == "options.temperatur" and "will not ignore it silently" in error.message
    # the penalties' window: 20 tokens, or any while no penalty runs
    assert sampling_of({"repeat_last_n": 64}) == {} and sampling_of({"repeat_last_n": 20, "repeat_penalty": 1.1})
    assert "last 20 tokens" in refused(chat, {"messages": [{"role": "user", "content": "hi"}],
                                              "options": {"repeat_last_n": 64, "repeat_penalty": 1.1}}).message
    assert refused(chat, {"messages": [{"role": "user", "content": "x"}], "options": {"num_predict": 0}}).param == \
        "options.num_predict"


def test_unknown_fields_are_refused_by_name_and_empty_ones_taken_as_unsent():
    assert refused(chat, {"messages": [{"role": "user", "content": "hi"}], "n": 2}).param == "n"
    assert refused(chat, {"messages": [{"role": "user", "content": "hi", "name": "bob"}]}).param == "messages[0].name"
    call = chat({"messages": [{"role": "user", "content": "hi"}], "tools": [], "format": "", "stream": None})
    assert call.body == {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    assert refused(chat, {"messages": [{"role": "user", "content": "hi"}], "keep_alive": "soon"}).param == "keep_alive"
    assert refused(chat, {"messages": [{"role": "user", "content": "hi"}], "format": "yaml"}).param == "format"


def test_tools_and_calls_and_tool_results_in_openai_shape():
    tool = {"type": "function", "function": {"name": "weather", "description": "d",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    call = chat({"tools": [tool], "messages": [
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "weather"},
        {"role": "tool", "content": "rain", "tool_name": "weather"}]})
    assistant, first, second = call.body["messages"][1:]
    assert call.body["tools"] == [tool]
    assert [c["function"] for c in assistant["tool_calls"]] == [{"name": "weather", "arguments": {"city": "Paris"}},
                                                                {"name": "weather", "arguments": {"city": "Rome"}}]
    assert [first["tool_call_id"], second["tool_call_id"]] == [c["id"] for c in assistant["tool_calls"]]
    ids = [c["id"] for c in chat({"tools": [tool], "messages": call.raw["messages"]}).body["messages"][1]["tool_calls"]]
    assert ids == [c["id"] for c in assistant["tool_calls"]]  # the same conversation: the same prompt
    assert chat({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]}).body["messages"][0][
        "tool_call_id"] == "c1"


def test_images_become_image_parts_for_a_vlm_and_are_refused_otherwise():
    msg = {"role": "user", "content": "what is this?", "images": ["aGVsbG8="]}
    call = chat({"messages": [msg]}, ModelFacts("v", vision=True))
    assert call.body["messages"][0]["content"] == [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:;base64,aGVsbG8="}}]
    error = refused(chat, {"messages": [msg]})
    assert error.param == "messages[0].images" and "does not support images" in error.message
    assert refused(generate, {"prompt": "x", "images": ["aGVsbG8="]}).param == "images"


def test_think_maps_to_the_template_and_is_refused_for_a_model_that_does_not_think():
    thinker = ModelFacts("t", thinking=True)
    msgs = {"messages": [{"role": "assistant", "content": "ok", "thinking": "hm"}, {"role": "user", "content": "?"}]}
    call = chat({**msgs, "think": True}, thinker)
    assert call.template_kwargs == {"enable_thinking": True}
    assert call.body["messages"][0]["reasoning_content"] == "hm"
    assert chat({**msgs, "think": "high"}, thinker).template_kwargs == {"enable_thinking": True,
                                                                        "reasoning_effort": "high"}
    assert chat({**msgs, "think": False}).template_kwargs == {"enable_thinking": False}
    assert refused(chat, {**msgs, "think": True}).message == '"m" does not support thinking'
    assert refused(chat, {**msgs, "think": "max"}, thinker).param == "think"


def test_generate_as_a_chat_turn_or_a_raw_completion_and_what_it_refuses():
    call = generate({"prompt": "Why?", "system": "Be brief.", "options": {"num_predict": 5}})
    assert call.kind == "chat" and call.body["messages"] == [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Why?"}]
    call = generate({"prompt": "1, 2, 3,", "raw": True, "logprobs": True, "top_logprobs": 2})
    assert call.kind == "completion" and call.body == {"model": "m", "stream": True, "prompt": "1, 2, 3,",
                                                       "logprobs": 2}
    no_template = ModelFacts("base", template=False)
    assert generate({"prompt": "Once"}, no_template).body["prompt"] == "Once"
    assert "no chat template" in refused(generate, {"prompt": "x", "system": "s"}, no_template).message
    for field, value in (("suffix", "end"), ("template", "{{ .Prompt }}"), ("context", [1, 2]), ("width", 512)):
        assert refused(generate, {"prompt": "x", field: value}).param == field
    assert refused(generate, {"prompt": "x", "raw": True, "think": True}).param == "think"


def test_no_messages_or_prompt_only_loads_or_unloads():
    for call in (chat({}), chat({"messages": []}), generate({}), generate({"prompt": ""})):
        assert call.load_only and call.body is None
    assert generate({"keep_alive": 0}).keep_alive == 0
    assert refused(lambda b, f: read_call(b, "chat"), {"messages": []}).param == "model"
    # options and format are checked before the model is taken from the pool: a bad one costs no load
    for bad, param in (({"options": {"bogus": 1}}, "options.bogus"), ({"format": "yaml"}, "format")):
        assert refused(lambda b, f: read_call({"model": "m", **b}, "generate"), bad).param == param


def test_a_chat_parsers_error_names_ollamas_fields():
    e = renamed(ApiError(400, "Invalid 'max_tokens': expected a value >= 1", param="max_tokens"), "chat")
    assert (e.message, e.param) == ("Invalid 'options.num_predict': expected a value >= 1", "options.num_predict")
    e = renamed(ApiError(400, "Invalid 'response_format.json_schema.schema': no", param="response_format"), "chat")
    assert (e.message, e.param) == ("Invalid 'format': no", "format")
    e = renamed(ApiError(400, "Invalid 'messages': rejected", param="messages"), "generate")
    assert (e.message, e.param) == ("Invalid 'prompt': rejected", "prompt")
