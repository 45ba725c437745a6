"""A request of OpenAI's Responses API (`POST /v1/responses`) as the chat
request it amounts to, continuing a stored response when it names one
(`previous_response_id`; the store: router/api/response_store.py).

The translation gives a chat-completions body that router/api/openai_request.py
`parse_chat` reads like any other: the same prompt rendering, tools,
grammars, prefix cache and answer tokens (router/api/answer_tokens.py). A stored
response keeps its whole conversation as chat messages, the answer's
assistant message (calls included) last, so the next turn's messages are
that conversation and the new input: its prompt begins with the earlier
prompt and the earlier answer's generated tokens, whose KV the prefix cache
holds. `instructions` are not carried over (OpenAI does not either).

Every field is honoured or refused by name (400), never dropped.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from router.api.errors import ApiError, invalid, only
from router.api.response_store import ResponseStore
from router.guards.json_nesting import check_nesting

RESPONSE_FIELDS = frozenset((
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "max_output_tokens",
    "temperature", "top_p", "stream", "store", "previous_response_id", "metadata", "user",
    "truncation", "include", "background", "cache_salt"))
# Fields whose only value accepted is what Tandem does anyway.
ONLY_VALUES = {"truncation": ("disabled",), "include": ([],), "background": (False,)}
# Chat fields a Responses field maps to under another name.
CHAT_NAMES = {"max_output_tokens": "max_completion_tokens", "temperature": "temperature", "top_p": "top_p",
              "user": "user", "parallel_tool_calls": "parallel_tool_calls", "stream": "stream",
              "cache_salt": "cache_salt"}
INPUT_ROLES = ("user", "system", "developer", "assistant")
ITEM_FIELDS = {
    "message": frozenset(("type", "role", "content", "id", "status", "phase")),
    "function_call": frozenset(("type", "id", "call_id", "name", "arguments", "status")),
    "function_call_output": frozenset(("type", "id", "call_id", "output", "status")),
    "reasoning": frozenset(("type", "id", "summary", "content", "status")),
}
PART_FIELDS = {
    "input_text": frozenset(("type", "text")),
    "output_text": frozenset(("type", "text", "annotations", "logprobs")),
    "input_image": frozenset(("type", "image_url", "detail")),
}
TOOL_FIELDS = frozenset(("type", "name", "description", "parameters", "strict"))
TEXT_FIELDS = frozenset(("format",))
FORMAT_FIELDS = frozenset(("type", "name", "schema", "strict", "description"))
# OpenAI's bounds on `metadata` (it is echoed and stored with the response).
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def _wrong_type(param: str, expected: str) -> ApiError:
    return invalid(param, f"expected {expected}", 422, "invalid_type")


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_value")


def _string(obj: dict, name: str, path: str = "", required: bool = False) -> str | None:
    value = obj.get(name)
    if value is None and required:
        raise ApiError(422, f"Missing required parameter: '{path}{name}'", param=path + name,
                       code="missing_required_parameter")
    if value is not None and not isinstance(value, str):
        raise _wrong_type(path + name, "a string")
    return value


@dataclass
class ResponsesTurn:
    """One Responses request: the chat body it amounts to, the conversation
    the response will continue (the answer is added when it ends), the
    request's settings as the response object repeats them, and where each
    chat message came from (errors name the Responses field)."""

    chat: dict
    conversation: list[dict]
    echo: dict
    store: bool
    paths: list[str] = field(default_factory=list)

    def rename(self, error: ApiError) -> ApiError:
        """A chat parser's error, naming the Responses field instead."""
        error.message = self._renamed(error.message)
        if error.param is not None:
            error.param = self._renamed(error.param)
        return error

    def _renamed(self, text: str) -> str:
        def message_path(match: re.Match) -> str:
            i = int(match.group(1))
            return self.paths[i] if i < len(self.paths) else match.group(0)

        text = re.sub(r"messages\[(\d+)\]", message_path, text)
        text = re.sub(r"\bmessages\b", "input", text)
        text = re.sub(r"tools\[(\d+)\]\.function\.", r"tools[\1].", text)
        text = text.replace("tool_choice.function.name", "tool_choice.name")
        text = text.replace("response_format.json_schema.", "text.format.").replace("response_format", "text.format")
        return text.replace("max_completion_tokens", "max_output_tokens")


