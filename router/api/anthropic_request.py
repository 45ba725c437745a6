"""Anthropic Messages request bodies (/v1/messages, /v1/messages/count_tokens)
translated into the equivalent OpenAI chat body, so that one path
(router/api/openai_request.py `parse_chat`) builds every chat prompt: the same template,
tool rendering, forced-call grammar, prefix-cache reuse and answer tokens.

- `system` (a string or text blocks) -> a system message.
- A user turn's `text` and `image` blocks -> a user message of text and
  image_url parts; its `tool_result` blocks -> `tool` messages (in order).
- An assistant turn's `text` -> content, `tool_use` -> `tool_calls` (ids
  kept: the next turn's prompt reuses the call as the model wrote it),
  `thinking` -> `reasoning_content`.
- `tools` (input_schema) -> functions (parameters); `tool_choice`
  auto / any / tool / none -> auto / required / the named function / none,
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`.
- `stop_sequences` -> `stop`; `max_tokens`, `temperature`, `top_p`,
  `top_k`, `stream` as they are.

`cache_control` is accepted wherever Anthropic allows it: Tandem's prefix
cache keeps every prompt's KV without being asked. Any other field is a 400
naming it, never dropped.
"""

from __future__ import annotations

import json
from typing import Any

from router.api.errors import ApiError, invalid, only
from router.parsed_request import MAX_STOP_STRINGS
from router.api.tools import check_function

