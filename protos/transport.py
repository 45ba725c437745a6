"""The one socket helper: ZeroMQ sockets with sane defaults and codec-aware I/O.

Addresses are `ipc://` paths inside the run directory that `tandem serve`
creates, so several servers on one machine never collide.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import zmq

from protos.codec import ProtocolError, decode, encode

log = logging.getLogger(__name__)


def ipc_address(run_dir: str, name: str) -> str:
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
    error is logged, never raised, so a bad peer cannot crash the receiver.
    """
    return _unwrap(sock.recv_multipart(copy=False, flags=flags), routed)


def _unwrap(frames: list, routed: bool):
    peer = None
    if routed:
        peer, frames = frames[0].bytes, frames[1:]
    try:
        msg = decode(frames)
    except ProtocolError as exc:
        log.error("rejected message%s: %s", f" from {peer!r}" if peer else "", exc)
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
