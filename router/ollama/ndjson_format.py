"""Ollama's answer shapes for /api/chat and /api/generate: one JSON object,
or NDJSON lines (`application/x-ndjson`), sent by router/api/http_stream.py
as any endpoint's shapes are.

Each line has `model` (as the client named it), `created_at` and `done`;
a chat's text is in `message` (`content`, `thinking`, `tool_calls` with
arguments as objects: whole calls, in the line where the answer ends), a
generate's in `response` (and `thinking`). The last line adds `done_reason`
("stop", "length"; "load" and "unload" for a request that only loads or
unloads the model) and the counts and durations, in nanoseconds:
`total_duration` from the request's arrival, `load_duration` the wait for
the model, `prompt_eval_duration` until the first text, `eval_duration` the
rest. `prompt_eval_count` is the whole prompt (cached tokens included).
Errors: {"error": "..."}, a body or, once the stream has begun, a line.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import aclosing
from datetime import datetime, timezone

from router.api.errors import ApiError
from router.api.generation import Generation, Piece
from router.ollama.request import arguments_object
from router.text.text_stream import TokenBytes

log = logging.getLogger("tandem.router")

NDJSON = "application/x-ndjson"
DONE_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length"}


def created_at() -> str:
    """Now as Ollama writes it (RFC 3339, UTC)."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def line(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


class TimedGeneration:
    """A generation whose first piece and end are timed (for the last
    line's durations); everything else is the generation's."""

    def __init__(self, generation: Generation, arrived_ns: int, loaded_ns: int):
        self.generation = generation
        self.arrived_ns, self.loaded_ns = arrived_ns, loaded_ns
        self.first_ns: int | None = None
        self.ended_ns: int | None = None

    def __getattr__(self, name):
        return getattr(self.generation, name)

    async def pieces(self):
        async with aclosing(self.generation.pieces()) as pieces:
            async for piece in pieces:
                if self.first_ns is None:
                    self.first_ns = time.monotonic_ns()
                yield piece
        self.ended_ns = time.monotonic_ns()

    def durations(self) -> dict:
        end = self.ended_ns or time.monotonic_ns()
        first = self.first_ns or end
        return {"total_duration": end - self.arrived_ns, "load_duration": self.loaded_ns - self.arrived_ns,
                "prompt_eval_count": len(self.generation.request.prompt_tokens),
                "prompt_eval_duration": max(0, first - self.loaded_ns),
                "eval_count": self.generation.completion_tokens, "eval_duration": end - first}


class _Lines:
    """One request's shapes (router/api/http_stream.py ResponseShapes)."""

    media_type = NDJSON

    def __init__(self, name: str, generation: TimedGeneration, token_bytes: TokenBytes | None = None,
                 top_logprobs: int | None = None):
        self.name = name
        self.generation = generation
        self.token_bytes = token_bytes
        self.top_n = top_logprobs  # None: no logprobs asked for
        self.finish: str | None = None

    def _head(self, done: bool) -> dict:
        return {"model": self.name, "created_at": created_at()}

    def _text(self, content: str, reasoning: str, calls: list | None) -> dict:
        raise NotImplementedError

    # ResponseShapes
    def stream_piece(self, piece: Piece, first: bool) -> list[bytes]:
        calls = self._calls() if piece.finish_reason else None
        self.finish = piece.finish_reason or self.finish
        if not (piece.text or piece.reasoning or calls or piece.logprobs):
            return []
        return [line({**self._head(False), **self._text(piece.text, piece.reasoning, calls), "done": False,
                      **self._logprobs(piece.logprobs)})]

    def stream_end(self, generation) -> list[bytes]:
        return [line(self._last(self._text("", "", None)))]

    def full(self, pieces: list[Piece], generation) -> dict:
        self.finish = pieces[-1].finish_reason if pieces else None
        content = "".join(p.text for p in pieces) + (self.generation.output.unparsed
                                                      if self.generation.output is not None else "")
        text = self._text(content, "".join(p.reasoning for p in pieces), self._calls())
        return {**self._last(text), **self._logprobs([lp for p in pieces for lp in p.logprobs])}

    def error_body(self, error: ApiError) -> dict:
        return {"error": error.message}

    def stream_error(self, error: ApiError) -> bytes:
        return line({"error": error.message})

    # parts
    def _last(self, text: dict) -> dict:
        return {**self._head(True), **text, "done": True, "done_reason": DONE_REASONS.get(self.finish, "stop"),
                **self.generation.durations()}

    def _calls(self) -> list[dict]:
        out = []
        for call in self.generation.calls:
            if not call.complete:  # cut short by the answer's end: no arguments to give
                log.info("tool call %s to %s cut short (%s): not returned", call.id, call.name, self.finish)
                continue
            out.append({"id": call.id, "function": {"index": len(out), "name": call.name,
                                                    "arguments": arguments_object(call.arguments)}})
        return out

    def _logprobs(self, logprobs: list) -> dict:
        if self.top_n is None:
            return {}
        return {"logprobs": [{**self._entry(lp.token, lp.logprob),
                              "top_logprobs": [self._entry(t, v) for t, v in lp.top[: self.top_n]]}
                             for lp in logprobs]}

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.token_bytes.text(token), "logprob": logprob if math.isfinite(logprob) else -9999.0,
                "bytes": list(self.token_bytes(token))}


class ChatLines(_Lines):
    def _text(self, content: str, reasoning: str, calls: list | None) -> dict:
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["thinking"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return {"message": message}


class GenerateLines(_Lines):
    def _text(self, content: str, reasoning: str, calls: list | None) -> dict:
        return {"response": content, **({"thinking": reasoning} if reasoning else {})}


def load_answer(name: str, endpoint: str, unloaded: bool, arrived_ns: int) -> dict:
    """The answer to a request with no messages (or prompt): the model loaded, or unloaded."""
    text = {"message": {"role": "assistant", "content": ""}} if endpoint == "chat" else {"response": ""}
    return {"model": name, "created_at": created_at(), **text, "done": True,
            "done_reason": "unload" if unloaded else "load",
            **({} if unloaded else {"total_duration": time.monotonic_ns() - arrived_ns})}
