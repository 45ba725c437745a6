"""Ollama's answer shapes (router/ollama/ndjson_format.py): NDJSON lines and
whole answers from pieces, with tool calls whole and arguments as objects,
the last line's counts and durations, errors as {"error": ...}."""

from __future__ import annotations

import asyncio
import json
import types

from protos.messages import TokenLogprob
from router.api.chat_output import ToolCall
from router.api.errors import ApiError
from router.api.generation import Piece
from router.ollama.ndjson_format import NDJSON, ChatLines, GenerateLines, TimedGeneration, load_answer

PIECES = [Piece("", reasoning="hm"), Piece("Hel"), Piece("lo", finish_reason="stop")]


class FakeGeneration:
    def __init__(self, pieces, calls=()):
        self._pieces = pieces
        self.calls = list(calls)
        self.output = types.SimpleNamespace(unparsed="") if calls else None
        self.request = types.SimpleNamespace(prompt_tokens=[1, 2, 3])
        self.completion_tokens = 0

    async def pieces(self):
        for piece in self._pieces:
            await asyncio.sleep(0.001)
            self.completion_tokens += 1
            yield piece


def run(shapes_class, pieces, calls=(), stream=True, **kwargs):
    timed = TimedGeneration(FakeGeneration(pieces, calls), arrived_ns=0, loaded_ns=0)
    shapes = shapes_class("m:latest", timed, **kwargs)

    async def go():
        got = []
        async for piece in timed.pieces():
            got.append(piece)
        return got

    got = asyncio.run(go())
    if not stream:
        return shapes.full(got, timed)
    out = b"".join(b"".join(shapes.stream_piece(p, i == 0)) for i, p in enumerate(got)) + b"".join(
        shapes.stream_end(timed))
    assert out.endswith(b"\n") and shapes.media_type == NDJSON
    return [json.loads(x) for x in out.splitlines()]


def test_a_chat_stream_is_ndjson_lines_ending_with_counts_and_durations():
    lines = run(ChatLines, PIECES)
    assert [x["message"] for x in lines] == [{"role": "assistant", "content": "", "thinking": "hm"},
                                             {"role": "assistant", "content": "Hel"},
                                             {"role": "assistant", "content": "lo"},
                                             {"role": "assistant", "content": ""}]
    assert [x["done"] for x in lines] == [False, False, False, True]
    last = lines[-1]
    assert last["model"] == "m:latest" and last["done_reason"] == "stop" and last["created_at"].endswith("Z")
    assert last["prompt_eval_count"] == 3 and last["eval_count"] == 3
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0
    assert last["total_duration"] >= last["prompt_eval_duration"] + last["eval_duration"] > 0


def test_a_whole_chat_answer_with_calls_whole_and_arguments_as_objects():
    calls = [ToolCall("call_1", "weather", '{"city": "Paris"}'), ToolCall("call_2", "weather", '{"ci', complete=False)]
    body = run(ChatLines, [Piece("", finish_reason="tool_calls")], calls, stream=False)
    assert body["message"] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "function": {"index": 0, "name": "weather", "arguments": {"city": "Paris"}}}]}
    assert body["done"] is True and body["done_reason"] == "stop"
    lines = run(ChatLines, [Piece("", finish_reason="tool_calls")], calls)
    assert lines[0]["message"]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert lines[-1]["done"] and "tool_calls" not in lines[-1]["message"]


def test_generate_lines_length_and_logprobs():
    token_bytes = type("TB", (), {"text": lambda self, t: f"t{t}", "__call__": lambda self, t: f"t{t}".encode()})()
    pieces = [Piece("a", [TokenLogprob(5, -0.5, [(5, -0.5), (6, float("-inf"))])]), Piece("b", finish_reason="length")]
    body = run(GenerateLines, pieces, stream=False, token_bytes=token_bytes, top_logprobs=1)
    assert body["response"] == "ab" and body["done_reason"] == "length" and "message" not in body
    assert body["logprobs"] == [{"token": "t5", "logprob": -0.5, "bytes": [116, 53],
                                 "top_logprobs": [{"token": "t5", "logprob": -0.5, "bytes": [116, 53]}]}]
    lines = run(GenerateLines, pieces)
    assert [x["response"] for x in lines] == ["a", "b", ""] and "logprobs" not in lines[0]


def test_errors_and_load_answers_in_ollamas_shape():
    shapes = ChatLines("m", TimedGeneration(FakeGeneration([]), 0, 0))
    assert shapes.error_body(ApiError(404, 'model "x" not found')) == {"error": 'model "x" not found'}
    assert json.loads(shapes.stream_error(ApiError(504, "no progress"))) == {"error": "no progress"}
    assert load_answer("m", "chat", True, 0)["done_reason"] == "unload"
    loaded = load_answer("m", "generate", False, 0)
    assert loaded["done_reason"] == "load" and loaded["response"] == "" and loaded["done"] is True
