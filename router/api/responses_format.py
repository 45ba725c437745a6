"""OpenAI's Responses shapes for `POST /v1/responses` (router/api/http_stream.py
sends them): the response object, its stream's events, errors.

An answer is a list of output items: the reasoning (a `reasoning` item whose
content is the model's reasoning text, for models that think), the text (a
`message` item with one `output_text` part) and each tool call (a
`function_call` item). Streamed, each item is opened
(`response.output_item.added`), grows by deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`)
and is closed (`...done`, `response.output_item.done`); the stream opens with
`response.created` and `response.in_progress` and ends with
`response.completed` (or `response.incomplete` when max_output_tokens cut
the answer) carrying the whole response. Every event has `type` and
`sequence_number` and goes out as `event: <type>`.

When the answer ends, the response (unless `store` is false) is kept with
its conversation for `previous_response_id` (router/api/responses_request.py).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Callable

from router.api.errors import ApiError
from router.api.generation import Generation, Piece
from router.api.http_stream import sse
from router.api.response_store import StoredResponse, TenantResponses
from router.api.responses_request import ResponsesTurn


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(16)


def _text_item(kind: str) -> dict:
    """A message or reasoning item, empty and in progress."""
    if kind == "message":
        return {"id": _new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                "content": [{"type": "output_text", "text": "", "annotations": []}]}
    return {"id": _new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [],
            "content": [{"type": "reasoning_text", "text": ""}]}


def _call_item(call_id: str, name: str, arguments: str = "") -> dict:
    return {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call_id,
            "name": name, "arguments": arguments}


def _unparsed(generation: Generation) -> str:
    """Calls that would not parse, as the model wrote them: text of the answer."""
    return generation.output.unparsed if generation.output is not None else ""


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def answer_message(output: list[dict]) -> dict:
    """The response's output as the assistant message a chat's next turn repeats."""
    message = {"role": "assistant", "content": "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"])}
    reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
    if reasoning:
        message["reasoning_content"] = reasoning
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call" and item["status"] == "completed"]
    if calls:
        message["tool_calls"] = calls
    return message


class _StreamedItems:
    """A streamed answer's output items and the events that build them."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # ToolCallDelta.index -> its item
        self.finish_reason: str | None = None

    def add(self, piece: Piece) -> list[dict]:
        out = []
        if piece.reasoning:
            out += self._text("reasoning", piece.reasoning)
        if piece.text:
            out += self._text("message", piece.text)
        for delta in piece.calls:
            if delta.id is not None:
                out += self._close("completed")
                self.calls[delta.index] = item = _call_item(delta.id, delta.name)
                out += self._open(item)
            elif delta.arguments:
                item = self.calls[delta.index]
                item["arguments"] += delta.arguments
                out.append({"type": "response.function_call_arguments.delta", **self._where(item),
                            "delta": delta.arguments})
        self.finish_reason = piece.finish_reason or self.finish_reason
        return out

    def finish(self, generation: Generation) -> list[dict]:
        """The last events: text held back as a call that would not parse,
        then the open item closed (cut short when max tokens ended it)."""
        out = self._text("message", _unparsed(generation)) if _unparsed(generation) else []
        if self.open is not None and self.open["type"] == "function_call":
            parsed = {c.id for c in generation.calls if c.complete}
            return out + self._close("completed" if self.open["call_id"] in parsed else "incomplete")
        return out + self._close("incomplete" if self.finish_reason == "length" else "completed")

    def _where(self, item: dict, part: bool = False) -> dict:
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        return {**where, "content_index": 0} if part else where

    def _open(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        if item["type"] == "function_call":
            return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}]
        # Copies: the item grows before its events are sent.
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": {**item, "content": []}},
                {"type": "response.content_part.added", **self._where(item, part=True),
                 "part": dict(item["content"][0])}]

    def _text(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close("completed")
            out += self._open(_text_item(kind))
        self.open["content"][0]["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return out + [{"type": event, **self._where(self.open, part=True), "delta": text, **extra}]

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item["type"] == "function_call" and not _is_json(item["arguments"]):
            status = "incomplete"  # a call that would not parse: its text comes as the message's
        item["status"] = status
        done = {"type": "response.output_item.done", "output_index": self.items.index(item), "item": item}
        if item["type"] == "function_call":
            return [{"type": "response.function_call_arguments.done", **self._where(item), "name": item["name"],
                     "arguments": item["arguments"]}, done]
        part = item["content"][0]
        text_done = ({"type": "response.output_text.done", **self._where(item, part=True), "text": part["text"],
                      "logprobs": []} if item["type"] == "message" else
                     {"type": "response.reasoning_text.done", **self._where(item, part=True), "text": part["text"]})
        return [text_done, {"type": "response.content_part.done", **self._where(item, part=True), "part": part}, done]


class ResponsesFormat:
    """The Responses shapes of one request (a router/api/http_stream.py ResponseShapes)."""

    id_prefix = "resp_"

    def __init__(self, response_id: str, model: str, turn: ResponsesTurn, store: TenantResponses,
                 count_tokens: Callable[[str], int]):
        self.id = response_id
        self.model = model
        self.turn = turn
        self.store = store
        self.count_tokens = count_tokens  # of the reasoning text, for usage
        self.created_at = int(time.time())
        self.sequence = 0
        self.streamed = _StreamedItems()

    # ResponseShapes (router/api/http_stream.py)
    def full(self, pieces: list[Piece], generation: Generation) -> dict:
        finish = pieces[-1].finish_reason if pieces else None
        reasoning = "".join(p.reasoning for p in pieces)
        text = "".join(p.text for p in pieces) + _unparsed(generation)
        output = []
        if reasoning:
            output.append(_text_item("reasoning"))
            output[-1]["content"][0]["text"] = reasoning
        if text or not generation.calls:
            output.append(_text_item("message"))
            output[-1]["content"][0]["text"] = text
        for item in output:
            item["status"] = "completed"
        if finish == "length" and output and not generation.calls:
            output[-1]["status"] = "incomplete"
        for c in generation.calls:  # one cut short: its arguments so far, incomplete
            output.append({**_call_item(c.id, c.name, c.arguments),
                           "status": "completed" if c.complete else "incomplete"})
        return self._finish(output, finish, generation)

    def stream_piece(self, piece: Piece, first: bool) -> list[bytes]:
        events = []
        if first:
            opening = self._object("in_progress", [])
            events += [{"type": "response.created", "response": opening},
                       {"type": "response.in_progress", "response": opening}]
        return [self._sse(e) for e in events + self.streamed.add(piece)]

    def stream_end(self, generation: Generation) -> list[bytes]:
        events = self.streamed.finish(generation)
        response = self._finish(self.streamed.items, self.streamed.finish_reason, generation)
        ended = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return [self._sse(e) for e in events + [{"type": ended, "response": response}]]

    def error_body(self, error: ApiError) -> dict:
        return error.body()

    def stream_error(self, error: ApiError) -> bytes:
        code = "rate_limit_exceeded" if error.status == 429 else "server_error"
        failed = self._object("failed", self.streamed.items, error={"code": code, "message": error.message})
        return (self._sse({"type": "error", "code": error.code or error.type, "message": error.message,
                           "param": error.param})
                + self._sse({"type": "response.failed", "response": failed}))

    # ----------------------------------------------------------- internal
    def _sse(self, event: dict) -> bytes:
        out = sse({**event, "sequence_number": self.sequence}, event=event["type"])
        self.sequence += 1
        return out

    def _object(self, status: str, output: list[dict], **extra) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": None, "incomplete_details": None, "model": self.model,
                "output": output, "usage": None, **self.turn.echo, **extra}

    def _finish(self, output: list[dict], finish: str | None, generation: Generation) -> dict:
        """The whole response, kept for the conversation's next turn unless store is false."""
        incomplete = finish == "length"
        usage = generation.usage()
        reasoning = "".join(p["text"] for item in output if item["type"] == "reasoning" for p in item["content"])
        response = self._object(
            "incomplete" if incomplete else "completed", output,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            completed_at=None if incomplete else int(time.time()),
            usage={"input_tokens": usage["prompt_tokens"],
                   "input_tokens_details": {"cached_tokens": generation.cached_tokens},
                   "output_tokens": usage["completion_tokens"],
                   "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
                   "total_tokens": usage["total_tokens"]})
        if self.turn.store:
            conversation = self.turn.conversation + [answer_message(output)]
            self.store.put(StoredResponse(response, conversation, usage["total_tokens"]))
        return response
