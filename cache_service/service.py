"""The cache service process: owns the arena; answers handoff alloc/free,
the prefix cache's lookup/release/reserve/commit, and stats.

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
from cache_service.block_index import BlockEntry, BlockIndex
from cache_service.block_store import BlockStore
from cache_service.disk_tier import DiskTier
from deploy.logs import setup_logging
from deploy.settings import Settings
from protos.messages import (BlockRef, CacheAlloc, CacheAllocReply, CacheFree, CacheReply, CacheStats, KVCommit,
                             KVLookup, KVLookupReply, KVRelease, KVReserve, KVReserveReply)
from protos.transport import ipc_address, make_socket, recv, send

log = logging.getLogger(__name__)

_TICK_S = 0.25  # longest sleep between expiry checks and stop-flag checks
_BURST = 1000  # most messages served between two expiry passes
_FLUSH_S = 1.0  # at stop, how long queued disk writes may take


class CacheService:
    """The request handlers, apart from the socket loop (so tests can call them)."""

    def __init__(self, arena: Arena, capacity: int, disk: Optional[DiskTier] = None):
        self.arena = arena
        self.allocator = Allocator(min(capacity, arena.size))
        self.index = BlockIndex(self.allocator)
        self.blocks = BlockStore(arena, self.index, disk)
        self._handlers = {CacheAlloc: self._alloc, CacheFree: self._free, CacheStats: self._stats,
                          KVLookup: self._lookup, KVRelease: self._release, KVReserve: self._reserve,
                          KVCommit: self._commit}

    def handle(self, msg: Any) -> Optional[Any]:
        """One request -> its reply; None for a message that is not a request."""
        handler = self._handlers.get(type(msg))
        return handler(msg) if handler else None

    def stats(self) -> dict:
        # pid: lets a health check tell a restarted service from the old one.
        return {**self.allocator.stats(), **self.blocks.stats(), "pid": os.getpid()}

    def _stats(self, msg: CacheStats) -> CacheReply:
        return CacheReply(call_id=msg.call_id, ok=True, stats=self.stats())

    # ------------------------------------------------------------ handoffs --

    def _alloc(self, msg: CacheAlloc) -> CacheAllocReply:
        fail = lambda error: CacheAllocReply(call_id=msg.call_id, ok=False, arena=self.arena.name, error=error)
        try:
            alloc = self.index.alloc_handoff(msg.nbytes, msg.owner, msg.ttl_s)
        except ValueError as exc:
            return fail(f"invalid CacheAlloc: {exc}")
        if alloc is None:
            st = self.allocator.stats()
            if msg.nbytes > st["arena_bytes"]:
                return fail(f"cannot fit {msg.nbytes} bytes: larger than the whole cache arena "
                            f"({st['arena_bytes']} bytes)")
            return fail(f"cache arena full: cannot fit {msg.nbytes} bytes (arena {st['arena_bytes']}, "
                        f"free {st['free_bytes']}, largest free range {st['largest_free']}, "
                        f"cached KV blocks {self.index.stats()['memory_bytes']} bytes, none evictable here)")
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
            if self.index.free_handoff(alloc_id) is None:
                unknown += 1  # already freed, or expired (the holder was too slow), or not a handoff
            else:
                freed += 1
        if msg.owner:
            freed += len(self.index.free_handoffs_of(msg.owner))
        return CacheReply(call_id=msg.call_id, ok=True, stats={"freed": freed, "unknown": unknown})

    # -------------------------------------------------------- prefix cache --

    def _refs(self, entries: list[BlockEntry]) -> list[BlockRef]:
        return [BlockRef(hash=e.hash, offset=e.offset, nbytes=e.nbytes) for e in entries]

    def _lookup(self, msg: KVLookup) -> KVLookupReply:
        try:
            lease, entries = self.blocks.lookup(msg.hashes, msg.owner, msg.lease_s, bool(msg.first))
        except ValueError as exc:
            return KVLookupReply(call_id=msg.call_id, ok=False, arena=self.arena.name, error=f"invalid KVLookup: {exc}")
        return KVLookupReply(call_id=msg.call_id, ok=True, arena=self.arena.name, lease=lease,
                             blocks=self._refs(entries))

    def _release(self, msg: KVRelease) -> CacheReply:
        released = self.blocks.release(msg.lease)  # unknown: released already, or expired
        return CacheReply(call_id=msg.call_id, ok=True, stats={"released": int(released)})

    def _reserve(self, msg: KVReserve) -> KVReserveReply:
        try:
            entries = self.blocks.reserve(msg.hashes, msg.nbytes, msg.owner, msg.ttl_s)
        except ValueError as exc:
            return KVReserveReply(call_id=msg.call_id, ok=False, arena=self.arena.name,
                                  error=f"invalid KVReserve: {exc}")
        return KVReserveReply(call_id=msg.call_id, ok=True, arena=self.arena.name, blocks=self._refs(entries))

    def _commit(self, msg: KVCommit) -> CacheReply:
        try:
            done = self.blocks.commit(msg.hashes, msg.owner)
        except ValueError as exc:
            return CacheReply(call_id=msg.call_id, ok=False, error=f"invalid KVCommit: {exc}")
        return CacheReply(call_id=msg.call_id, ok=True,
                          stats={"committed": len(done), "unknown": len(msg.hashes) - len(done)})

    # ---------------------------------------------------------------- time --

    def tick(self) -> None:
        """Housekeeping between bursts: deadlines, finished disk copies."""
        self.blocks.collect_disk_writes()
        expired = self.index.expire()
        for alloc in expired.handoffs:
            log.warning("reservation %d of %r (%d bytes) expired unfreed", alloc.id, alloc.owner, alloc.nbytes)
        for entry in expired.reservations:
            log.warning("KV block reservation of %r expired uncommitted: dropped", entry.owner)
        for lease in expired.leases:
            log.info("KV lease %d of %r (%d blocks) expired unreleased", lease.id, lease.owner, len(lease.hashes))

    def wait_s(self) -> float:
        """How long the loop may sleep: until the next deadline, at most a tick."""
        deadline = self.index.next_deadline()
        if deadline is None:
            return _TICK_S
        return min(_TICK_S, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.blocks.close(_FLUSH_S)


def _open_disk_tier(settings: Settings) -> Optional[DiskTier]:
    """The disk tier of settings.cache_dir; None when off or unusable (the
    service then runs memory-only rather than not at all)."""
    if not settings.cache_dir:
        return None
    try:
        return DiskTier(settings.cache_dir, settings.cache_disk_bytes)
    except OSError as exc:
        log.error("KV disk tier off: cannot use %s: %s", settings.cache_dir, exc)
        return None


def run(settings: Settings, ready=None) -> None:
    """Process main. `ready` (a multiprocessing Event, optional) is set once
    the socket is bound. Returns (exit 0) after SIGTERM/SIGINT."""
    setup_logging(settings.log_level, "cache")
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
    sock = service = None
    try:
        service = CacheService(arena, settings.cache_memory_bytes, _open_disk_tier(settings))
        os.makedirs(settings.run_dir, exist_ok=True)
        sock = make_socket(ctx, zmq.ROUTER)
        address = ipc_address(settings.run_dir, "cache")
        sock.bind(address)
        log.info("serving arena %s (%d bytes of memory) at %s", arena.name, arena.size, address)
        disk = service.blocks.disk
        if disk is None:
            log.info("KV disk tier off")
        else:
            st = disk.stats()
            log.info("KV disk tier %s: %d bytes at most; found %d blocks (%d bytes)",
                     disk.root, disk.capacity_bytes, st["disk_blocks"], st["disk_bytes"])
        if ready is not None:
            ready.set()
        _serve(sock, service, stop)
        log.info("stopping on signal %s", stop[0])
    finally:
        if sock is not None:
            sock.close(linger=0)
        ctx.term()
        if service is not None:
            service.close()  # queued disk writes still read the arena
        arena.close()
        arena.unlink()


def _serve(sock: zmq.Socket, service: CacheService, stop: list) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while not stop:
        service.tick()
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


_ERROR_REPLY = {CacheAlloc: CacheAllocReply, KVLookup: KVLookupReply, KVReserve: KVReserveReply}


def _answer(sock: zmq.Socket, service: CacheService, peer: bytes, msg: Any) -> None:
    try:
        reply = service.handle(msg)
    except Exception:  # a handler bug must cost one call, not the service
        log.exception("handler failed on %s", type(msg).__name__)
        reply_type = _ERROR_REPLY.get(type(msg), CacheReply)
        reply = reply_type(call_id=getattr(msg, "call_id", -1), ok=False, error="internal error in cache service")
    if reply is None:
        log.error("ignored unexpected message %s from %r", type(msg).__name__, peer)
        return
    try:
        send(sock, reply, to=peer, flags=zmq.NOBLOCK)
    except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or its queue full
        log.warning("could not reply to %r: %s", peer, exc)
