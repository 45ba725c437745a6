"""The cache service process: owns the arena, answers alloc/free/stats.

Started by the supervisor with multiprocessing's spawn context:
`ctx.Process(target=run, args=(settings,))`. It binds a ROUTER at
ipc_address(run_dir, "cache"); clients connect DEALERs. One thread, one
socket, no blocking call without a timeout: the loop wakes at least every
`_TICK_S` to expire reservations and notice SIGTERM/SIGINT.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Optional

import zmq

from cache_service.allocator import Allocator
from cache_service.arena import Arena, new_arena_name
from deploy.settings import Settings
from protos.messages import CacheAlloc, CacheAllocReply, CacheFree, CacheReply, CacheStats
from protos.transport import ipc_address, make_socket, recv, send

log = logging.getLogger("tandem.cache_service")

_TICK_S = 0.25  # longest sleep between expiry checks and stop-flag checks
_BURST = 1000  # most messages served between two expiry passes


class CacheService:
    """The request handlers, apart from the socket loop (so tests can call them)."""

    def __init__(self, arena: Arena, capacity: int):
        self.arena = arena
        self.allocator = Allocator(min(capacity, arena.size))

    def handle(self, msg: Any) -> Optional[Any]:
        """One request -> its reply; None for a message that is not a request."""
        if isinstance(msg, CacheAlloc):
            return self._alloc(msg)
        if isinstance(msg, CacheFree):
            return self._free(msg)
        if isinstance(msg, CacheStats):
            return CacheReply(call_id=msg.call_id, ok=True, stats=self.stats())
        return None

    def stats(self) -> dict:
        # pid: lets a health check tell a restarted service from the old one.
        return {**self.allocator.stats(), "pid": os.getpid()}

    def _alloc(self, msg: CacheAlloc) -> CacheAllocReply:
        fail = lambda error: CacheAllocReply(call_id=msg.call_id, ok=False, arena=self.arena.name, error=error)
        try:
            alloc = self.allocator.alloc(msg.nbytes, msg.owner, msg.ttl_s)
        except ValueError as exc:
            return fail(f"invalid CacheAlloc: {exc}")
        if alloc is None:
            st = self.allocator.stats()
            if msg.nbytes > st["arena_bytes"]:
                return fail(f"cannot fit {msg.nbytes} bytes: larger than the whole cache arena "
                            f"({st['arena_bytes']} bytes)")
            return fail(f"cache arena full: cannot fit {msg.nbytes} bytes (arena {st['arena_bytes']}, "
                        f"free {st['free_bytes']}, largest free range {st['largest_free']})")
        return CacheAllocReply(call_id=msg.call_id, ok=True, allocation=alloc.id, offset=alloc.offset,
                               nbytes=alloc.nbytes, arena=self.arena.name)

    def _free(self, msg: CacheFree) -> CacheReply:
        if msg.arena and msg.arena != self.arena.name:
            # Ids restart with the service: freeing them here would hit someone else.
            return CacheReply(call_id=msg.call_id, ok=False,
                              error=f"stale arena {msg.arena!r}: the service now serves {self.arena.name!r}")
        if any(not isinstance(i, int) or isinstance(i, bool) for i in msg.allocations):
            return CacheReply(call_id=msg.call_id, ok=False, error="CacheFree.allocations must be integers")
        if not msg.allocations and not msg.owner:
            return CacheReply(call_id=msg.call_id, ok=False, error="CacheFree names no allocations and no owner")
        freed = unknown = 0
        for alloc_id in msg.allocations:
            if self.allocator.free(alloc_id) is None:
                unknown += 1  # already freed, or expired: the holder was too slow
            else:
                freed += 1
        if msg.owner:
            freed += len(self.allocator.free_owner(msg.owner))
        return CacheReply(call_id=msg.call_id, ok=True, stats={"freed": freed, "unknown": unknown})

    def expire(self) -> None:
        for alloc in self.allocator.expire():
            log.warning("reservation %d of %r (%d bytes) expired unfreed", alloc.id, alloc.owner, alloc.nbytes)

    def wait_s(self) -> float:
        """How long the loop may sleep: until the next deadline, at most a tick."""
        deadline = self.allocator.next_deadline()
        if deadline is None:
            return _TICK_S
        return min(_TICK_S, max(0.0, deadline - time.monotonic()))


def _setup_logging(settings: Settings) -> None:
    if not logging.getLogger().handlers:  # a spawned child starts unconfigured
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s cache[%(process)d] %(message)s")


def run(settings: Settings, ready=None) -> None:
    """Process main. `ready` (a multiprocessing Event, optional) is set once
    the socket is bound. Returns (exit 0) after SIGTERM/SIGINT."""
    _setup_logging(settings)
    stop = []
    if threading.current_thread() is threading.main_thread():  # only there can Python take signals
        handler = lambda signum, frame: stop.append(signum)
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    name = settings.arena_name
    if not name:
        name = new_arena_name()
        log.warning("no arena_name set; using %s (nobody else can clean it up after a kill)", name)
    arena = Arena.create(name, settings.cache_memory_bytes)
    ctx = zmq.Context()
    sock = None
    try:
        service = CacheService(arena, settings.cache_memory_bytes)
        os.makedirs(settings.run_dir, exist_ok=True)
        sock = make_socket(ctx, zmq.ROUTER)
        address = ipc_address(settings.run_dir, "cache")
        sock.bind(address)
        log.info("serving arena %s (%d bytes) at %s", arena.name, arena.size, address)
        if ready is not None:
            ready.set()
        _serve(sock, service, stop)
        log.info("stopping on signal %s", stop[0])
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
        arena.close()
        arena.unlink()


def _serve(sock: zmq.Socket, service: CacheService, stop: list) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop:
        service.expire()
        # pyzmq retries the poll after a signal handler ran, so a stop can take
        # up to one wait to be seen; the wait is at most _TICK_S.
        if not poller.poll(service.wait_s() * 1000):
            continue
        # Serve a burst in one go, but bounded so a flood cannot starve expiry.
        for _ in range(_BURST):
            if stop:
                break
            try:
                peer, msg = recv(sock, routed=True, flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:
                raise  # a broken socket is fatal; the supervisor restarts us
            except Exception:  # the codec can still trip on hostile input; never die of it
                log.exception("dropped a message that failed to decode")
                continue
            if msg is None:
                continue  # undecodable; transport.recv logged it
            _answer(sock, service, peer, msg)


def _answer(sock: zmq.Socket, service: CacheService, peer: bytes, msg: Any) -> None:
    try:
        reply = service.handle(msg)
    except Exception:  # a handler bug must cost one call, not the service
        log.exception("handler failed on %s", type(msg).__name__)
        reply_type = CacheAllocReply if isinstance(msg, CacheAlloc) else CacheReply
        reply = reply_type(call_id=getattr(msg, "call_id", -1), ok=False, error="internal error in cache service")
    if reply is None:
        log.error("ignored unexpected message %s from %r", type(msg).__name__, peer)
        return
    try:
        send(sock, reply, to=peer, flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
        log.warning("could not reply to %r: %s", peer, exc)
