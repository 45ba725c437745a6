"""A generation sent as one JSON body or as server-sent events, in any
endpoint's shapes (a `ResponseShapes`: OpenAI chat and completions,
Anthropic messages, OpenAI responses).

Cancellation: the client going away must cancel its request in the workers, also while
the engine is silent (a long prefill sends nothing for seconds). So every generation runs
as a task next to a watcher of the ASGI `receive` channel; on `http.disconnect` the task
is cancelled, which closes the engine's generator, which cancels the request. A client
that stops reading takes the same path: every write here waits on the connection's flow
control, and the HTTP protocol closes a connection whose full write buffer the client has
not drained within --client-timeout (router/guards/slow_clients.py), which `receive`
reports as `http.disconnect`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Coroutine, Protocol

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from router.guards.admission import Ticket
from router.routing.engine_api import EngineError
from router.api.errors import ApiError
from router.api.generation import Generation, Piece

log = logging.getLogger("tandem.router")

# After a disconnect, a request's work gets this long to end (its cleanup tells the
# workers to drop it, milliseconds) before it is cancelled again.
CANCEL_AGAIN_S = 1.0


class ResponseShapes(Protocol):
    """One endpoint's shapes for one request."""

    def full(self, pieces: list[Piece], generation: Generation) -> dict:
        """The whole response's JSON body."""

    def stream_piece(self, piece: Piece, first: bool) -> list[bytes]:
        """SSE events for one piece (the first opens the stream)."""

    def stream_end(self, generation: Generation) -> list[bytes]:
        """SSE events after the last piece."""

    def error_body(self, error: ApiError) -> dict:
        """An error in the endpoint's shape (a response's body, or an SSE event's data)."""

    def stream_error(self, error: ApiError) -> bytes:
        """An error after the stream has started."""


def as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        log.warning("request failed: %s %s", exc.status, exc.message)
        return ApiError.from_engine(exc)
    log.exception("unexpected error while generating")
    return ApiError(500, "Internal server error")


def sse(payload: dict | str, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


class GenerationResponse:
    """Runs the generation while the response is sent, as JSON or as SSE.

    A stream's status is decided by the first engine event: an error before it (queue full,
    no worker) is a plain HTTP error; an error after it is an SSE error event, then the end.
    The request's admission `ticket` is released when the response ends, however it ends.
    """

    def __init__(self, generation: Generation, shapes: ResponseShapes, stream: bool, ticket: Ticket):
        self.generation = generation
        self.shapes = shapes
        self.stream = stream
        self.ticket = ticket

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        respond = self._stream if self.stream else self._complete
        try:
            await run_until_disconnect(receive, respond(scope, receive, send))
        finally:
            self.ticket.release()

    def _error_response(self, exc: Exception) -> Response:
        error = as_api_error(exc)
        return JSONResponse(self.shapes.error_body(error), status_code=error.status, headers=error.headers)

    async def _complete(self, scope: Scope, receive: Receive, send: Send) -> None:
        pieces = []
        try:
            async with aclosing(self.generation.pieces()) as stream:
                async for piece in stream:
                    pieces.append(piece)
        except Exception as exc:
            response = self._error_response(exc)
        else:
            response = JSONResponse(self.shapes.full(pieces, self.generation))
        await response(scope, receive, send)

    async def _stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self.generation.pieces()) as pieces:
            try:
                first = await anext(pieces)
            except Exception as exc:
                await self._error_response(exc)(scope, receive, send)
                return
            headers = [
                # SSE, or the endpoint's own (Ollama's NDJSON lines)
                (b"content-type", getattr(self.shapes, "media_type", "text/event-stream; charset=utf-8").encode()),
                (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no"),  # no proxy buffering of the stream
            ]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await self._send(send, self.shapes.stream_piece(first, first=True))
            try:
                async for piece in pieces:
                    await self._send(send, self.shapes.stream_piece(piece, first=False))
            except Exception as exc:
                await self._send(send, [self.shapes.stream_error(as_api_error(exc))])
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        await self._send(send, self.shapes.stream_end(self.generation))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _send(send: Send, events: list[bytes]) -> None:
        if events:
            await send({"type": "http.response.body", "body": b"".join(events), "more_body": True})


async def run_until_disconnect(receive: Receive, work: Coroutine) -> None:
    """Run `work` (which sends the response); cancel it if the client disconnects first.

    The cancel is asyncio's one-shot kind, so the engine's cleanup (telling workers to drop
    the request) may still await.
    """
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            log.info("client disconnected: cancelling its request")
            work_task.cancel()
            # A cancel can be lost (code that swallows it), and uvicorn drops what is
            # sent after a disconnect, so lost work would run to max_tokens unseen.
            # Cancel again while it runs, each time after its cleanup had time to end.
            while not (await asyncio.wait({work_task}, timeout=CANCEL_AGAIN_S))[0]:
                log.warning("request still running %.1f s after its cancel: cancelling again", CANCEL_AGAIN_S)
                work_task.cancel()
        await asyncio.gather(work_task, watcher, return_exceptions=True)
    if not work_task.cancelled():
        exc = work_task.exception()
        if exc is not None and not isinstance(exc, OSError):  # OSError: the client vanished mid-send
            raise exc


async def _wait_for_disconnect(receive: Receive) -> None:
    # The body was read already, so the next message is the disconnect (uvicorn also
    # sends one once the response is complete, by which time the work is done).
    while (await receive())["type"] != "http.disconnect":
        pass