def responses_turn(body: dict, store: ResponseStore, images: bool) -> ResponsesTurn:
    """`body` checked and read as a chat request; `images`: the served model
    takes them (else an image part is a 400 naming it)."""
    only(body, RESPONSE_FIELDS)
    for name, accepted in ONLY_VALUES.items():
        if body.get(name) is not None and body[name] not in accepted:
            raise _unsupported(name, f"Unsupported value for '{name}': Tandem supports only "
                               f"{' or '.join(json.dumps(v) for v in accepted)}")
    keep = body.get("store", True)
    if not isinstance(keep, bool):
        raise _wrong_type("store", "a boolean")
    previous_id = _string(body, "previous_response_id")
    conversation, paths = [], []
    if previous_id is not None:
        conversation = list(store.get(previous_id, "previous_response_id").conversation)
        paths = ["previous_response_id"] * len(conversation)
    reader = _InputReader(images)
    reader.read(body.get("input"))
    conversation += reader.messages
    paths += reader.paths
    instructions = _string(body, "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []

    chat = {"model": body.get("model"), "messages": copy.deepcopy(system + conversation)}
    chat.update({theirs: body[ours] for ours, theirs in CHAT_NAMES.items() if body.get(ours) is not None})
    tools, echo_tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    text = _text(body)
    if text is not None:
        chat["response_format"] = text
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": _metadata(body),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": previous_id,
        "store": keep,
        "temperature": body.get("temperature", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": echo_tools,
        "top_p": body.get("top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesTurn(chat, conversation, echo, keep, ["instructions"] * len(system) + paths)


class _InputReader:
    """`input` items as chat messages: a function call joins the assistant
    message just before it (one answer: text, then calls), a reasoning item
    becomes the reasoning of the assistant message after it."""

    def __init__(self, images: bool):
        self.images = images
        self.messages: list[dict] = []
        self.paths: list[str] = []
        self._answer: dict | None = None  # the assistant message a function_call item may join
        self._reasoning: str | None = None

    def read(self, items: Any) -> None:
        if items is None:
            return
        if isinstance(items, str):
            self._add({"role": "user", "content": items}, "input")
            return
        if not isinstance(items, list):
            raise _wrong_type("input", "a string or an array of input items")
        for i, item in enumerate(items):
            path = f"input[{i}]"
            if not isinstance(item, dict):
                raise _wrong_type(path, "an object")
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in ITEM_FIELDS:
                raise _unsupported(path + ".type", f"Unsupported input item type {kind!r} in '{path}': Tandem takes "
                                   f"{', '.join(ITEM_FIELDS)} items (previous_response_id instead of item_reference)")
            only(item, ITEM_FIELDS[kind], path + ".")
            getattr(self, "_read_" + kind)(item, path)
        if self._reasoning is not None:
            raise invalid("input", "a reasoning item must come before the assistant message or function call it led to")

    def _add(self, message: dict, path: str) -> dict:
        if message["role"] == "assistant" and self._reasoning is not None:
            message["reasoning_content"], self._reasoning = self._reasoning, None
        self.messages.append(message)
        self.paths.append(path)
        self._answer = message if message["role"] == "assistant" else None
        return message

    def _read_message(self, item: dict, path: str) -> None:
        role = _string(item, "role", path + ".", required=True)
        if role not in INPUT_ROLES:
            raise invalid(path + ".role", f"'{role}' is not one of {', '.join(INPUT_ROLES)}")
        content = item.get("content")
        if isinstance(content, list):
            content = self._parts(content, path + ".content")
        elif not isinstance(content, str):
            raise _wrong_type(path + ".content", "a string or an array of content parts")
        self._add({"role": role, "content": content}, path)

    def _parts(self, parts: list, path: str) -> str | list:
        """Text parts joined by newlines (as a chat's are); with an image, chat parts."""
        out = []
        for j, part in enumerate(parts):
            at = f"{path}[{j}]"
            if not isinstance(part, dict):
                raise _wrong_type(at, "an object")
            kind = part.get("type")
            if kind not in PART_FIELDS:
                raise _unsupported(at + ".type", f"Unsupported content part type {kind!r} in '{at}': Tandem takes "
                                   f"{', '.join(PART_FIELDS)} parts")
            only(part, PART_FIELDS[kind], at + ".")
            if kind != "input_image":
                out.append({"type": "text", "text": _string(part, "text", at + ".", required=True)})
                continue
            if not self.images:
                raise _unsupported(at + ".type", f"Unsupported content part type 'input_image' in '{at}': "
                                   "this model does not take images")
            url = _string(part, "image_url", at + ".", required=True)
            out.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}})
        if all(p["type"] == "text" for p in out):
            return "\n".join(p["text"] for p in out)
        return out

    def _read_function_call(self, item: dict, path: str) -> None:
        call_id = _string(item, "call_id", path + ".", required=True)
        name = _string(item, "name", path + ".", required=True)
        arguments = _string(item, "arguments", path + ".", required=True)
        check_nesting(arguments, path + ".arguments")
        try:
            json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise invalid(path + ".arguments", f"not valid JSON: {exc}")
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        answer = self._answer if self._reasoning is None else None
        if answer is None:
            answer = self._add({"role": "assistant", "content": ""}, path)
        answer.setdefault("tool_calls", []).append(call)

    def _read_function_call_output(self, item: dict, path: str) -> None:
        call_id = _string(item, "call_id", path + ".", required=True)
        output = item.get("output")
        if isinstance(output, list):
            output = self._parts(output, path + ".output")
            if not isinstance(output, str):
                raise _unsupported(path + ".output", f"Unsupported content in '{path}.output': "
                                   "a function call's output is text here")
        elif not isinstance(output, str):
            raise _wrong_type(path + ".output", "a string or an array of input_text parts")
        self._add({"role": "tool", "tool_call_id": call_id, "content": output}, path)

    def _read_reasoning(self, item: dict, path: str) -> None:
        texts = []
        for key in ("content", "summary"):  # the reasoning text; a summary where the text is not given
            parts = item.get(key) or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _wrong_type(f"{path}.{key}", "an array of {\"type\", \"text\"} parts")
            texts = texts or [p["text"] for p in parts]
        self._answer = None
        self._reasoning = "\n".join(texts)


