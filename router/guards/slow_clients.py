"""Deadlines for slow clients: a client has `--client-timeout` seconds to send
its request headers, as long again for its body, and as long to take each
part of its answer.

uvicorn bounds only the idle time between requests (keep-alive, which any
byte cancels): a client sending one header byte a second, or its headers and
then a trickle of body, would hold a connection and a task for ever
(slowloris). Two pieces bound it:

- `ClientDeadlineProtocol`, uvicorn's h11 protocol with a timer: from the
  connection's start, or from the first byte of the next request on a kept-alive
  connection, the headers must be complete within the deadline, or the client
  gets a bare 408 and the connection closes (no path yet, so no API shape).
  Once the headers are in, the body gets the deadline plus BODY_GRACE_S: a
  backstop for a body the app never reads.
- `BodyDeadline`, an ASGI wrapper: the app's reads of the body must end within
  the deadline from the headers; past it the client gets a 408 in the API's
  shape (router/api/errors.py) and the connection closes, and the app reads a
  disconnect.

Neither times a response as a whole (a stream may run as long as tokens
come), but the protocol times the client's reading of it: uvicorn waits on
the connection's flow control before every write with no deadline, so a
client that stops reading held its admission place, its decode row and its
KV for as long as it kept the socket open. When the write buffer passes its
high-water mark (uvicorn pauses the app's writes) the client has the
deadline to drain it below the low-water mark; if it does not, the
connection is aborted (its buffered bytes dropped). uvicorn then tells the
app the client is gone, and router/api/http_stream.py `run_until_disconnect`
cancels the request as for any disconnect. Counted in `WriteTimeouts.total`
(/metrics: tandem_client_write_timeouts_total). This bounds every write:
streamed events, whole JSON answers, errors, and bytes left buffered on a
kept-alive connection after its answer ended. A reader needs ~48 KiB per
deadline (64 KiB high, 16 KiB low water: asyncio's defaults), far below any
real network.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from router.api.errors import ApiError, is_anthropic_path

log = logging.getLogger("tandem.router")

BODY_GRACE_S = 2.0  # the protocol's backstop fires this long after BodyDeadline's 408
_HEADERS_LATE = b"Request headers not sent in time\n"
REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(_HEADERS_LATE), _HEADERS_LATE))


class WriteTimeouts:
    """Connections aborted because their client stopped taking the answer, since
    the process started (one router per process; read by router/metrics.py)."""

    total = 0


def client_deadline_protocol(timeout_s: float) -> type[H11Protocol]:
    """The protocol class uvicorn's Config takes as `http`, for this deadline."""
    return type("ClientDeadlineProtocol", (ClientDeadlineProtocol,), {"timeout_s": float(timeout_s)})


class ClientDeadlineProtocol(H11Protocol):
    timeout_s: float = 30.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._phase: str | None = None  # "headers", "body" or None (nothing owed)
        self._timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None  # armed while writes are paused
        no_delay(transport)
        super().connection_made(transport)
        self._set_phase("headers")

    def handle_events(self) -> None:
        # Called after every read and after each response (pipelined requests).
        super().handle_events()
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        self._stop_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        # The client stopped taking bytes: it has the deadline to take them.
        super().pause_writing()
        if self._write_timer is None:  # also when closing: close() would wait for the buffer to drain
            self._write_timer = self.loop.call_later(self.timeout_s, self._write_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_write_timer()

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_expired(self) -> None:
        self._write_timer = None
        WriteTimeouts.total += 1
        log.info("closing a connection from %s: its client left %d bytes of its answer unread for %gs",
                 _peer(self.client), self.transport.get_write_buffer_size(), self.timeout_s)
        self.transport.abort()  # connection_lost follows: the app reads a disconnect, the request is cancelled

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if state is h11.IDLE and (self._phase == "headers" or self.conn.trailing_data[0]):
            self._set_phase("headers")  # a new connection, or a next request begun
        elif state is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)  # sent in full (or closed, or broken: h11 answered it)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        if phase is not None and not self.transport.is_closing():
            delay = self.timeout_s + (BODY_GRACE_S if phase == "body" else 0.0)
            self._timer = self.loop.call_later(delay, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        log.info("closing a connection from %s: request %s not sent within %.0fs", _peer(self.client),
                 self._phase, self.timeout_s)
        if self._phase == "headers":
            self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def no_delay(transport) -> None:
    """TCP_NODELAY on a client's connection. asyncio sets it only where the
    listening socket says IPPROTO_TCP, and the supervisor's (made with
    protocol 0, then handed over pickled) does not: a response's body then
    waited for the client's delayed ACK of its headers, ~40 ms on every
    small answer (measured on the H200: GET /health 44 ms)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"


class BodyDeadline:
    """ASGI: the body read within `timeout_s` of the headers, or a 408 in the API's shape."""

    def __init__(self, app: ASGIApp, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = _TimedRequest(scope, receive, send, self.timeout_s)
        try:
            await self.app(scope, request.receive, request.send)
        except Exception:
            if not request.timed_out:
                raise
            # The app failed on the disconnect it read; the client had its 408.


class _TimedRequest:
    def __init__(self, scope: Scope, receive: Receive, send: Send, timeout_s: float):
        self.scope, self._receive, self._send = scope, receive, send
        self.timeout_s = timeout_s
        self.deadline = asyncio.get_running_loop().time() + timeout_s
        self.body_done = False
        self.started = False  # the app's response began
        self.timed_out = False

    async def receive(self) -> Message:
        if self.timed_out:
            return {"type": "http.disconnect"}
        if self.body_done:  # later reads wait for a disconnect: not timed
            return await self._receive()
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self._receive()
        except TimeoutError:
            await self._time_out()
            return {"type": "http.disconnect"}
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.body_done = True
        return message

    async def send(self, message: Message) -> None:
        if self.timed_out:
            return  # the 408 went out in its place
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def _time_out(self) -> None:
        self.timed_out = True
        if self.started:
            return
        log.info("408 to %s: request body not sent within %.0fs", _peer(self.scope.get("client")), self.timeout_s)
        error = ApiError(408, f"Request body not received within {self.timeout_s:g} seconds",
                         code="request_timeout", headers={"Connection": "close"})
        await error.response(is_anthropic_path(self.scope["path"]))(self.scope, self._receive, self._send)
