"""OpenAI chat and completion bodies read into the one `ParsedRequest`
(router/parsed_request.py, with the checks every endpoint shares): the
body's bytes and JSON, the fields each endpoint honours, the messages and
their parts, the chat template and the prompt's tokens.

Status codes, so clients can tell their mistakes apart:
- 400: malformed JSON, a value out of range, an unsupported feature, prompt too long
- 404: unknown model (the message lists the served ones)
- 413: body over settings.max_request_bytes
- 422: a required field missing, or a field of the wrong JSON type
Every error names the offending parameter in `param`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jinja2
from starlette.requests import Request

from environment.generation_defaults import GenerationDefaults
from router.api.chat_output import OutputShape
from router.api.errors import ApiError, invalid, only
from router.api.structured import build_grammar, response_schema
from router.guards.json_nesting import check_nesting
from router.api.tools import ToolFormat, ToolRequest, message_tool_calls, parse_tools, template_tools, with_tools
from router.parsed_request import (MAX_TOP_LOGPROBS, ParsedRequest, allowed_tokens, body_cache_salt, expect_type,
                                   in_range, read_field, require_tokens, sampling_fields, stop_strings, stream_options)

MODEL_ALIAS = "default"  # always accepted as the served model's name
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# --------------------------------------------------------------------------- #
# Body
# --------------------------------------------------------------------------- #


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body's bytes; 413 past max_bytes (declared or actually sent)."""
    too_large = ApiError(
        413, f"Request body is larger than the limit of {max_bytes} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:  # a missing or lying Content-Length
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict:
    """A body's bytes as a JSON object, nested at most MAX_JSON_DEPTH deep
    (up to ~1 s of work for 8 MiB of tiny values: router/guards/admission.py
    runs it off the event loop)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"Request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object", code="invalid_json")
    check_nesting(raw)  # what reads the body recurses: router/guards/json_nesting.py
    if _SURROGATE_ESCAPE.search(raw):
        _refuse_lone_surrogates(body)
    return body


# A JSON escape of a UTF-16 surrogate: a pair is one character once parsed, a
# lone one is a string no tokenizer takes and no response can encode.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(body: dict) -> None:
    stack = [body]
    while stack:
        value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            for text in (key, item):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ApiError(400, "Request body is not valid JSON: a string holds a lone UTF-16 "
                                       "surrogate (\\ud800-\\udfff not in a pair)", code="invalid_json") from None
            if isinstance(item, (dict, list)):
                stack.append(item)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# --------------------------------------------------------------------------- #
# The fields each endpoint honours
# --------------------------------------------------------------------------- #


# The fields each endpoint honours. Anything else is refused by name, never
# dropped: an agent that sends `tools` or `response_format` and gets a plain
# answer back has been answered a different question. A field sent as null
# is taken as not sent (clients echo back whole message objects).
_SAMPLING_FIELDS = ("model", "n", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "logit_bias", "user", "stop", "stream",
                    "stream_options", "max_tokens", "cache_salt")
CHAT_FIELDS = frozenset(_SAMPLING_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                             "tool_choice", "parallel_tool_calls", "response_format"))
COMPLETION_FIELDS = frozenset(_SAMPLING_FIELDS + ("prompt", "logprobs", "echo", "suffix", "best_of"))
MESSAGE_FIELDS = frozenset(("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"))


def check_chat_fields(body: dict) -> tuple[ToolRequest | None, dict | None]:
    """A chat body's fields and its messages' fields, all honoured, and its
    tools and response format well formed; run before anything is done for
    the request (an image URL fetched). Returns (tools, response schema)."""
    only(body, CHAT_FIELDS)
    tools, schema = parse_tools(body), response_schema(body)
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(message, dict):  # other shapes: _messages names them
            only(message, MESSAGE_FIELDS, f"messages[{i}].")
    return tools, schema


def check_model(body: dict, model_id: str) -> None:
    model = read_field(body, "model", "a string", required=True)
    if model not in (model_id, MODEL_ALIAS):
        raise ApiError(
            404,
            f"The model '{model}' does not exist. Served models: {model_id} (alias: {MODEL_ALIAS})",
            param="model",
            code="model_not_found",
        )


# --------------------------------------------------------------------------- #
# /v1/chat/completions
# --------------------------------------------------------------------------- #


def parse_chat(body: dict, tokenizer, model_id: str, max_context: int, vision=None, answers=None,
               defaults: GenerationDefaults = GenerationDefaults()) -> ParsedRequest:
    """`vision`: (router.media.vision_prompt.VisionPrompter, decoded images and
    videos in part order) when the served model takes images; None refuses
    image parts. `answers` (router.api.answer_tokens.AnswerTokens): earlier
    answers repeated in the messages go in as the tokens they were generated as.
    `defaults`: the model's recommended sampling, for the fields left out."""
    tools, schema = check_chat_fields(body)
    sampling = sampling_fields(body, tokenizer, defaults)
    logprobs = read_field(body, "logprobs", "a boolean", False)
    top_logprobs = in_range(read_field(body, "top_logprobs", "an integer", 0), "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs", "requires 'logprobs' to be true")
    stop = stop_strings(body)
    stream, include_usage = stream_options(body)
    cache_salt = body_cache_salt(body)
    messages = _messages(body, media=vision is not None)
    check_model(body, model_id)

    fmt = ToolFormat.of(tokenizer)
    shown = tools if tools is not None and tools.choice != "none" else None
    sampling.grammar = build_grammar(schema, shown, fmt, tokenizer)
    if shown is not None and shown.choice == "auto" and not shown.parallel:
        stop = stop + [fmt.end]  # parallel_tool_calls false, unforced: the answer ends with its first call
    messages, template_kwargs = with_tools(messages, shown, fmt, answers)
    images = []
    try:
        if vision is not None and any(isinstance(m["content"], list) for m in messages):
            tokens, images = vision[0].build(messages, vision[1], **template_kwargs)
        else:
            tokens = answers.splice(tokenizer, messages, **template_kwargs) if answers is not None else None
            if tokens is None:
                tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            **template_kwargs))
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:  # templates raise on e.g. misordered roles
        raise invalid("messages", f"the model's chat template rejected them: {exc}")
    require_tokens(tokens, "messages")
    sampling.max_tokens = allowed_tokens(
        body, ("max_completion_tokens", "max_tokens"), "messages", len(tokens), max_context, defaults.max_tokens
    )
    sampling.logprobs, sampling.top_logprobs = logprobs, top_logprobs
    output = OutputShape.of(tokenizer, tokens, fmt if shown is not None else None,
                            template_tools(shown) if shown is not None else [])
    return ParsedRequest("chat", tokens, sampling, stop, stream, include_usage, images, output, cache_salt)


