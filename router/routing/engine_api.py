"""The contract between the HTTP layer (router.app) and the engine that talks to workers.

The HTTP layer turns an OpenAI request into a `GenerationRequest` (tokens and sampling
parameters), iterates `Engine.generate` for token events, and turns those back into
text. It knows nothing about workers, sockets or routing: that is the engine's job
(router.routing.dispatcher).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from protos.messages import SamplingParams, TokenLogprob


@dataclass
class GenerationRequest:
    request_id: str
    prompt_tokens: list[int]
    # max_tokens, stop_token_ids (EOS ids), logprobs / top_logprobs, seed, penalties...
    sampling: SamplingParams
    images: list = field(default_factory=list)  # protos.messages.ImageInput, prompt order
    cache_salt: str = ""  # the caller's cache tenant (router/guards/cache_salt.py); "": shared


@dataclass
class EngineEvent:
    """One generated token."""

    token: int
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length" | None
    cached_tokens: int = 0  # prompt tokens served from cache (reported in usage)


class EngineError(Exception):
    """A request the engine could not serve.

    status: 429 (queue full; set retry_after), 503 (no worker alive), 500/502 (a worker
    failed mid-request), 504 (timed out). The HTTP layer turns it into an error response,
    or into an SSE error event when the stream has already started.
    """

    def __init__(
        self,
        status: int,
        message: str,
        retry_after: float | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.code = code


class Engine(Protocol):
    model_id: str  # the id clients see in /v1/models
    max_context: int  # prompt + completion tokens the model accepts

    def health(self) -> tuple[bool, dict]:
        """(all workers ready?, JSON body: {"model": ..., "workers": [{"role", "pid", "state", ...}]})"""
        ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[EngineEvent]:
        """Async generator of token events; the last one carries a finish_reason.

        Raises EngineError. When the consumer stops early (aclose() or its task is
        cancelled, e.g. a stop string matched or the client went away), the engine
        cancels the request in the workers. Its cleanup runs inside a one-shot
        asyncio cancellation, so it may await.
        """
        ...

    async def embed(self, inputs: list[list[int]], dimensions: int, deadline: float):
        """An embedding model's: (vectors, float32 [len(inputs), d], tokens embedded)
        by `deadline` (time.monotonic()). Raises EngineError (400 for bad input,
        503 with no worker ready, 504 past the deadline)."""
        ...

    async def metrics_text(self) -> str:
        """Prometheus exposition text; may be ""."""
        ...