def _tools(body: dict) -> tuple[list | None, list]:
    """The tools in the chat's shape, and as the response repeats them."""
    tools = body.get("tools")
    if tools is None:
        return None, []
    if not isinstance(tools, list):
        raise _wrong_type("tools", "an array")
    chat, echo = [], []
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _wrong_type(path, "an object")
        if tool.get("type") != "function":
            raise _unsupported(path + ".type", f"Unsupported tool type {tool.get('type')!r} in '{path}': "
                               "Tandem serves 'function' tools only")
        only(tool, TOOL_FIELDS, path + ".")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        chat.append({"type": "function", "function": function})
        echo.append({"type": "function", "description": None, "parameters": None, "strict": None, **function})
    return chat, echo


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # none, auto, required: checked as a chat's
    if not isinstance(choice, dict):
        raise _wrong_type("tool_choice", "'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")
    if choice.get("type") != "function":
        raise _unsupported("tool_choice.type", f"Unsupported tool_choice type {choice.get('type')!r}: Tandem "
                           "takes 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")
    only(choice, frozenset(("type", "name")), "tool_choice.")
    return {"type": "function", "function": {"name": _string(choice, "name", "tool_choice.", required=True)}}


def _text(body: dict) -> dict | None:
    """`text.format` as a chat's response_format."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _wrong_type("text", "an object")
    only(text, TEXT_FIELDS, "text.")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _wrong_type("text.format", "an object")
    only(fmt, FORMAT_FIELDS, "text.format.")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        only(fmt, frozenset(("type",)), "text.format.")
        return {"type": kind}
    if kind != "json_schema":
        raise invalid("text.format.type", f"expected one of text, json_object, json_schema, but got {kind!r}")
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _metadata(body: dict) -> dict:
    """Kept with the response and sent back with it, as OpenAI does, within
    OpenAI's bounds: 16 keys, keys of 64 characters, values of 512."""
    metadata = body.get("metadata")
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise _wrong_type("metadata", "an object of strings")
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid("metadata", f"at most {MAX_METADATA_KEYS} keys, but got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise invalid("metadata", f"keys of at most {MAX_METADATA_KEY_CHARS} characters, but "
                          f"'{key[:MAX_METADATA_KEY_CHARS]}...' has {len(key)}")
        if not isinstance(value, str):
            raise _wrong_type(f"metadata.{key}", "a string")
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise invalid(f"metadata.{key}", f"at most {MAX_METADATA_VALUE_CHARS} characters, but got {len(value)}")
    return metadata
