"""Tool calling on the request side: `tools`, `tool_choice` and
`parallel_tool_calls` checked, rendered into the prompt, and (when a call
is forced) turned into a grammar the workers decode under.

Where the model's chat template has a tools section, the tools go to its
`tools` argument and the calls are parsed with the tokenizer's parser
(router/text/tool_calls.py, as mlx-lm infers it). A model without one (the
embedded SmolLM2) gets Tandem's default rendering: the tools as JSON in the
system message and calls written as `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`, the Hermes/Qwen convention, parsed as mlx-lm's `json_tools` does.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from router.api.errors import ApiError, invalid, only
from router.guards.json_nesting import check_nesting
from router.text.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_json_tool_call

MAX_TOOLS = 128
TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")

DEFAULT_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


# JSON under a grammar is laid out as json.dumps lays it out (", " and ": ",
# no other whitespace): a weak model cannot pad it with whitespace to its
# token limit, and an earlier call rendered back into a prompt is the text
# the model wrote. A schema's own "x-guidance" settings win.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def laid_out(schema: dict) -> dict:
    """`schema` with Tandem's JSON layout for llguidance, its objects closed
    (`closed_objects`)."""
    return {**closed_objects(schema), "x-guidance": {**JSON_LAYOUT, **(schema.get("x-guidance") or {})}}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # allOf's members are left open: they add up
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")


def closed_objects(schema):
    """`schema` with every object that lists `properties` and says nothing
    of others (no additionalProperties, patternProperties,
    unevaluatedProperties or allOf) closed to them, as xgrammar's strict
    mode (vLLM's default) reads a schema: a grammar that lets a model add
    keys of its own lets a small one add them until max_tokens (pydantic's
    schemas, which instructor and LangChain send, never close their
    objects). What it allows is still valid under the schema as sent."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: closed_objects(sub) for name, sub in value.items()}
        elif key in _SCHEMA_ONE:
            value = [closed_objects(sub) for sub in value] if isinstance(value, list) else closed_objects(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [closed_objects(sub) for sub in value]
        out[key] = value
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def rebased_refs(schema, base: str):
    """`schema` with its local `$ref`s ("#", "#/$defs/X") pointing under
    `base`, the pointer to where it now sits inside a larger schema (a
    function's parameters inside a call's: pydantic's nested models refer
    to their root's `$defs`)."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            value = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: rebased_refs(sub, base) for name, sub in value.items()}
        elif key in _SCHEMA_ONE:
            value = [rebased_refs(sub, base) for sub in value] if isinstance(value, list) else rebased_refs(value, base)
        elif key in _SCHEMA_LISTS + ("allOf",) and isinstance(value, list):
            value = [rebased_refs(sub, base) for sub in value]
        out[key] = value
    return out


def local_refs(schema) -> set[str]:
    """The local `$ref`s ("#...") anywhere a subschema sits in `schema`."""
    found, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                found.add(value)
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                stack += value.values()
            elif key in _SCHEMA_ONE or key in _SCHEMA_LISTS + ("allOf",):
                stack += value if isinstance(value, list) else [value]
    return found


@dataclass(frozen=True)
class ToolFormat:
    """How the served model writes a tool call: the markers around one call,
    the parser of the text between them, whether that text is
    `{"name": ..., "arguments": {...}}` (json: its arguments stream as they
    are generated and a call can be forced by a grammar), and whether the
    chat template renders tools itself (native) or Tandem does."""

    start: str
    end: str
    parse: Callable[[str, Any], dict]
    json: bool
    native: bool

    @classmethod
    def of(cls, tokenizer) -> "ToolFormat":
        template = getattr(tokenizer, "chat_template", None) or ""
        if getattr(tokenizer, "has_tool_calling", False) and "tools" in template:
            parse = tokenizer.tool_parser
            return cls(tokenizer.tool_call_start, tokenizer.tool_call_end, parse, parse is parse_json_tool_call, True)
        return cls(TOOL_CALL_START, TOOL_CALL_END, parse_json_tool_call, True, False)


@dataclass
class ToolRequest:
    """A request's tools. `choice`: "none" | "auto" | "required" | a
    function's name (forced). `functions`: OpenAI function objects."""

    functions: list[dict]
    choice: str
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def schema_of(self, name: str) -> dict:
        for f in self.functions:
            if f["name"] == name:
                return f.get("parameters") or {"type": "object", "properties": {}}
        raise KeyError(name)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --------------------------------------------------------------------------- #
# Checking
# --------------------------------------------------------------------------- #


def parse_tools(body: dict) -> ToolRequest | None:
    """The body's tools, or None when it sends none (or tool_choice "none"
    with none). 400/422 naming the field on anything malformed."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "expected a boolean", 422, "invalid_type")
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "requires 'tools'")
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "expected an array", 422, "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise invalid("tools", f"at most {MAX_TOOLS} tools, but got {len(tools)}")
    functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools[{i}].function.name", f"'{name}' is defined twice")
    return ToolRequest(functions, _choice(choice, names), True if parallel is None else parallel)


def _function(tool: Any, path: str) -> dict:
    if not isinstance(tool, dict):
        raise invalid(path, "expected an object", 422, "invalid_type")
    if tool.get("type", "function") != "function":
        raise ApiError(400, f"Unsupported tool type '{tool.get('type')}' in '{path}': only 'function' tools",
                       param=path + ".type", code="unsupported_value")
    only(tool, frozenset(("type", "function")), path + ".")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(path + ".function", "expected an object", 422, "invalid_type")
    return check_function(fn, path + ".function")


def check_function(fn: dict, path: str, schema_key: str = "parameters") -> dict:
    """One function's definition, normalized to {name, description?,
    parameters?, strict?}; `schema_key` names its JSON schema field
    (Anthropic says input_schema)."""
    only(fn, frozenset(("name", "description", schema_key, "strict")), path + ".")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(path + ".name", "expected a non-empty string", 422, "invalid_type")
    if len(name) > 64 or not set(name) <= TOOL_NAME_CHARS:
        raise invalid(path + ".name", "at most 64 characters of a-z, A-Z, 0-9, '_', '-' and '.'")
    out = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise invalid(path + ".description", "expected a string", 422, "invalid_type")
        out["description"] = description
    schema = fn.get(schema_key)
    if schema is not None:
        if not isinstance(schema, dict):
            raise invalid(f"{path}.{schema_key}", "expected a JSON schema object", 422, "invalid_type")
        out["parameters"] = schema
    return out


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid("tool_choice", f"expected 'none', 'auto', 'required' or a function, but got '{choice}'")
        return choice
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise invalid("tool_choice", "expected 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    name = choice["function"].get("name")
    if name not in names:
        raise invalid("tool_choice.function.name", f"'{name}' is not one of the tools: {', '.join(names)}")
    return name


# --------------------------------------------------------------------------- #
# Rendering
# --------------------------------------------------------------------------- #


def template_tools(tools: ToolRequest) -> list[dict]:
    """The tools as chat templates take them (OpenAI's shape)."""
    return [{"type": "function", "function": f} for f in tools.functions]


def render_default(messages: list[dict], tools: ToolRequest | None, fmt: ToolFormat) -> list[dict]:
    """Messages for a template without a tools section: the tools in the
    system message, earlier calls written as the model writes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and m.get("written"):  # the model's own text for these calls (router/api/answer_tokens.py)
            m = {"role": m["role"], "content": m["written"]}
        elif calls:
            written = "\n".join(f"{fmt.start}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n{fmt.end}"
                                for c in calls)
            m = {"role": m["role"], "content": (m.get("content") or "") + ("\n" if m.get("content") else "") + written}
        elif m["role"] == "tool":
            # Results go back in a user turn, each in <tool_response> tags (the
            # Hermes/Qwen convention the calls follow); a call's results, one turn.
            response = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + response
                continue
            m = {"role": "user", "content": response, "_results": True}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_results"} for m in out]
    if tools is None:
        return out
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in template_tools(tools))
    section = DEFAULT_TOOLS_PROMPT.format(tools=listing)
    if out and out[0]["role"] in ("system", "developer") and isinstance(out[0]["content"], str):
        return [{"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + section}] + out[1:]
    return [{"role": "system", "content": section}] + out


def with_tools(messages: list[dict], tools: ToolRequest | None, fmt: ToolFormat, answers) -> tuple[list[dict], dict]:
    """Messages and chat-template arguments with the request's tools and
    earlier calls in them: the template's own rendering where it has one,
    else Tandem's default (router/api/tools.py)."""
    if fmt.native:
        return messages, ({"tools": template_tools(tools)} if tools is not None else {})
    if tools is None and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        return messages, {}
    if answers is not None:  # the model's own text for calls it made: the prompt's KV is reused
        for m in messages:
            if m.get("tool_calls"):
                written = answers.written_calls([(c["id"], c["function"]["name"], c["function"]["arguments"])
                                                 for c in m["tool_calls"]])
                # Only as the client sent it back: the text before the calls unchanged too.
                if written is not None and written.split(fmt.start, 1)[0].strip() == (m.get("content") or "").strip():
                    m["written"] = written
    return render_default(messages, tools, fmt), {}


# --------------------------------------------------------------------------- #
# Forcing a call
# --------------------------------------------------------------------------- #


def call_grammar_lark(tools: ToolRequest, fmt: ToolFormat) -> str:
    """Lark rules (start symbol `calls`) for what the model may write when
    it must call: exactly one call of a named function (whatever
    parallel_tool_calls says: a client that names one wants one answer);
    with "required", a call of any of them, or several with
    parallel_tool_calls, each call's arguments valid under its function's
    schema. The grammar accepts after every whole call, so the model may end
    (EOS) after any of them; one call alone leaves only EOS."""
    if not fmt.json:
        raise ApiError(400, "Forcing a tool call (tool_choice 'required' or a named function) is not supported "
                       "for this model's tool-call format; use tool_choice 'auto'",
                       param="tool_choice", code="unsupported_value")
    names = [f["name"] for f in tools.functions] if tools.choice == "required" else [tools.choice]
    bodies = []
    for i, name in enumerate(names):
        arguments = rebased_refs(tools.schema_of(name), "#/properties/arguments")
        schema = {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments},
                  "required": ["name", "arguments"], "additionalProperties": False}
        bodies.append(f"call_{i}: {json.dumps(fmt.start + chr(10))} %json {json.dumps(laid_out(schema))} "
                      f"{json.dumps(chr(10) + fmt.end)}")
    one = " | ".join(f"call_{i}" for i in range(len(names)))
    rules = [f"call: {one}"] + bodies
    several = tools.parallel and tools.choice == "required"
    rules.insert(0, 'calls: call ("\\n" call)*' if several else "calls: call")
    return "\n".join(rules)


# --------------------------------------------------------------------------- #
# Messages that carry calls and results
# --------------------------------------------------------------------------- #


def message_tool_calls(message: dict, path: str) -> list[dict]:
    """An assistant message's `tool_calls`, checked, with each call's
    arguments parsed from their JSON text (templates render a mapping)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        raise invalid(path + "tool_calls", "expected an array", 422, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{path}tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise invalid(at, "expected {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
                       422, "invalid_type")
        fn = call["function"]
        name, arguments = fn.get("name"), fn.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise invalid(at + ".function.name", "expected a non-empty string", 422, "invalid_type")
        if isinstance(arguments, str):
            check_nesting(arguments, at + ".function.arguments")  # JSON in a string: the body's bound did not see it
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError) as exc:
                raise invalid(at + ".function.arguments", f"not valid JSON: {exc}")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(at + ".id", "expected a string", 422, "invalid_type")
        out.append({"id": call_id or new_call_id(), "type": "function",
                    "function": {"name": name, "arguments": arguments}})
    return out
