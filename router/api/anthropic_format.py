"""Anthropic's shapes for /v1/messages: a whole message, its stream's events
(message_start, content_block_start / _delta / _stop, message_delta,
message_stop), errors (router/api/http_stream.py sends them).

Content blocks, in the order the answer has them: `thinking` (a reasoning
model's reasoning), `text`, `tool_use` (one per call, its input streamed as
`input_json_delta` fragments as the model writes them).

A call cut short (max_tokens, a stop sequence) is still a `tool_use` block:
streamed, its fragments as they came, then its block's stop; whole, its
`input` is the largest prefix of the arguments that closes into an object
(router/api/chat_output.py `closed_prefix`), {} before its first member.
"""

from __future__ import annotations

import json

from router.api.chat_output import closed_prefix
from router.api.errors import ApiError
from router.api.generation import Generation, Piece
from router.api.http_stream import sse

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}  # any other finish: end_turn


def usage(generation: Generation) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, the
    ones read from the prefix cache are `cache_read_input_tokens` (the three
    input counts add up to the prompt). Nothing is billed for writing the
    cache, so `cache_creation_input_tokens` is 0."""
    prompt = len(generation.request.prompt_tokens)
    cached = min(generation.cached_tokens, prompt)
    return {"input_tokens": prompt - cached, "output_tokens": generation.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def stop(generation: Generation, finish_reason: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished generation."""
    if finish_reason == "stop" and generation.text.stopped:
        return "stop_sequence", generation.text.stop_sequence
    return STOP_REASONS.get(finish_reason, "end_turn"), None


class MessagesFormat:
    """The shapes of one /v1/messages request (a `ResponseShapes`)."""

    id_prefix = "msg_"

    def __init__(self, message_id: str, model: str, generation: Generation):
        self.id = message_id
        self.model = model
        self.generation = generation
        # Stream state: the open block's index and type, the last piece's finish.
        self.block = -1
        self.block_type: str | None = None
        self.finish_reason: str | None = None
        self.input_started = False  # the open tool_use block's input has begun (past leading whitespace)

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage(self.generation)}

    # ResponseShapes (router/api/http_stream.py)
    def full(self, pieces: list[Piece], generation: Generation) -> dict:
        content = []
        reasoning = "".join(p.reasoning for p in pieces)
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        text = "".join(p.text for p in pieces) + (generation.output.unparsed if generation.output is not None else "")
        if text:
            content.append({"type": "text", "text": text})
        content += [{"type": "tool_use", "id": c.id, "name": c.name,
                     "input": json.loads(c.arguments) if c.complete else closed_prefix(c.arguments)}
                    for c in generation.calls]
        return self._message(content, *stop(generation, pieces[-1].finish_reason if pieces else None))

    def stream_piece(self, piece: Piece, first: bool) -> list[bytes]:
        out = []
        if first:
            out += [sse({"type": "message_start", "message": self._message([], None, None)}, event="message_start"),
                    sse({"type": "ping"}, event="ping")]
        if piece.reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.text:
            out += self._text(piece.text)
        for delta in piece.calls:
            if delta.id is not None:
                out += self._open(f"tool_use {delta.id}",
                                  {"type": "tool_use", "id": delta.id, "name": delta.name, "input": {}})
            # Clients parse each prefix of the input (the anthropic SDK does): one
            # of only whitespace, before the value starts, is no JSON.
            partial = delta.arguments if self.input_started else delta.arguments.lstrip()
            if partial:
                self.input_started = True
                out.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
        self.finish_reason = piece.finish_reason or self.finish_reason
        return out

    def stream_end(self, generation: Generation) -> list[bytes]:
        unparsed = generation.output.unparsed if generation.output is not None else ""
        out = self._text(unparsed) if unparsed else []  # calls that did not parse, as written (as in `full`)
        out += self._close()
        stop_reason, stop_sequence = stop(generation, self.finish_reason)
        delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                 "usage": usage(generation)}
        return out + [sse(delta, event="message_delta"), sse({"type": "message_stop"}, event="message_stop")]

    def error_body(self, error: ApiError) -> dict:
        return error.anthropic_body()

    def stream_error(self, error: ApiError) -> bytes:
        return sse(error.anthropic_body(), event="error")

    # ----------------------------------------------------------- stream blocks
    def _text(self, text: str) -> list[bytes]:
        return self._open("text", {"type": "text", "text": ""}) + [self._delta({"type": "text_delta", "text": text})]

    def _open(self, block_type: str, block: dict) -> list[bytes]:
        """Events that make `block_type` the open block (nothing when it is)."""
        if self.block_type == block_type:
            return []
        out = self._close()
        self.block += 1
        self.block_type = block_type
        self.input_started = False
        start = {"type": "content_block_start", "index": self.block, "content_block": block}
        return out + [sse(start, event="content_block_start")]

    def _close(self) -> list[bytes]:
        if self.block_type is None:
            return []
        self.block_type = None
        return [sse({"type": "content_block_stop", "index": self.block}, event="content_block_stop")]

    def _delta(self, delta: dict) -> bytes:
        return sse({"type": "content_block_delta", "index": self.block, "delta": delta}, event="content_block_delta")
