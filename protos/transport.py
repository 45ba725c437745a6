"""The one socket helper: ZeroMQ sockets with sane defaults and codec-aware I/O.

Addresses are `ipc://` paths inside the run directory that `tandem serve`
creates, so several servers on one machine never collide.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import zmq

from protos.codec import ProtocolError, decode, encode

log = logging.getLogger(__name__)

_REJECTS_LOGGED = 10  # per window: a flood of bad frames must not fill the disk
_REJECT_WINDOW_S = 60.0


def ipc_address(run_dir: str, name: str) -> str:
    if not run_dir:  # else the socket lands in the working directory, reachable by whoever can read it
        raise ValueError("no run folder: the supervisor (deploy/run_dir.py) makes one per server")
    return f"ipc://{os.path.join(run_dir, name)}.sock"


def make_socket(ctx: zmq.Context, kind: int, *, identity: Optional[str] = None) -> zmq.Socket:
    """A socket that never blocks close (linger 0) and never queues forever."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    if kind == zmq.ROUTER:
        # A message to a peer that is gone fails loudly instead of vanishing.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def send(sock: zmq.Socket, msg: Any, *, to: Optional[bytes] = None, flags: int = 0) -> None:
    frames = encode(msg)
    if to is not None:
        frames = [to, *frames]
    sock.send_multipart(frames, copy=False, flags=flags)


def recv(sock: zmq.Socket, *, routed: bool = False, flags: int = 0):
    """Receive one message. With `routed`, returns (peer identity, message).

    Returns None (routed: (peer, None)) for a message that fails to decode; the
    error is logged (at most _REJECTS_LOGGED a minute), never raised, so a bad
    peer cannot crash the receiver. Only socket errors (zmq.ZMQError) raise.
    """
    return _unwrap(sock.recv_multipart(copy=False, flags=flags), routed)


class RejectLog:
    """Logs rejected messages, `limit` per `window_s` at most; the rest are
    counted, and the count is logged when the next window opens."""

    def __init__(self, limit: int = _REJECTS_LOGGED, window_s: float = _REJECT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self.total = 0  # every rejected message since start
        self._lock = threading.Lock()  # the router's loop and a worker's threads may share it
        self._window_end = float("-inf")
        self._logged = self._unlogged = 0

    def __call__(self, peer: Optional[bytes], why: Exception) -> None:
        with self._lock:
            self.total += 1
            now = self.clock()
            if now >= self._window_end:
                if self._unlogged:
                    log.error("%d more rejected messages were not logged", self._unlogged)
                self._window_end, self._logged, self._unlogged = now + self.window_s, 0, 0
            if self._logged >= self.limit:
                self._unlogged += 1
                return
            self._logged += 1
        who = f" from {peer[:64]!r}" if peer else ""
        if isinstance(why, ProtocolError):
            log.error("rejected message%s: %s", who, why)
        else:  # the codec promises ProtocolError: this is a bug in it, and still no reason to die
            log.error("rejected message%s: %s: %s", who, type(why).__name__, why)


rejects = RejectLog()


def _unwrap(frames: Any, routed: bool):
    """(peer, message) or message; None for the message whatever is wrong
    with the frames: this never raises."""
    peer = None
    try:
        if routed:
            if not frames:
                raise ProtocolError("no identity frame")
            peer = frames[0].bytes if hasattr(frames[0], "bytes") else frames[0]
            if not isinstance(peer, bytes):
                peer = None
                raise ProtocolError("the identity frame is not bytes")
            frames = frames[1:]
        msg = decode(frames)
    except Exception as exc:  # noqa: BLE001 - see RejectLog
        rejects(peer, exc)
        msg = None
    return (peer, msg) if routed else msg


async def asend(sock, msg: Any, *, to: Optional[bytes] = None) -> None:
    """`send` for a zmq.asyncio socket."""
    frames = encode(msg)
    if to is not None:
        frames = [to, *frames]
    await sock.send_multipart(frames, copy=False)


async def arecv(sock, *, routed: bool = False):
    """`recv` for a zmq.asyncio socket (same contract: None for a bad message)."""
    return _unwrap(await sock.recv_multipart(copy=False), routed)