def _messages(body: dict, media: bool = False) -> list[dict]:
    """Messages as the chat template wants them: role and plain-string content
    (with `media`, a message with image or video parts keeps a list of
    {"type": "text"}, {"type": "image"} and {"type": "video"} parts: see _text_parts)."""
    raw = read_field(body, "messages", "an array", required=True)
    if not raw:
        raise invalid("messages", "must contain at least one message")
    messages = []
    for i, message in enumerate(raw):
        path = f"messages[{i}]."
        expect_type(message, "an object", path[:-1])
        role = read_field(message, "role", "a string", required=True, path=path)
        if role not in CHAT_ROLES:
            raise invalid(path + "role", f"'{role}' is not one of {', '.join(CHAT_ROLES)}")
        # An assistant turn that only called tools has no content.
        content = read_field(message, "content", "a string or an array", "", required=role != "assistant", path=path)
        if isinstance(content, list):
            content = _text_parts(content, path + "content", media)
        normalized = {"role": role, "content": content}
        name = read_field(message, "name", "a string", path=path)
        if name is not None:
            normalized["name"] = name
        _tool_fields(message, role, path, normalized)
        messages.append(normalized)
    return messages


def _tool_fields(message: dict, role: str, path: str, normalized: dict) -> None:
    """An assistant's calls, a tool result's call id, an assistant's
    reasoning (templates of reasoning models render it), each only where
    it belongs."""
    for key, owner in (("tool_calls", "assistant"), ("tool_call_id", "tool"), ("reasoning_content", "assistant")):
        if message.get(key) is not None and role != owner:
            raise invalid(path + key, f"only '{owner}' messages carry it")
    if message.get("tool_calls") is not None:
        normalized["tool_calls"] = message_tool_calls(message, path)
    if role == "tool":
        normalized["tool_call_id"] = read_field(message, "tool_call_id", "a string", required=True, path=path)
    reasoning = read_field(message, "reasoning_content", "a string", path=path)
    if reasoning is not None:
        normalized["reasoning_content"] = reasoning


