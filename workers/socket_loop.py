"""A worker's I/O thread: the only thread that touches the socket to the router.

MLX work lives on the worker's main thread (Metal crashes when two threads
drive it), so this thread only moves messages: router -> `inbox` (a
queue.Queue the MLX thread reads), and the MLX thread's `Outbox` -> router.
It also sends the heartbeat, so a worker deep in a long prefill chunk still
reports itself alive.

A worker on another host (deploy/worker_cmd.py) connects over tcp with CURVE
keys. ZeroMQ retries the connection by itself, silently, whether the router
is unreachable or refuses the keys: until the router first answers, the loop
logs an error every while (JOIN_LOG_MAX_S at most) naming the address.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import replace

import zmq

from protos import transport
from protos.messages import WorkerHello

log = logging.getLogger(__name__)

_OUTBOX_ADDR = "inproc://outbox"
JOIN_LOG_MAX_S = 300.0  # the longest gap between two "cannot join" errors


class Outbox:
    """Hands messages to the I/O thread, in the order they are sent.

    A PUSH over inproc wakes the I/O thread's poller at once, so a decoded token
    waits for no polling interval before it leaves the process. The MLX thread
    sends most; a prefill worker's store thread (workers/kv/store_thread.py)
    sends handoffs. One socket behind a lock, not one per thread, so that a
    handoff never overtakes the PrefillDone sent before it.
    """

    def __init__(self, ctx: zmq.Context):
        self._sock = transport.make_socket(ctx, zmq.PUSH)
        self._sock.connect(_OUTBOX_ADDR)
        self._lock = threading.Lock()

    def send(self, msg, wait_s: float | None = None) -> None:
        """Queue `msg` for the router. With `wait_s`, give up after that long
        (TimeoutError) instead of blocking: a PUSH whose I/O thread has
        stopped blocks for ever, and a thread other than the MLX thread must
        not hold the lock then (the MLX thread's close would wait on it)."""
        if wait_s is None:
            with self._lock:
                transport.send(self._sock, msg)
            return
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                try:
                    transport.send(self._sock, msg, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{type(msg).__name__} not sent within {wait_s} s: the socket loop has stopped")
            time.sleep(0.005)

    def close(self) -> None:
        with self._lock:
            self._sock.close()


class SocketLoop(threading.Thread):
    """Connects to the router, forwards traffic both ways, sends heartbeats."""

    def __init__(self, ctx: zmq.Context, router_addr: str, hello: WorkerHello, interval_s: float,
                 curve: tuple[bytes, bytes, bytes] | None = None, join_timeout_s: float = 10.0):
        super().__init__(name="socket-loop", daemon=True)
        self.ctx = ctx
        self.router_addr = router_addr
        self.curve = curve  # (our public, our secret, the router's public key): a remote worker's
        self.join_timeout_s = join_timeout_s
        self.joined = curve is None  # the router answered (a WorkerLimits to our first hellos)
        self.hello = hello  # the MLX thread updates its load fields in place
        self.interval_s = interval_s
        self.inbox: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        # What ended the loop when it was not asked to stop (None: it was asked,
        # or runs). The process then stops and exits non-zero (workers/main.py),
        # so the supervisor restarts it: a worker that is alive but deaf
        # would hold its requests for ever.
        self.error: BaseException | None = None
        # Bind before the MLX thread connects its Outbox (inproc needs bind first).
        self._pull = transport.make_socket(ctx, zmq.PULL)
        self._pull.bind(_OUTBOX_ADDR)

    def run(self) -> None:
        # Over tcp the router names us by our hellos and lets ZeroMQ pick the
        # routing id (router/routing/worker_socket.py): a reconnect never collides with
        # our old connection's.
        identity = self.hello.worker_id if self.curve is None else None
        dealer = transport.make_socket(self.ctx, zmq.DEALER, identity=identity)
        if self.curve is not None:
            transport.curve_client(dealer, *self.curve)
        dealer.connect(self.router_addr)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        try:
            self._forward(dealer, poller)
        except BaseException as exc:  # noqa: BLE001 - whatever it was, the worker must not live on deaf
            self.error = exc
            log.exception("the socket loop failed: the worker stops")
            self.inbox.put(None)  # the MLX thread's stop signal
        finally:
            # One last heartbeat saying we are stopping lets the router fail
            # our requests at once instead of waiting for the timeout.
            try:
                self.hello.state = "stopping"
                transport.send(dealer, replace(self.hello), flags=zmq.NOBLOCK)
            except Exception:  # noqa: BLE001 - a farewell at best: the close below must happen
                pass
            dealer.close()
            self._pull.close()

    def _forward(self, dealer: zmq.Socket, poller: zmq.Poller) -> None:
        """Until asked to stop: heartbeats out, router -> inbox, outbox -> router.
        A message that fails to decode is dropped (transport.recv logs it)."""
        next_beat = 0.0
        started = time.monotonic()
        join_wait, next_join_log = self.join_timeout_s, started + self.join_timeout_s
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                try:  # a router away long enough fills the queue: then beats are dropped, never waited on
                    transport.send(dealer, replace(self.hello), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                next_beat = now + self.interval_s
            if not self.joined and now >= next_join_log:
                log.error("no answer from the router at %s for %.0f s: is it reachable there, and are the keys "
                          "right (its public key in our folder, ours in its --worker-keys)? Still trying",
                          self.router_addr, now - started)
                join_wait = min(join_wait * 2, JOIN_LOG_MAX_S)
                next_join_log = now + join_wait
            events = dict(poller.poll(timeout=max(1, int((next_beat - now) * 1000))))
            if dealer in events:
                while True:
                    try:
                        msg = transport.recv(dealer, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if msg is not None:
                        self._on_joined()
                        self.inbox.put(msg)
            if self._pull in events:
                while True:
                    try:
                        frames = self._pull.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    dealer.send_multipart(frames, copy=False)

    def _on_joined(self) -> None:
        if not self.joined:
            self.joined = True
            log.info("joined the router at %s", self.router_addr)
