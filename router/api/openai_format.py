"""OpenAI's shapes for /v1/chat/completions and /v1/completions: a whole
response, its stream's chunks, errors (router/api/http_stream.py sends them)."""

from __future__ import annotations

import math
import time

from router.api.errors import ApiError
from router.api.generation import Generation, Piece
from router.api.http_stream import sse
from router.parsed_request import ParsedRequest
from router.text.text_stream import TokenBytes


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI reports impossible tokens as -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0


class _Format:
    """The response shapes of one endpoint, for one request."""

    id_prefix = ""  # of response ids: "chatcmpl-", "cmpl-"
    object = ""  # of full responses
    chunk_suffix = ""  # appended to `object` for stream chunks

    def __init__(self, request_id: str, model: str, parsed: ParsedRequest, token_bytes: TokenBytes):
        self.id = request_id
        self.model = model
        self.created = int(time.time())
        self.want_logprobs = parsed.sampling.logprobs
        self.top_n = parsed.sampling.top_logprobs
        self.include_usage = parsed.include_usage
        self.token_bytes = token_bytes

    def _envelope(self, object_: str, choices: list) -> dict:
        return {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, piece: Piece, first: bool) -> dict:
        out = self._envelope(self.object + self.chunk_suffix, [self._stream_choice(piece, first)])
        if self.include_usage:
            out["usage"] = None  # OpenAI: present on every chunk, set only on the last
        return out

    # ResponseShapes (router/api/http_stream.py)
    def stream_piece(self, piece: Piece, first: bool) -> list[bytes]:
        return [sse(self.chunk(piece, first))]

    def stream_end(self, generation: Generation) -> list[bytes]:
        out = []
        if self.include_usage:
            out.append(sse({**self._envelope(self.object + self.chunk_suffix, []), "usage": generation.usage()}))
        return out + [sse("[DONE]")]

    def full(self, pieces: list[Piece], generation: Generation) -> dict:
        whole = Piece("".join(p.text for p in pieces), [lp for p in pieces for lp in p.logprobs],
                      pieces[-1].finish_reason if pieces else None, "".join(p.reasoning for p in pieces))
        return {**self._envelope(self.object, [self._final_choice(whole, generation)]), "usage": generation.usage()}

    def error_body(self, error: ApiError) -> dict:
        return error.body()

    def stream_error(self, error: ApiError) -> bytes:
        return sse(error.body())

    def _stream_choice(self, piece: Piece, first: bool) -> dict:
        raise NotImplementedError

    def _final_choice(self, piece: Piece, generation: Generation) -> dict:
        raise NotImplementedError


class ChatFormat(_Format):
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_suffix = ".chunk"

    def _stream_choice(self, piece: Piece, first: bool) -> dict:
        delta = {"role": "assistant", "content": piece.text} if first else {"content": piece.text} if piece.text else {}
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        if piece.calls:
            delta["tool_calls"] = [_call_delta(d) for d in piece.calls]
        return {"index": 0, "delta": delta, "logprobs": self._logprobs(piece), "finish_reason": piece.finish_reason}

    def _final_choice(self, piece: Piece, generation: Generation) -> dict:
        calls = generation.calls
        content = piece.text + (generation.output.unparsed if generation.output is not None else "")
        message = {"role": "assistant", "content": content if content or not calls else None}
        if piece.reasoning:
            message["reasoning_content"] = piece.reasoning
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in calls]
        return {"index": 0, "message": message, "logprobs": self._logprobs(piece), "finish_reason": piece.finish_reason}

    def _logprobs(self, piece: Piece) -> dict | None:
        if not self.want_logprobs:
            return None
        return {"content": [self._entry(lp.token, lp.logprob, lp.top[: self.top_n]) for lp in piece.logprobs]}

    def _entry(self, token: int, logprob: float, top: list | None) -> dict:
        entry = {"token": self.token_bytes.text(token), "logprob": _finite(logprob), "bytes": list(self.token_bytes(token))}
        if top is not None:
            entry["top_logprobs"] = [self._entry(t, lp, None) for t, lp in top]
        return entry


def _call_delta(d) -> dict:
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


class CompletionFormat(_Format):
    id_prefix = "cmpl-"
    object = "text_completion"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_offset = 0  # characters of completion text before the next token

    def _stream_choice(self, piece: Piece, first: bool) -> dict:
        return self._final_choice(piece, None)

    def _final_choice(self, piece: Piece, generation: Generation | None) -> dict:
        return {"index": 0, "text": piece.text, "logprobs": self._logprobs(piece), "finish_reason": piece.finish_reason}

    def _logprobs(self, piece: Piece) -> dict | None:
        if not self.want_logprobs:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in piece.logprobs:
            text = self.token_bytes.text(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(_finite(lp.logprob))
            out["top_logprobs"].append({self.token_bytes.text(t): _finite(v) for t, v in lp.top[: self.top_n]})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out