def _text_parts(parts: list, param: str, media=False):
    """Text parts joined by newlines. With `media` (the model takes images),
    a list of text, {"type": "image"} and {"type": "video"} parts when any
    part is an image or video. A video is one {"type": "video"} where the
    model takes video (the part's `_video`), else one image per frame (their
    count in its `_frames`): the router sets both once it has decoded it."""
    texts, out = [], []
    for j, part in enumerate(parts):
        path = f"{param}[{j}]."
        expect_type(part, "an object", path[:-1])
        kind = read_field(part, "type", "a string", required=True, path=path)
        if kind in ("image_url", "video_url") and not media:
            raise ApiError(400, f"Unsupported content part type '{kind}' in '{path[:-1]}': "
                           "this model does not take images or video",
                           param=path + "type", code="unsupported_value")
        if kind in ("image_url", "video_url"):
            out += [{"type": "video"}] if part.get("_video") else [{"type": "image"}] * part.get("_frames", 1)
            continue
        if kind != "text":
            raise ApiError(
                400,
                f"Unsupported content part type '{kind}' in '{path[:-1]}': only 'text' parts are supported",
                param=path + "type",
                code="unsupported_value",
            )
        text = read_field(part, "text", "a string", required=True, path=path)
        texts.append(text)
        out.append({"type": "text", "text": text})
    if len(out) > len(texts):
        return out
    return "\n".join(texts)


# --------------------------------------------------------------------------- #
# /v1/completions
# --------------------------------------------------------------------------- #


def parse_completion(body: dict, tokenizer, model_id: str, max_context: int,
                     defaults: GenerationDefaults = GenerationDefaults()) -> ParsedRequest:
    only(body, COMPLETION_FIELDS)
    sampling = sampling_fields(body, tokenizer, defaults)
    logprobs = in_range(read_field(body, "logprobs", "an integer"), "logprobs", 0, MAX_TOP_LOGPROBS)
    if read_field(body, "echo", "a boolean", False):
        raise ApiError(400, "echo is not supported", param="echo", code="unsupported_value")
    if read_field(body, "suffix", "a string"):
        raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported_value")
    if read_field(body, "best_of", "an integer", 1) > 1:
        raise ApiError(400, "best_of > 1 is not supported", param="best_of", code="unsupported_value")
    stop = stop_strings(body)
    stream, include_usage = stream_options(body)
    cache_salt = body_cache_salt(body)
    prompt = read_field(body, "prompt", "a string or an array", required=True)
    check_model(body, model_id)

    tokens = require_tokens(_prompt_tokens(prompt, tokenizer), "prompt")
    sampling.max_tokens = allowed_tokens(body, ("max_tokens",), "prompt", len(tokens), max_context, defaults.max_tokens)
    # Legacy logprobs: an int, the number of alternatives; 0 still returns the chosen token's.
    sampling.logprobs, sampling.top_logprobs = logprobs is not None, logprobs or 0
    return ParsedRequest("completion", tokens, sampling, stop, stream, include_usage, cache_salt=cache_salt)


def _prompt_tokens(prompt: str | list, tokenizer) -> list[int]:
    """A string, [string], a token id list, or [token id list]; batches are refused."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))  # adds BOS when the tokenizer does
    if prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request",
                       param="prompt", code="unsupported_value")
    vocab_size = len(tokenizer)
    for i, token in enumerate(prompt):
        expect_type(token, "an integer", f"prompt[{i}]")
        if not 0 <= token < vocab_size:
            raise invalid(f"prompt[{i}]", f"{token} is not a token id of this model (0 to {vocab_size - 1})")
    return list(prompt)