MESSAGES_FIELDS = frozenset(("model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                             "temperature", "top_p", "top_k", "stream", "metadata"))
COUNT_TOKENS_FIELDS = frozenset(("model", "messages", "system", "tools", "tool_choice"))
MESSAGE_FIELDS = frozenset(("role", "content"))
# Each content block type with the fields Tandem honours on it.
BLOCK_FIELDS = {
    "text": frozenset(("type", "text", "cache_control", "citations")),
    "image": frozenset(("type", "source", "cache_control")),
    "tool_use": frozenset(("type", "id", "name", "input", "cache_control")),
    "tool_result": frozenset(("type", "tool_use_id", "content", "is_error", "cache_control")),
    "thinking": frozenset(("type", "thinking", "signature")),
}
BLOCKS_OF_ROLE = {"user": ("text", "image", "tool_result"), "assistant": ("text", "tool_use", "thinking")}
TOOL_CHOICE_TYPES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": the named function
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
TOOL_ERROR_NOTE = "Error: "  # before a tool_result's content when it says is_error


def chat_body(body: dict, count_only: bool = False) -> dict:
    """The OpenAI chat body equivalent to Anthropic Messages `body`;
    `count_only`: a count_tokens body (no max_tokens, no sampling)."""
    honoured = COUNT_TOKENS_FIELDS if count_only else MESSAGES_FIELDS
    only(body, honoured)
    out: dict[str, Any] = {"model": body.get("model"), "messages": _system(body.get("system")) + _messages(body)}
    if not count_only:
        if body.get("max_tokens") is None:
            raise ApiError(400, "Missing required parameter: 'max_tokens'", param="max_tokens",
                           code="missing_required_parameter")
        temperature = body.get("temperature")
        if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not 0 <= temperature <= 1:
            raise invalid("temperature", f"expected a value in [0, 1], but got {temperature}")
        for name in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
            if body.get(name) is not None:
                out[name] = body[name]
        out["stop"] = _stop_sequences(body.get("stop_sequences"))
        _metadata(body.get("metadata"))
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"], out["parallel_tool_calls"] = _tool_choice(body["tool_choice"])
    return out


# --------------------------------------------------------------------------- #
# Checks
# --------------------------------------------------------------------------- #


def _expect(value: Any, kind: type | tuple, what: str, param: str) -> Any:
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise invalid(param, f"expected {what}")
    return value


def _cache_control(block: dict, path: str) -> None:
    """Accepted and always honoured: the prefix cache keeps every prompt."""
    control = block.get("cache_control")
    if control is not None:
        _expect(control, dict, "an object", path + "cache_control")
        only(control, frozenset(("type", "ttl")), path + "cache_control.")
        if control.get("type") != "ephemeral":
            raise invalid(path + "cache_control.type", "expected 'ephemeral'")


def _stop_sequences(stops: Any) -> list[str]:
    if stops is None:
        return []
    _expect(stops, list, "an array of strings", "stop_sequences")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop_sequences", f"at most {MAX_STOP_STRINGS} stop sequences, but got {len(stops)}")
    for i, stop in enumerate(stops):
        if not _expect(stop, str, "a string", f"stop_sequences[{i}]"):
            raise invalid(f"stop_sequences[{i}]", "stop sequences must not be empty")
    return list(stops)


def _metadata(metadata: Any) -> None:
    """Accepted: `user_id`, which, as OpenAI's `user`, changes nothing."""
    if metadata is not None:
        only(_expect(metadata, dict, "an object", "metadata"), frozenset(("user_id",)), "metadata.")
        if metadata.get("user_id") is not None:
            _expect(metadata["user_id"], str, "a string", "metadata.user_id")


# --------------------------------------------------------------------------- #
# System and messages
# --------------------------------------------------------------------------- #


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    _expect(system, list, "a string or an array of text blocks", "system")
    texts = [_text(block, f"system[{i}]", ("text",)) for i, block in enumerate(system)]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _messages(body: dict) -> list[dict]:
    raw = body.get("messages")
    if raw is None:
        raise ApiError(400, "Missing required parameter: 'messages'", param="messages",
                       code="missing_required_parameter")
    if not _expect(raw, list, "an array", "messages"):
        raise invalid("messages", "must contain at least one message")
    out = []
    for i, message in enumerate(raw):
        path = f"messages[{i}]"
        only(_expect(message, dict, "an object", path), MESSAGE_FIELDS, path + ".")
        role = message.get("role")
        if role not in BLOCKS_OF_ROLE:
            raise invalid(path + ".role", f"expected 'user' or 'assistant', but got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        blocks = _expect(content, list, "a string or an array of content blocks", path + ".content")
        out += _user_turn(blocks, path) if role == "user" else [_assistant_turn(blocks, path)]
    if raw[-1].get("role") == "assistant":
        # Anthropic continues a final assistant turn ("prefill"); the chat
        # template here opens a new one, which would answer something else.
        raise invalid(f"messages[{len(raw) - 1}].role", "a final assistant message (prefill) is not supported: "
                   "end with a user message")
    return out


def _block_type(block: Any, path: str, allowed: tuple[str, ...]) -> str:
    _expect(block, dict, "a content block object", path)
    kind = block.get("type")
    if kind not in allowed:
        raise ApiError(400, f"Unsupported content block type {kind!r} in '{path}': here Tandem takes "
                       f"{', '.join(allowed)}", param=path + ".type", code="unsupported_value")
    only(block, BLOCK_FIELDS[kind], path + ".")
    _cache_control(block, path + ".")
    return kind


def _text(block: Any, path: str, allowed: tuple[str, ...]) -> str:
    _block_type(block, path, allowed)
    if block.get("citations"):
        raise invalid(path + ".citations", "citations are not supported")
    return _expect(block.get("text"), str, "a string", path + ".text")


def _user_turn(blocks: list, path: str) -> list[dict]:
    """A user turn's messages: tool results as `tool` messages, the text
    and images between them as user messages, in their order."""
    out, parts = [], []
    for j, block in enumerate(blocks):
        at = f"{path}.content[{j}]"
        kind = _block_type(block, at, BLOCKS_OF_ROLE["user"])
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(block, at))
        elif kind == "image":
            parts.append(_image(block, at))
        else:
            parts.append({"type": "text", "text": _text(block, at, ("text",))})
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _image(block: dict, path: str) -> dict:
    """An image block as an OpenAI image_url part (the vision path reads it)."""
    source = _expect(block.get("source"), dict, "an object", path + ".source")
    kind = source.get("type")
    if kind == "base64":
        only(source, frozenset(("type", "media_type", "data")), path + ".source.")
        media_type = source.get("media_type")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise invalid(path + ".source.media_type", f"expected one of {', '.join(IMAGE_MEDIA_TYPES)}")
        data = _expect(source.get("data"), str, "a base64 string", path + ".source.data")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        only(source, frozenset(("type", "url")), path + ".source.")
        url = _expect(source.get("url"), str, "a string", path + ".source.url")
        return {"type": "image_url", "image_url": {"url": url}}
    raise invalid(path + ".source.type", f"expected 'base64' or 'url', but got {kind!r}")


def _tool_result(block: dict, path: str) -> dict:
    call_id = _expect(block.get("tool_use_id"), str, "a string", path + ".tool_use_id")
    content = block.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_text(b, f"{path}.content[{k}]", ("text",)) for k, b in enumerate(content))
    else:
        _expect(content, str, "a string or an array of text blocks", path + ".content")
    if block.get("is_error") is not None and _expect(block["is_error"], bool, "a boolean", path + ".is_error"):
        content = TOOL_ERROR_NOTE + content
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant_turn(blocks: list, path: str) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{path}.content[{j}]"
        kind = _block_type(block, at, BLOCKS_OF_ROLE["assistant"])
        if kind == "text":
            texts.append(_text(block, at, ("text",)))
        elif kind == "thinking":
            thinking.append(_expect(block.get("thinking"), str, "a string", at + ".thinking"))
        else:
            arguments = _expect(block.get("input", {}), dict, "an object", at + ".input")
            calls.append({"id": _expect(block.get("id"), str, "a string", at + ".id"), "type": "function",
                          "function": {"name": _expect(block.get("name"), str, "a string", at + ".name"),
                                       "arguments": json.dumps(arguments, ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


# --------------------------------------------------------------------------- #
# Tools
# --------------------------------------------------------------------------- #


def _tools(tools: Any) -> list[dict]:
    _expect(tools, list, "an array", "tools")
    out = []
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        _expect(tool, dict, "an object", path)
        if tool.get("type") not in (None, "custom"):
            raise ApiError(400, f"Unsupported tool type {tool['type']!r} in '{path}': Tandem runs no server tools; "
                           "define the tool with name, description and input_schema", param=path + ".type",
                           code="unsupported_value")
        _cache_control(tool, path + ".")
        if tool.get("input_schema") is None:
            raise ApiError(400, f"Missing required parameter: '{path}.input_schema'", param=path + ".input_schema",
                           code="missing_required_parameter")
        definition = {k: v for k, v in tool.items() if k not in ("type", "cache_control")}
        out.append({"type": "function", "function": check_function(definition, path, "input_schema")})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """OpenAI's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    _expect(choice, dict, "an object with 'type'", "tool_choice")
    only(choice, frozenset(("type", "name", "disable_parallel_tool_use")), "tool_choice.")
    kind = choice.get("type")
    if kind == "tool":
        name = _expect(choice.get("name"), str, "a string", "tool_choice.name")
        openai_choice: Any = {"type": "function", "function": {"name": name}}
    elif kind in TOOL_CHOICE_TYPES:
        if choice.get("name") is not None:
            raise invalid("tool_choice.name", "only tool_choice of type 'tool' names a tool")
        openai_choice = TOOL_CHOICE_TYPES[kind]
    else:
        raise invalid("tool_choice.type", f"expected 'auto', 'any', 'tool' or 'none', but got {kind!r}")
    disable = choice.get("disable_parallel_tool_use")
    if disable is None:
        return openai_choice, None
    return openai_choice, not _expect(disable, bool, "a boolean", "tool_choice.disable_parallel_tool_use")
