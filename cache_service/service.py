"""The cache service: owns the arena; answers handoff alloc/free, the
prefix cache's lookup/release/reserve/commit, and stats. No socket here:
cache_service/main.py is the process that feeds it messages, so a test
drives a CacheService directly.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional


from cache_service.allocator import Allocator
from cache_service.arena import Arena
from cache_service.block_index import BlockEntry, BlockIndex
from cache_service.block_store import BlockStore
from cache_service.disk_tier import DiskTier
from cache_service.pressure import PressureShrinker
from environment.memory_pressure import PressurePoll
from protos.messages import (BlockRef, CacheAlloc, CacheAllocReply, CacheFree, CacheReply, CacheStats, KVCommit,
                             KVLookup, KVLookupReply, KVRelease, KVReserve, KVReserveReply)

log = logging.getLogger(__name__)

_TICK_S = 0.25  # longest sleep between expiry checks and stop-flag checks
# Longest reservation or lease a caller may ask for (callers ask for 10 to
# 120 s): a hostile or broken one must not pin arena space for ever.
MAX_HOLD_S = 3600.0
_FLUSH_S = 1.0  # at stop, how long queued disk writes may take


class CacheService:
    """The request handlers, apart from the socket loop (so tests can call them)."""

    def __init__(self, arena: Arena, capacity: int, disk: Optional[DiskTier] = None,
                 pressure: Optional[PressurePoll] = None):
        self.arena = arena
        self.allocator = Allocator(min(capacity, arena.size))
        self.index = BlockIndex(self.allocator)
        self.blocks = BlockStore(arena, self.index, disk)
        # Memory pressure shrinks the blocks (cache_service/pressure.py); None: never read.
        self.defer_disk_writes = False  # set by the power-following thread (cache_service/main.py)
        self.pressure = PressureShrinker(pressure, self.index, arena) if pressure is not None else None
        self._handlers = {CacheAlloc: self._alloc, CacheFree: self._free, CacheStats: self._stats,
                          KVLookup: self._lookup, KVRelease: self._release, KVReserve: self._reserve,
                          KVCommit: self._commit}

    def handle(self, msg: Any) -> Optional[Any]:
        """One request -> its reply; None for a message that is not a request."""
        handler = self._handlers.get(type(msg))
        if handler is None:
            return None
        too_long = _too_long(msg)
        if too_long:
            return error_reply(msg, f"invalid {type(msg).__name__}: {too_long}")
        return handler(msg)

    def stats(self) -> dict:
        # pid: lets a health check tell a restarted service from the old one.
        pressure = self.pressure.stats() if self.pressure is not None else {}
        return {**self.allocator.stats(), **self.blocks.stats(), **pressure, "pid": os.getpid()}

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
        """Housekeeping between bursts: deadlines, finished disk copies, memory pressure."""
        self.blocks.collect_disk_writes()
        if self.defer_disk_writes != self.blocks.defer_writes:
            log.info("KV disk-tier writes %s by the power policy", "deferred" if self.defer_disk_writes else "resumed")
            self.blocks.defer_writes = self.defer_disk_writes
        self.blocks.flush_deferred()
        if self.pressure is not None:
            self.pressure.tick()
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


def _too_long(msg: Any) -> str:
    """Why `msg` asks to hold arena space too long; "" when it does not
    (the index refuses a hold that is not a positive finite number)."""
    for name in ("ttl_s", "lease_s"):
        seconds = getattr(msg, name, None)
        if isinstance(seconds, (int, float)) and seconds > MAX_HOLD_S:
            return f"{name} must be at most {MAX_HOLD_S:.0f} s, got {seconds!r}"
    return ""


_ERROR_REPLY = {CacheAlloc: CacheAllocReply, KVLookup: KVLookupReply, KVReserve: KVReserveReply}


def error_reply(msg: Any, error: str) -> Any:
    """`msg`'s error reply, of the type its success would have."""
    reply_type = _ERROR_REPLY.get(type(msg), CacheReply)
    return reply_type(call_id=getattr(msg, "call_id", -1), ok=False, error=error)
