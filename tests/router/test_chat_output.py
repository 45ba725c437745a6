"""The answer's text split into content, reasoning and tool calls, fed in
pieces as small as one character (a marker may span any number of tokens)."""

from __future__ import annotations

import json

from router.api.chat_output import ChatOutput, OutputShape, closed_prefix
from router.api.tools import ToolFormat


def run(shape: OutputShape, text: str, step: int = 1):
    out = ChatOutput(shape)
    splits = [out.add(text[i:i + step]) for i in range(0, len(text), step)] + [out.finish()]
    content = "".join(s.content for s in splits)
    reasoning = "".join(s.reasoning for s in splits)
    deltas = [d for s in splits for d in s.calls]
    return out, content, reasoning, deltas


def test_reasoning_goes_apart_from_content_whether_the_prompt_opened_it_or_not():
    shape = OutputShape(think=("<think>", "</think>"), thinking=True)
    _, content, reasoning, _ = run(shape, "Paris is in France.</think>\n\nThe capital is Paris.")
    assert reasoning == "Paris is in France." and content == "The capital is Paris."
    shape = OutputShape(think=("<think>", "</think>"), thinking=False)
    for step in (1, 3, 100):
        _, content, reasoning, _ = run(shape, "<think>hmm</think>Answer: 4", step)
        assert (reasoning, content) == ("hmm", "Answer: 4")


def test_a_marker_cut_anywhere_never_leaks_and_a_near_miss_is_content():
    shape = OutputShape(tools=ToolFormat.of(object()), functions=[])
    text = 'a <tool_cal b\n<tool_call>\n{"name": "f", "arguments": {"x": [1, "}"]}}\n</tool_call>'
    for step in (1, 2, 5):
        out, content, _, deltas = run(shape, text, step)
        assert content == "a <tool_cal b"
        assert [c.name for c in out.calls] == ["f"]
        assert json.loads(out.calls[0].arguments) == {"x": [1, "}"]}
        assert "".join(d.arguments for d in deltas) == out.calls[0].arguments


def test_arguments_before_the_name_are_parsed_whole_at_the_end():
    shape = OutputShape(tools=ToolFormat.of(object()), functions=[])
    out, _, _, deltas = run(shape, '<tool_call>{"arguments": {"q": 1}, "name": "g"}</tool_call>')
    assert [(d.name, d.arguments) for d in deltas] == [("g", ""), (None, '{"q": 1}')]
    assert out.calls[0].name == "g"


def test_a_call_cut_off_by_the_end_of_sequence_still_counts_when_its_arguments_are_whole():
    shape = OutputShape(tools=ToolFormat.of(object()), functions=[])
    out, _, _, _ = run(shape, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("f", {"a": 1})]



def test_a_call_cut_short_is_kept_from_its_name_on_and_never_becomes_text():
    """Whatever ended the answer inside a call: with its name read, the call so
    far (not whole: no "tool_calls" finish); before it, nothing; no markup in content."""
    shape = OutputShape(tools=ToolFormat.of(object()), functions=[])
    for step in (1, 4):
        out, content, _, deltas = run(shape, 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": [2, ', step)
        [call] = out.calls
        assert (call.name, call.arguments, call.complete) == ("f", '{"a": 1, "b": [2, ', False)
        assert content == "Sure." and not out.unparsed and not out.made_calls
        assert "".join(d.arguments for d in deltas) == call.arguments and deltas[0].id == call.id
    out, content, _, deltas = run(shape, '<tool_call>\n{"name": "f", "argu')
    assert [(c.name, c.arguments, c.complete) for c in out.calls] == [("f", "", False)] and deltas[0].name == "f"
    for cut in ('Sure.\n<tool_call>\n{"na', "Sure.\n<tool_c", "Sure.\n<tool_call>"):
        out, content, _, deltas = run(shape, cut)
        assert (content, out.calls, deltas, out.unparsed) == ("Sure.", [], [], "")
    whole = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
    out, _, _, _ = run(shape, whole + '<tool_call>\n{"name": "g", "arguments": {"q": "x')
    assert [(c.name, c.complete) for c in out.calls] == [("f", True), ("g", False)] and not out.made_calls


def test_the_input_of_a_call_cut_short_is_its_largest_closed_prefix():
    for text, value in [("", {}), ("{", {}), ('{"city": "Paris", "days":', {"city": "Paris"}),
                        ('{"city": "Par', {}), ('{"city": "Paris", "da', {"city": "Paris"}),
                        ('{"a": [1, {"b": "x"', {"a": [1, {"b": "x"}]}), ('{"n": 12', {"n": 12}),
                        ('{"n": 1.', {}), ('{"n": tr', {}), ('{"a": {"b": 1}, "c": [', {"a": {"b": 1}, "c": []}),
                        ('{"s": "a\\"b', {}), ('{"s": "}\\"", "t": 1', {"s": '}"', "t": 1}), ('{"a": 1, ', {"a": 1})]:
        assert closed_prefix(text) == value, text


def test_a_call_that_does_not_parse_keeps_its_index_and_the_next_gets_its_own():
    shape = OutputShape(tools=ToolFormat.of(object()), functions=[])
    text = ('<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call>')
    out, _, _, deltas = run(shape, text)
    assert [(d.index, d.name) for d in deltas if d.id] == [(0, "f"), (1, "g")]
    assert [c.name for c in out.calls] == ["g"] and out.unparsed.startswith("<tool_call>")
