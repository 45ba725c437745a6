"""The tool calls a model writes: which format its chat template asks for, and
the one format the router parses itself.

Mirrors mlx-lm's `json_tools` parser (mlx_lm/tool_parsers/json_tools.py: a
call is a JSON object `{"name": ..., "arguments": {...}}` between <tool_call>
and </tool_call>, the Hermes / Qwen convention), without importing mlx-lm,
whose import costs the router MLX and transformers. `parser_for` names the
parser mlx-lm would pick for a template, as `_infer_tool_parser` in
mlx_lm/tokenizer_utils.py does; a model whose format is another of mlx-lm's
(Qwen3-Coder's XML, Mistral's, GLM's, ...) gets Tandem's default rendering
instead (router/api/tools.py: the tools in the system message, calls in this
JSON format).
"""

from __future__ import annotations

import json
from typing import Callable

JSON_TOOLS = "json_tools"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def parse_json_tool_call(text: str, tools=None) -> dict:
    """The call between the markers: `{"name": ..., "arguments": ...}`
    (ValueError on text that is not JSON)."""
    return json.loads(text.strip())


# mlx-lm's order: the first whose markers the template holds names the parser.
_TEMPLATE_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("gemma4", ("<|tool_call>", "<tool_call|>")),
    ("function_gemma", ("<start_function_call>",)),
    ("longcat", ("<longcat_tool_call>",)),
    ("glm47", ("<arg_key>",)),
)


def parser_for(template, has_token: Callable[[str], bool]) -> str | None:
    """The name of the tool parser mlx-lm infers for a chat template (a
    string; a model's named templates are not read), else from its
    vocabulary (`has_token`); None for no tool calling."""
    if isinstance(template, str):
        found = _from_template(template)
        if found is not None:
            return found
    if all(has_token(t) for t in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")):
        return "kimi_k3"
    if has_token("<|tool_call_start|>") and has_token("<|tool_call_end|>"):
        return "pythonic"
    return None


def _from_template(t: str) -> str | None:
    for name, marks in _TEMPLATE_MARKS:
        if all(m in t for m in marks):
            return name
    if "<|tool_list_start|>" in t or "<|tool_call_start|>" in t:
        return "pythonic"
    if "<tool_call>\\n<function=" in t or "<tool_call>\n<function=" in t:
        return "qwen3_coder"
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if '<function name="' in t and '<param name="' in t:
        return "minicpm5"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<atem:function_calls>" in t:
        return "muse_spark"
    if "<tool_call>" in t and "tool_call.name" in t:
        return JSON_TOOLS
    return None
