"""Ollama's /api/chat and /api/generate bodies as the OpenAI chat (or
completion) body the router already parses (router/api/openai_request.py),
so one path templates, tokenizes and runs every request.

- /api/chat: messages (`images` -> image parts, `thinking` ->
  reasoning_content, `tool_calls` with arguments as objects; a `tool`
  message's call id from `tool_call_id`, else the earlier call of its
  `tool_name`), tools as they are (Ollama's are OpenAI's).
- /api/generate: `system` and `prompt` (and `images`) as a chat of one
  turn; with `raw`, or for a model without a chat template, the prompt as a
  completion. `suffix` (fill-in-the-middle) and `template` (a Go template)
  are refused: Tandem has neither. `context` is refused as Ollama deprecated
  it: send the conversation to /api/chat.
- `options` (router/ollama/options.py), `format` ("json" or a JSON schema
  -> response_format), `think` (true/false -> the template's
  enable_thinking; "low"/"medium"/"high" also its reasoning_effort),
  `keep_alive` (router/models/keep_alive.py), `stream` (Ollama's default:
  true), `logprobs` and `top_logprobs`.
- No messages (or no prompt): the request only loads the model, or unloads
  it with keep_alive 0 (`ollama stop`).
Any other field is a 400 naming it, never dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from router.api.errors import ApiError
from router.models.keep_alive import KeepAliveError, parse_keep_alive
from router.ollama.names import tandem_name
from router.ollama.options import OPTION_OF_FIELD, TO_THE_CONTEXT, sampling_of

COMMON_FIELDS = frozenset(("model", "stream", "keep_alive", "options", "format", "think", "logprobs", "top_logprobs"))
CHAT_FIELDS = COMMON_FIELDS | {"messages", "tools"}
GENERATE_FIELDS = COMMON_FIELDS | {"prompt", "suffix", "system", "template", "context", "raw", "images"}
MESSAGE_FIELDS = frozenset(("role", "content", "images", "thinking", "tool_calls", "tool_name", "tool_call_id"))
THINK_LEVELS = ("low", "medium", "high")
# Image generation's fields (Ollama's experimental image models): refused by name.
IMAGE_GENERATION_FIELDS = ("width", "height", "steps")


@dataclass
class ModelFacts:
    """What a translation needs of the model: its name for errors, whether it
    takes images, thinks, and has a chat template."""

    name: str
    vision: bool = False
    thinking: bool = False
    template: bool = True


@dataclass
class OllamaCall:
    """One /api/chat or /api/generate request, as the router runs it."""

    name: str  # the model as the client named it (echoed in the answer)
    model: str  # the model as Tandem names it (router/ollama/names.py)
    stream: bool
    keep_alive: float | None  # seconds, FOREVER, or None (the server's default)
    raw: dict = field(default_factory=dict)  # the Ollama body
    kind: str = "chat"  # "chat" | "completion"
    body: dict | None = None  # the OpenAI body (after `translate`); None: load or unload only
    template_kwargs: dict = field(default_factory=dict)  # enable_thinking, reasoning_effort
    fields: dict = field(default_factory=dict)  # the OpenAI fields of `options` and `format`, checked
    to_the_context: bool = False  # num_predict -1 or -2: the answer may run to the context's end

    @property
    def load_only(self) -> bool:
        return self.body is None


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def refuse_unknown(body: dict, honoured: frozenset, path: str = "") -> None:
    unknown = sorted(k for k, v in body.items() if k not in honoured and v is not None)
    if unknown:
        names = ", ".join(f"'{path}{k}'" for k in unknown[:8])
        raise bad_request(f"unsupported field{'s' if len(unknown) > 1 else ''} {names}: Tandem does not honour "
                     f"{'them' if len(unknown) > 1 else 'it'} and will not ignore it silently; supported: "
                     f"{', '.join(sorted(honoured))}", path + unknown[0])


def read_call(body: dict, endpoint: str) -> OllamaCall:
    """The fields every chat or generate request is routed by (model,
    stream, keep_alive), and its options and format, checked before its
    model is taken from the pool (a bad one costs no load)."""
    refuse_unknown(body, CHAT_FIELDS if endpoint == "chat" else GENERATE_FIELDS)
    name = body.get("model")
    if not isinstance(name, str) or not name.strip():
        raise bad_request("model is required", "model")
    stream = body.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    try:
        keep_alive = parse_keep_alive(body.get("keep_alive"))
    except KeepAliveError as exc:
        raise bad_request(str(exc), "keep_alive") from None
    fields = {**sampling_of(body.get("options")), **_format(body.get("format"))}
    return OllamaCall(name, tandem_name(name), stream, keep_alive, body, fields=fields)


def translate(call: OllamaCall, endpoint: str, facts: ModelFacts) -> OllamaCall:
    """`call.body` set to the OpenAI body (None when the request only loads
    or unloads the model), `call.kind` and `call.template_kwargs` with it."""
    body = call.raw
    if endpoint == "chat":
        messages = body.get("messages")
        if messages is not None and not isinstance(messages, list):
            raise bad_request("'messages' must be an array", "messages")
        if not messages:
            return call
        out = {"messages": chat_messages(messages, facts)}
        tools = body.get("tools")
        if tools:
            out["tools"] = tools
    else:
        out = _generate(body, facts, call)
        if out is None:
            return call
    if "messages" in out:
        call.template_kwargs = _think(body.get("think"), facts)
    elif body.get("think") is not None:
        raise bad_request("'think' needs the model's chat template: it has no effect on a raw prompt", "think")
    out.update(call.fields)
    if out.get("max_tokens") == TO_THE_CONTEXT:  # set once the prompt is tokenized (its length known)
        del out["max_tokens"]
        call.to_the_context = True
    out.update(_logprobs(body, completion="prompt" in out))
    out["model"] = call.model
    out["stream"] = call.stream
    call.kind = "chat" if "messages" in out else "completion"
    call.body = out
    return call


def _generate(body: dict, facts: ModelFacts, call: OllamaCall) -> dict | None:
    for name in ("suffix", "template"):
        if body.get(name):
            why = ("Tandem has no fill-in-the-middle" if name == "suffix" else
                   "Tandem renders the model's own chat template (send raw: true with the whole prompt instead)")
            raise bad_request(f"'{name}' is not supported: {why}", name)
    if body.get("context"):
        raise bad_request("'context' is not supported (Ollama deprecated it): send the conversation to /api/chat "
                     "as messages", "context")
    prompt, system, images = body.get("prompt"), body.get("system"), body.get("images") or []
    for name, value in (("prompt", prompt), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise bad_request(f"'{name}' must be a string", name)
    raw = body.get("raw")
    if raw is not None and not isinstance(raw, bool):
        raise bad_request("'raw' must be a boolean", "raw")
    if not prompt and not images:
        return None
    if raw or not facts.template:
        why = "with raw: true" if raw else f"for {facts.name}, which has no chat template"
        if system:
            raise bad_request(f"'system' has no effect {why} (the prompt is sent as it is): put it in the prompt", "system")
        if images:
            raise bad_request(f"'images' need the chat template: send them without raw ({why})", "images")
        return {"prompt": prompt}
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt or "", "images": images}]
    return {"messages": chat_messages(messages, facts, paths=["system", "prompt"][-len(messages):])}


def chat_messages(messages: list, facts: ModelFacts, paths: list[str] | None = None) -> list[dict]:
    """Ollama messages as OpenAI chat messages. `paths`: what each message
    is called in errors (generate's system and prompt)."""
    out, pending = [], []  # pending: the last assistant turn's calls a tool message has not answered
    for i, message in enumerate(messages):
        at = paths[i] if paths else f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{at}' must be an object", at)
        refuse_unknown(message, MESSAGE_FIELDS, at + ".")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise bad_request(f"'{at}.role' is required", at + ".role")
        if content is not None and not isinstance(content, str):
            raise bad_request(f"'{at}.content' must be a string", at + ".content")
        converted = {"role": role, "content": content or ""}
        images = message.get("images") or []
        if images:
            converted["content"] = _image_parts(content or "", images, facts, "images" if paths else at + ".images")
        if message.get("thinking"):
            converted["reasoning_content"] = message["thinking"]
        if message.get("tool_calls"):
            pending = _assistant_calls(message["tool_calls"], at)
            converted["tool_calls"] = pending
            pending = list(pending)
        if role == "tool":
            converted["tool_call_id"] = _call_id_of(message, pending, at)
        elif message.get("tool_name") or message.get("tool_call_id"):
            raise bad_request(f"'{at}': only 'tool' messages carry tool_name or tool_call_id", at)
        out.append(converted)
    return out


def _image_parts(text: str, images, facts: ModelFacts, at: str) -> list[dict]:
    if not facts.vision:
        raise bad_request(f"{facts.name} does not support images (it is not a vision model)", at)
    if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
        raise bad_request(f"'{at}' must be an array of base64 strings", at)
    parts = [{"type": "text", "text": text}] if text else []
    # The router reads a data URL's bytes and tells the image's format from them.
    return parts + [{"type": "image_url", "image_url": {"url": f"data:;base64,{image}"}} for image in images]


def _assistant_calls(calls, at: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"'{at}.tool_calls' must be an array", at + ".tool_calls")
    out = []
    for j, call in enumerate(calls):
        where = f"{at}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"'{where}' must be {{\"function\": {{\"name\", \"arguments\"}}}}", where)
        refuse_unknown(call, frozenset(("id", "type", "function")), where + ".")
        refuse_unknown(fn, frozenset(("name", "arguments", "index", "description")), where + ".function.")
        arguments = fn.get("arguments") or {}
        if not isinstance(arguments, (dict, str)):
            raise bad_request(f"'{where}.function.arguments' must be an object", where + ".function.arguments")
        # Ids by position: the same conversation sent again renders the same prompt (its cached prefix).
        call_id = call.get("id") or f"call_{re.sub(r'[^0-9]+', '_', at).strip('_')}_{j}"
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _call_id_of(message: dict, pending: list[dict], at: str) -> str:
    """A tool result's call: its tool_call_id, else the first unanswered
    call of its tool_name (Ollama's clients send only the name), else the
    first unanswered call."""
    given = message.get("tool_call_id")
    if given is not None:
        if not isinstance(given, str):
            raise bad_request(f"'{at}.tool_call_id' must be a string", at + ".tool_call_id")
        return given
    name = message.get("tool_name")
    match = next((c for c in pending if c["function"]["name"] == name), pending[0] if pending else None)
    if match is None:
        return f"call_{re.sub(r'[^0-9]+', '_', at).strip('_')}"  # a result with no call before it: the template decides
    pending.remove(match)
    return match["id"]


def _think(think, facts: ModelFacts) -> dict:
    if think is None:
        return {}
    if think is False:
        return {"enable_thinking": False}
    if think is True or think in THINK_LEVELS:
        if not facts.thinking:
            raise bad_request(f'"{facts.name}" does not support thinking', "think")
        return {"enable_thinking": True} | ({} if think is True else {"reasoning_effort": think})
    raise bad_request(f"'think' must be true, false or one of {', '.join(THINK_LEVELS)}", "think")


def _format(fmt) -> dict:
    if fmt in (None, ""):
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise bad_request("'format' must be \"json\" or a JSON schema object", "format")


def _logprobs(body: dict, completion: bool) -> dict:
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is None and top is None:
        return {}
    if want is not None and not isinstance(want, bool):
        raise bad_request("'logprobs' must be a boolean", "logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise bad_request("'top_logprobs' must be an integer", "top_logprobs")
    if completion:  # the legacy completion field: the number of alternatives
        return {"logprobs": top or 0} if want or top else {}
    return {"logprobs": bool(want or top), "top_logprobs": top or 0}


def renamed(error: ApiError, endpoint: str) -> ApiError:
    """A chat parser's error naming Ollama's fields: options by their
    Ollama names, response_format as format, a generate's single turn as
    its prompt (in the param, and where the message quotes it)."""
    names = "|".join(map(re.escape, OPTION_OF_FIELD))
    for attr, start in (("message", r"(?<=')"), ("param", r"^")):
        text = getattr(error, attr)
        if not text:
            continue
        text = re.sub(start + r"(" + names + r")\b", lambda m: "options." + OPTION_OF_FIELD[m.group(1)], text)
        text = re.sub(start + r"response_format(\.json_schema\.schema)?", "format", text)
        if endpoint == "generate":
            text = re.sub(start + r"messages\[\d+\]\.content(?!\[)|" + start + r"messages\b(?!\[)", "prompt", text)
        setattr(error, attr, text)
    return error


def arguments_object(arguments: str):
    """A call's arguments as Ollama sends them: an object (JSON text parsed)."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
