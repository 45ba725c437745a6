"""`response_format` and forced tool calls as one llguidance grammar
(protos/grammar.py) that the workers decode under.

- `{"type": "json_object"}`: any JSON object; `{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"?, "description"?}}`: an object
  valid under the schema (strict or not: Tandem always constrains).
- A forced call (tool_choice "required" or a named function): only calls
  (router/api/tools.py `call_grammar_lark`).
- Tools offered with "auto" and a JSON response format: either calls or
  the JSON answer, so an agent's final structured answer and its tool calls
  both follow their schemas.

A grammar the library refuses is a 400 naming the field, and so is one no
output can follow (its first mask, and each local `$ref` target's, computed
here: no worker meets such a grammar mid-batch). Checks are cached by
grammar text: a swarm sends the same schema with every request.
"""

from __future__ import annotations

import json

from protos.grammar import grammar_error, ll_tokenizer, per_tokenizer
from router.api.errors import ApiError, invalid, only
from router.api.tools import ToolFormat, ToolRequest, call_grammar_lark, laid_out, local_refs, rebased_refs

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = frozenset(("name", "schema", "strict", "description"))


def response_schema(body: dict) -> dict | None:
    """The JSON schema `response_format` asks for; None for free text."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise invalid("response_format", "expected an object", 422, "invalid_type")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise invalid("response_format.type", f"expected one of {', '.join(RESPONSE_FORMAT_TYPES)}, but got {kind!r}")
    only(rf, frozenset(("type", "json_schema")), "response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid("response_format.json_schema", "expected an object with 'name' and 'schema'", 422, "invalid_type")
    only(spec, JSON_SCHEMA_FIELDS, "response_format.json_schema.")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid("response_format.json_schema.name", "expected a non-empty string", 422, "invalid_type")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema", "expected a JSON schema object", 422, "invalid_type")
    return schema


def build_grammar(schema: dict | None, tools: ToolRequest | None, fmt: ToolFormat, tokenizer) -> str:
    """The request's grammar ("" when its output is free); 400 when the
    grammar library refuses it."""
    import llguidance

    forced = tools is not None and tools.forced
    calls = []  # the functions a call may name: their schemas' $refs checked
    if forced:
        grammar, param = llguidance.LLMatcher.grammar_from_lark("start: calls\n" + call_grammar_lark(tools, fmt)), "tools"
        calls = tools.functions if tools.choice == "required" else [{"name": tools.choice}]
    elif schema is not None and tools is not None and tools.choice == "auto" and fmt.json:
        lark = f"start: answer | calls\nanswer: %json {json.dumps(laid_out(schema))}\n" + call_grammar_lark(
            ToolRequest(tools.functions, "required", tools.parallel), fmt)
        grammar, param = llguidance.LLMatcher.grammar_from_lark(lark), "response_format"
        calls = tools.functions
    elif schema is not None:
        grammar, param = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(laid_out(schema))), "response_format"
    else:
        return ""
    problem = _check(tokenizer, grammar)
    if not problem and schema is not None and param == "response_format":
        problem = _ref_targets(tokenizer, json.dumps(schema))
    for f in calls if not problem else ():
        problem, param = _ref_targets(tokenizer, json.dumps(tools.schema_of(f["name"]))), "tools"
        if problem:
            break
    if problem:
        raise ApiError(400, f"Invalid '{param}': the grammar library refused its schema: {problem}",
                       param=param, code="invalid_schema")
    return grammar


@per_tokenizer(maxsize=256)
def _check(tokenizer, grammar: str) -> str:
    return grammar_error(grammar, ll_tokenizer(tokenizer))


# A schema's $ref targets checked at most (pydantic: one per nested model).
MAX_REF_TARGETS = 32


@per_tokenizer(maxsize=256)
def _ref_targets(tokenizer, schema_json: str) -> str:
    """What is wrong with the subschemas a schema's local `$ref`s lead to
    ("": nothing). llguidance follows a $ref only when the output reaches
    it, so a target that leads only back to itself ({"$ref": "#/$defs/a"} as
    a's definition) compiles, and fails the request's worker mid-answer.
    Each target is compiled here as a root of its own, and its first mask
    computed."""
    import llguidance

    schema = json.loads(schema_json)
    root = "#/$defs/tandem_root"
    for ref in sorted(local_refs(schema))[:MAX_REF_TARGETS]:
        target = {"$defs": {"tandem_root": rebased_refs(schema, root)}, "$ref": root + ref[1:]}
        problem = _check(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(laid_out(target))))
        if problem:
            return f"'$ref' {ref!r}: {problem}"
    return ""
