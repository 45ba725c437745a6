"""The one socket helper: ZeroMQ sockets with sane defaults and codec-aware I/O.

Addresses are `ipc://` paths inside the run directory that `tandem serve`
creates, so several servers on one machine never collide. A worker on another
host reaches the router over `tcp://`, CURVE-encrypted (`curve_server`,
`curve_client`), with keys in ZeroMQ's certificate files that `tandem keys`
writes (`router_keys`, `worker_keys` read them).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import zmq
from zmq.auth.certs import load_certificate

from protos.codec import ProtocolError, decode, encode

log = logging.getLogger(__name__)

_REJECTS_LOGGED = 10  # per window: a flood of bad frames must not fill the disk
_REJECT_WINDOW_S = 60.0


def ipc_address(run_dir: str, name: str) -> str:
    if not run_dir:  # else the socket lands in the working directory, reachable by whoever can read it
        raise ValueError("no run folder: the supervisor (deploy/run_dir.py) makes one per server")
    return f"ipc://{os.path.join(run_dir, name)}.sock"


ROUTER_KEY = "server"  # the router's pair: server.key (public), server.key_secret
# tcp only: ZMTP pings drop a connection whose peer vanished (a host off the
# network sends no FIN), and reconnects back off to RECONNECT_MAX_MS.
PING_MS, PING_TIMEOUT_MS, RECONNECT_MAX_MS = 2000, 10_000, 5000


class KeysError(ValueError):
    """A keys folder that cannot be used; the message says what is wrong."""


def _pair(path: str) -> tuple[bytes, bytes]:
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"{path}: {exc}") from None
    if not secret:
        raise KeysError(f"{path} holds no secret key")
    return public, secret


def router_keys(folder: str) -> tuple[bytes, bytes, dict[bytes, str]]:
    """The router's side of a keys folder: (its public key, its secret key,
    {each allowed worker's public key (Z85): the file's name}). Workers'
    keys are the `*.key` files other than the router's own."""
    public, secret = _pair(os.path.join(folder, f"{ROUTER_KEY}.key_secret"))
    allowed = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".key") and name != f"{ROUTER_KEY}.key":
            try:
                allowed[load_certificate(os.path.join(folder, name))[0]] = name[:-len(".key")]
            except (OSError, ValueError) as exc:
                raise KeysError(f"{os.path.join(folder, name)}: {exc}") from None
    if not allowed:
        raise KeysError(f"{folder} holds no worker public key (NAME.key): no worker could join")
    return public, secret, allowed


def worker_keys(folder: str) -> tuple[bytes, bytes, bytes]:
    """A worker's side of a keys folder: (its public key, its secret key, the
    router's public key): its one `NAME.key_secret` and the router's `server.key`."""
    try:
        secrets = sorted(n for n in os.listdir(folder) if n.endswith(".key_secret"))
    except OSError as exc:
        raise KeysError(f"{folder}: {exc}") from None
    if secrets == [f"{ROUTER_KEY}.key_secret"]:
        raise KeysError(f"{folder} is the router's folder (its secret key): give the worker's own folder")
    if len(secrets) != 1:
        raise KeysError(f"{folder} must hold exactly one NAME.key_secret (the worker's own pair); found "
                        f"{', '.join(secrets) or 'none'}")
    public, secret = _pair(os.path.join(folder, secrets[0]))
    router = os.path.join(folder, f"{ROUTER_KEY}.key")
    try:
        return public, secret, load_certificate(router)[0]
    except (OSError, ValueError) as exc:
        raise KeysError(f"{router} (the router's public key): {exc}") from None


def _tcp_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, PING_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PING_TIMEOUT_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)


def curve_server(sock: zmq.Socket, public: bytes, secret: bytes, zap_domain: str) -> None:
    """Make the endpoints `sock` binds from now on CURVE servers whose
    clients a ZAP handler of `zap_domain` checks. ZeroMQ copies a socket's
    options into each endpoint when it binds, so one bound before (the ipc
    socket of this host's workers) stays as it was."""
    _tcp_options(sock)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain.encode())


def curve_client(sock: zmq.Socket, public: bytes, secret: bytes, server_public: bytes) -> None:
    """Make `sock`'s next connections CURVE clients with this pair, trusting
    only a server whose public key is `server_public`."""
    _tcp_options(sock)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)


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


async def arecv_with_user(sock):
    """A routed `arecv` that also returns the sender's ZAP user id: "" for a
    peer that no ZAP handler checked (ipc), the handler's name for the key
    of a CURVE peer. (peer, user, message); message None as in `recv`."""
    frames = await sock.recv_multipart(copy=False)
    user = ""
    if len(frames) > 1:
        try:
            user = frames[1].get("User-Id") or ""
        except zmq.ZMQError:  # no such property: not authenticated
            user = ""
    peer, msg = _unwrap(frames, True)
    return peer, user, msg
