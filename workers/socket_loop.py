"""A worker's I/O thread: the only thread that touches the socket to the router.

MLX work lives on the worker's main thread (Metal crashes when two threads
drive it), so this thread only moves messages: router -> `inbox` (a
queue.Queue the MLX thread reads), and the MLX thread's `Outbox` -> router.
It also sends the heartbeat, so a worker deep in a long prefill chunk still
reports itself alive.
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

    def __init__(self, ctx: zmq.Context, router_addr: str, hello: WorkerHello, interval_s: float):
        super().__init__(name="socket-loop", daemon=True)
        self.ctx = ctx
        self.router_addr = router_addr
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
        dealer = transport.make_socket(self.ctx, zmq.DEALER, identity=self.hello.worker_id)
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
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_beat:
                transport.send(dealer, replace(self.hello))
                next_beat = now + self.interval_s
            events = dict(poller.poll(timeout=max(1, int((next_beat - now) * 1000))))
            if dealer in events:
                while True:
                    try:
                        msg = transport.recv(dealer, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if msg is not None:
                        self.inbox.put(msg)
            if self._pull in events:
                while True:
                    try:
                        frames = self._pull.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    dealer.send_multipart(frames, copy=False)
