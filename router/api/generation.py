"""One request's run through the engine: token events in, `Piece`s of text
out (content, reasoning, tool-call deltas), with its usage counts. Every
endpoint's shapes (router/api/openai_format.py, router/api/anthropic_format.py,
router/api/responses_format.py) are built from these pieces."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

from protos.messages import TokenLogprob
from router.api.answer_tokens import AnswerTokens
from router.api.chat_output import ChatOutput, Split, ToolCall, ToolCallDelta
from router.routing.engine_api import Engine, EngineError, GenerationRequest
from router.text.text_stream import TextStream


@dataclass
class Piece:
    """Text ready to send, with the logprobs of the tokens consumed since the last piece."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class Generation:
    """One request's run through the engine, with its usage counts. With
    `output` (a chat's ChatOutput) the text is split into content,
    reasoning and tool calls; a finish by end of sequence after a call is
    "tool_calls"."""

    def __init__(self, engine: Engine, request: GenerationRequest, text: TextStream, timeout_s: float,
                 answers: AnswerTokens | None = None, output: ChatOutput | None = None):
        self.engine = engine
        self.request = request
        self.text = text
        self.timeout_s = timeout_s
        self.output = output
        self.eos = set(request.sampling.stop_token_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        # With `answers`: the answer's tokens and text, remembered when it ends
        # whole (not cut by a stop string) for the conversation's next turn.
        self.answers = answers
        self._tokens: list[int] = []
        self._texts: list[str] = []

    @property
    def calls(self) -> list[ToolCall]:
        return self.output.calls if self.output is not None else []

    async def pieces(self) -> AsyncIterator[Piece]:
        """Yield pieces until one has a finish_reason. Raises EngineError. Returning early
        (stop string) or being closed closes the engine's generator: the request is cancelled."""
        async with aclosing(self._texts_of_events()) as texts:
            async for piece in self._split(texts):
                yield piece

    async def _split(self, texts) -> AsyncIterator[Piece]:
        async for text, logprobs, finish in texts:
            split = Split(content=text)
            if self.output is not None:
                split = self.output.add(text)
                if finish:
                    split.extend(self.output.finish())
                    if self.output.made_calls:
                        if finish == "stop":
                            finish = "tool_calls"
                        if self.answers is not None and not self.text.stopped:
                            # Whole calls only (made_calls: none was cut short), never partial JSON.
                            self.answers.remember_calls([(c.id, c.name, json.loads(c.arguments))
                                                         for c in self.output.calls if c.complete],
                                                        "".join(self._texts))
            if split or finish or logprobs:
                yield Piece(split.content, logprobs, finish, split.reasoning, split.calls)
            if finish:
                return

    async def _texts_of_events(self) -> AsyncIterator[tuple[str, list, str | None]]:
        events = self.engine.generate(self.request)
        pending: list[TokenLogprob] = []  # logprobs of tokens whose text is still held back
        try:
            while True:
                try:
                    # A deadline on progress, not on the whole answer: a long
                    # generation that keeps producing tokens is never cut.
                    async with asyncio.timeout(self.timeout_s):
                        event = await anext(events)
                except StopAsyncIteration:
                    raise EngineError(502, "The engine ended the request without a finish reason")
                except (TimeoutError, EngineError) as exc:
                    stalled = isinstance(exc, TimeoutError) or exc.status == 504
                    if stalled and self.completion_tokens:
                        # What it has is the client's: ended by the server's limit, as by max_tokens.
                        yield self.text.flush(), pending, "length"
                        return
                    if isinstance(exc, EngineError):
                        raise
                    raise EngineError(504, f"Request made no progress for {self.timeout_s:g} s", code="timeout")
                self.completion_tokens += 1  # EOS included, as it was generated
                self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
                if event.token in self.eos:  # ends the text; not part of it
                    text, finish = self.text.flush(), "stop"
                else:
                    if self.answers is not None:
                        self._tokens.append(event.token)
                    if event.logprob is not None:
                        pending.append(event.logprob)
                    text, finish = self.text.add(event.token), event.finish_reason
                    if self.text.stopped:
                        finish = "stop"
                    elif finish:
                        text += self.text.flush()
                if self.answers is not None:
                    self._texts.append(text)
                    if finish and not self.text.stopped:
                        self.answers.remember("".join(self._texts), self._tokens)
                if text or finish:
                    yield text, pending, finish
                    pending = []
                if finish:
                    return
        finally:
            await events.aclose()

    def usage(self) -> dict:
        prompt = len(self.request.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
