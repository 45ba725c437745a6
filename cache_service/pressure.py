"""The cache service under memory pressure: the arena's KV blocks shrink
before the system swaps (environment/memory_pressure.py reads the level).

On warn the blocks may hold at most half of what they held when the
pressure began; on critical, nothing: every block nobody is reading goes.
Pressure acts once it has lasted UNLOAD_FIRST_S (the router unloads idle
models first). The ceiling holds, checked at every reading, until the level is normal
again, so a busy server cannot grow the cache back while the machine is
short. Least recently used blocks go first; leased, pinned (being written
to disk) and half-written blocks and handoffs stay, so no request in flight
breaks. Blocks are written through to the disk tier when committed, so an
evicted block is still a disk hit later. The freed ranges' pages are then
given back to the system (`Arena.discard`): evicting alone would leave them
resident.
"""

from __future__ import annotations

import logging
from typing import Optional

from cache_service.arena import Arena
from cache_service.block_index import BlockIndex
from environment.memory_pressure import CRITICAL, NORMAL, MemoryPressure, PressurePoll

log = logging.getLogger(__name__)

WARN_SHARE = 0.5  # on warn, the blocks keep at most this share of what they held


class PressureShrinker:
    def __init__(self, poll: PressurePoll, index: BlockIndex, arena: Arena):
        self.poll = poll
        self.index = index
        self.arena = arena
        self.ceiling: Optional[int] = None  # bytes the blocks may hold while pressed; None: no limit
        self.freed_bytes_total = 0  # arena bytes of blocks evicted for pressure, since start
        self.shrinks_total = 0

    def tick(self) -> None:
        """Read the level when due, and hold the cache to its ceiling."""
        if not self.poll.due():
            return
        previous = self.poll.last
        reading = self.poll.read()
        if reading.error and reading.error != previous.error:
            log.info("memory pressure unread: %s", reading.error)
        if reading.level != previous.level:
            log.warning("memory pressure %s -> %s (%s)", previous.level, reading.level, reading.detail or reading.reader)
        if reading.level == NORMAL or self.poll.acting():  # idle models are unloaded first (UNLOAD_FIRST_S)
            self.apply(reading)

    def apply(self, reading: MemoryPressure) -> int:
        """Shrink for one reading; the arena bytes freed."""
        if reading.level == NORMAL:
            self.ceiling = None
            return 0
        if reading.level == CRITICAL:
            self.ceiling = 0
        elif self.ceiling is None:  # warn begins: half of what the blocks hold now
            self.ceiling = int(self.index.stats()["memory_bytes"] * WARN_SHARE)
        return self.shrink_to(self.ceiling)

    def shrink_to(self, target: int) -> int:
        freed = self.index.shrink(target)
        if not freed:
            return 0
        self.shrinks_total += 1
        self.freed_bytes_total += freed
        discarded = sum(self.arena.discard(start, length) for start, length, alloc_id in
                        self.index.allocator.segments() if alloc_id is None)
        log.warning("memory pressure: evicted %.1f MiB of KV blocks (ceiling %.1f MiB); free arena pages "
                    "given back: %s", freed / 2**20, target / 2**20, "yes" if discarded else "no (not on this system)")
        return freed

    def stats(self) -> dict:
        return {"memory_pressure": self.poll.last.value,
                "memory_pressure_freed_bytes_total": self.freed_bytes_total,
                "memory_pressure_shrinks_total": self.shrinks_total}

