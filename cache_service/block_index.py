"""What lives in the arena: KV blocks by chained hash, and handoff allocations.

Pure bookkeeping over one `Allocator` (no memory, no files, no sockets); only
the service's thread calls it.

A block is WRITING from KVReserve until KVCommit: invisible to lookups, and its
allocation carries the reservation's deadline, so a writer that died never
leaks space and its half-written block is never served. Then it is READY: no
deadline, it lives until evicted. A READY block is evictable unless leased (a
lookup's holder is copying it) or pinned (the disk tier is copying it).
WRITING blocks and handoff allocations (CacheAlloc, prefill -> decode) are
never evicted: eviction never breaks a request in flight.

Eviction is least-recently-used. A lookup or commit uses a chain of blocks;
it marks them so that a parent is never older than its children (lookups
touch the chain tail first, commits touch their new blocks and then every
cached ancestor), so LRU eats chains from the tail and never leaves cached
suffixes stranded behind an evicted parent (a lookup stops at the first miss).
Room for a handoff, bigger than a block, is the coldest contiguous range
(eviction.py); the table of leases and their deadlines is leases.py; the
rules for a caller's arguments, checks.py.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

from cache_service.allocator import Allocation, Allocator
from cache_service.checks import check_hashes, check_nbytes, check_seconds
from cache_service.eviction import coldest_window
from cache_service.leases import Lease, Leases

WRITING = "writing"
READY = "ready"

BLOCK_OWNER = "kv-block"  # the allocator owner of every block; real owners stay in BlockEntry


@dataclass(eq=False)
class BlockEntry:
    hash: bytes
    alloc_id: int
    offset: int
    nbytes: int  # what the block holds
    size: int  # what it takes in the arena (nbytes aligned up)
    owner: str  # who reserved it
    parent: Optional[bytes]  # the hash before it in its reserve call: its chain parent
    state: str = WRITING
    leases: int = 0
    pins: int = 0
    last_use: int = 0  # use counter value; larger is more recent

    @property
    def evictable(self) -> bool:
        return self.state == READY and self.leases == 0 and self.pins == 0


class Expired(NamedTuple):
    handoffs: list  # [Allocation] of CacheAlloc holders that never freed
    reservations: list  # [BlockEntry] whose writer never committed (dropped)
    leases: list  # [Lease] never released


_COUNTERS = ("lookups_total", "lookup_blocks_total", "lookup_hit_blocks_total", "lookup_miss_total",
             "lookup_tail_hits_total",
             "reserved_blocks_total", "committed_blocks_total", "evictions_total",
             "reservations_expired_total", "leases_expired_total")


class BlockIndex:
    def __init__(self, allocator: Allocator, *, clock: Callable[[], float] = time.monotonic,
                 first_lease_id: Optional[int] = None):
        self.allocator = allocator
        self._clock = clock
        self._entries: dict[bytes, BlockEntry] = {}
        self._by_alloc: dict[int, bytes] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # READY blocks, least recently used first
        self._uses = 0
        self._ready_bytes = 0
        self._block_bytes = 0  # arena bytes of all blocks, READY and WRITING
        self._leases = Leases(first_lease_id)
        self.counters = dict.fromkeys(_COUNTERS, 0)

    # -------------------------------------------------------------- queries --

    def get(self, h: bytes) -> Optional[BlockEntry]:
        return self._entries.get(h)

    def __contains__(self, h: bytes) -> bool:
        return h in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def lru_order(self) -> list[bytes]:
        """READY hashes, least recently used first (for tests and debugging)."""
        return list(self._lru)

    # --------------------------------------------------------------- lookup --

    def lookup(self, hashes: list, owner: str, lease_s: float,
               fetch: Optional[Callable[[bytes], bool]] = None, first: bool = False) -> tuple[int, list[BlockEntry]]:
        """Lease the longest run of READY blocks from hashes[0]. Returns
        (lease id, entries); (-1, []) on a miss at hashes[0]. With `first`,
        lease the first READY block of `hashes` alone (a tail block's
        candidates), and count no lookup: the chain's lookup was counted.

        `fetch(h)`, called for a hash that is not in memory at all, may place it
        as READY (from the disk tier) and returns whether it did. Blocks already
        taken are leased by then, so whatever it evicts is never one of them.
        """
        check_hashes(hashes)
        check_seconds(lease_s, "lease_s")
        if first:
            return self._lookup_first(hashes, owner, lease_s, fetch)
        held: list[BlockEntry] = []
        for h in hashes:
            entry = self._ready(h, fetch)
            if entry is None:
                break
            entry.leases += 1
            held.append(entry)
        c = self.counters
        c["lookups_total"] += 1
        c["lookup_blocks_total"] += len(hashes)
        c["lookup_hit_blocks_total"] += len(held)
        c["lookup_miss_total"] += len(held) < len(hashes)
        if not held:
            return -1, []
        return self._lease(held, owner, lease_s)

    def _lookup_first(self, hashes: list, owner: str, lease_s: float, fetch) -> tuple[int, list[BlockEntry]]:
        for h in hashes:
            entry = self._ready(h, fetch)
            if entry is not None:
                entry.leases += 1
                self.counters["lookup_tail_hits_total"] += 1
                return self._lease([entry], owner, lease_s)
        return -1, []

    def _ready(self, h: bytes, fetch) -> Optional[BlockEntry]:
        """The READY entry of `h`, fetched (from disk) if it is not in memory at all; else None."""
        entry = self._entries.get(h)
        if entry is None and fetch is not None and fetch(h):
            entry = self._entries.get(h)
        return entry if entry is not None and entry.state == READY else None

    def _lease(self, held: list[BlockEntry], owner: str, lease_s: float) -> tuple[int, list[BlockEntry]]:
        for entry in reversed(held):  # the chain's head ends up the most recent
            self._touch(entry)
        lease = self._leases.grant(owner, self._clock() + lease_s, [e.hash for e in held])
        return lease.id, held

    def release(self, lease_id: int) -> bool:
        """End a lease; False if unknown (released already, or expired)."""
        lease = self._leases.pop(lease_id)
        if lease is None:
            return False
        self._drop_lease(lease)
        return True

    def _drop_lease(self, lease: Lease) -> None:
        for h in lease.hashes:
            entry = self._entries.get(h)  # a leased block is never evicted, so it is there
            if entry is not None:
                entry.leases -= 1

    # ------------------------------------------------------- reserve/commit --

    def reserve(self, hashes: list, nbytes: int, owner: str, ttl_s: float) -> list[BlockEntry]:
        """Reserve WRITING blocks for the hashes not present (READY or WRITING
        ones are left out), in order, evicting as needed; stops at the first
        that finds no room, so the result is a prefix of what was asked."""
        check_hashes(hashes)
        check_nbytes(nbytes)
        check_seconds(ttl_s, "ttl_s")
        if self.allocator.size_for(nbytes) > self.allocator.capacity:
            raise ValueError(f"a block of {nbytes} bytes is larger than the whole cache arena "
                             f"({self.allocator.capacity} bytes)")
        # The cached part of this chain must survive making room for its new
        # tail: a new block whose parent was just evicted could never be hit.
        cached = [self._entries[h] for h in hashes if h in self._entries]
        for entry in cached:
            entry.pins += 1
        placed: list[BlockEntry] = []
        try:
            parent = None
            for h in hashes:
                if h not in self._entries:
                    alloc = self._alloc_evicting(nbytes, BLOCK_OWNER, ttl_s)
                    if alloc is None:
                        break
                    entry = BlockEntry(h, alloc.id, alloc.offset, nbytes, alloc.size, owner, parent)
                    self._entries[h] = entry
                    self._by_alloc[alloc.id] = h
                    self._block_bytes += alloc.size
                    placed.append(entry)
                parent = h
        finally:
            for entry in cached:
                entry.pins -= 1
        self.counters["reserved_blocks_total"] += len(placed)
        return placed

    def commit(self, hashes: list, owner: str = "") -> list[BlockEntry]:
        """WRITING -> READY for each hash with a live reservation (of `owner`,
        when given). Unknown, expired or READY hashes are skipped."""
        check_hashes(hashes)
        done = []
        for h in hashes:
            entry = self._entries.get(h)
            if entry is None or entry.state != WRITING or (owner and entry.owner != owner):
                continue
            entry.state = READY
            self.allocator.set_deadline(entry.alloc_id, math.inf)
            self._ready_bytes += entry.nbytes
            done.append(entry)
        for entry in self.use_order(done):
            self._touch(entry)
        self.counters["committed_blocks_total"] += len(done)
        return done

    def abort(self, h: bytes) -> bool:
        """Drop a WRITING block whose data never arrived (a failed disk read)."""
        entry = self._entries.get(h)
        if entry is None or entry.state != WRITING:
            return False
        self._remove(entry)
        return True

    def pin(self, h: bytes) -> bool:
        entry = self._entries.get(h)
        if entry is not None:
            entry.pins += 1
        return entry is not None

    def unpin(self, h: bytes) -> None:
        entry = self._entries.get(h)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def _touch(self, entry: BlockEntry) -> None:
        self._uses += 1
        entry.last_use = self._uses
        self._lru[entry.hash] = None
        self._lru.move_to_end(entry.hash)

    def use_order(self, committed: list[BlockEntry]) -> list[BlockEntry]:
        """What committing these blocks used, least recent first: the new
        blocks from the chain's tail, then their cached ancestors up to the
        root. Computing a block used its ancestors; touching in this order
        keeps every parent at least as recent as its children."""
        order = list(reversed(committed))
        seen = {e.hash for e in committed}
        for entry in committed:
            h = entry.parent
            while h is not None and h not in seen:  # `seen` also breaks cycles of reused hashes
                seen.add(h)
                ancestor = self._entries.get(h)
                if ancestor is None or ancestor.state != READY:
                    break
                order.append(ancestor)
                h = ancestor.parent
        return order

    # ------------------------------------------------------------- handoffs --

    def alloc_handoff(self, nbytes: int, owner: str, ttl_s: float) -> Optional[Allocation]:
        """A prefill->decode handoff allocation (never evicted), evicting
        blocks to make contiguous room; None when none can be made."""
        check_nbytes(nbytes)
        check_seconds(ttl_s, "ttl_s")
        return self._alloc_evicting(nbytes, owner, ttl_s)

    def free_handoff(self, alloc_id: int) -> Optional[Allocation]:
        if alloc_id in self._by_alloc:  # a block's id: not the caller's to free
            return None
        return self.allocator.free(alloc_id)

    def free_handoffs_of(self, owner: str) -> list[Allocation]:
        ids = [i for i in self.allocator.owned_by(owner) if i not in self._by_alloc]
        return [a for a in map(self.allocator.free, ids) if a is not None]

    # ------------------------------------------------------------- eviction --

    def _alloc_evicting(self, nbytes: int, owner: str, ttl_s: float) -> Optional[Allocation]:
        size = self.allocator.size_for(nbytes)
        if size <= self.allocator.capacity and not self.allocator.fits(size):
            self._make_room(size)
        return self.allocator.alloc(nbytes, owner, ttl_s)

    def _make_room(self, size: int) -> bool:
        """Evict blocks until a free range of `size` bytes exists; evicts
        nothing when no such range can be made."""
        # The usual case (blocks all of one size): the coldest evictable block
        # is big enough, and freeing it alone makes room. Plain LRU.
        victim = next((self._entries[h] for h in self._lru if self._entries[h].evictable), None)
        if victim is None:
            return False
        if victim.size >= size:
            self._evict(victim)
            return True
        return self._evict_coldest_window(size)

    def _evict_coldest_window(self, size: int) -> bool:
        """Room for something bigger than a block (a handoff): evict the
        coldest range of the arena that opens a hole of `size` bytes
        (eviction.coldest_window)."""
        segs = self.allocator.segments()
        window = coldest_window([length for _, length, _ in segs],
                                [self._eviction_cost(alloc_id) for _, _, alloc_id in segs], size)
        if window is None:
            return False
        first, last = window
        for _, _, alloc_id in segs[first:last + 1]:
            if alloc_id is not None:
                self._evict(self._entries[self._by_alloc[alloc_id]])
        return True

    def _eviction_cost(self, alloc_id: Optional[int]) -> Optional[int]:
        """-1 for free space, last use for an evictable block, None for what must stay."""
        if alloc_id is None:
            return -1
        h = self._by_alloc.get(alloc_id)
        if h is None:
            return None  # a handoff
        entry = self._entries[h]
        return entry.last_use if entry.evictable else None

    def shrink(self, target_bytes: int) -> int:
        """Evict evictable blocks, least recently used first, until the READY
        blocks hold at most `target_bytes` (memory pressure); leased, pinned
        and WRITING blocks stay. Returns the arena bytes freed."""
        freed = 0
        for h in list(self._lru):
            if self._ready_bytes <= target_bytes:
                break
            entry = self._entries[h]
            if entry.evictable:
                freed += entry.size
                self._evict(entry)
        return freed

    def _evict(self, entry: BlockEntry) -> None:
        self._remove(entry)
        self.counters["evictions_total"] += 1

    def _remove(self, entry: BlockEntry) -> None:
        self.allocator.free(entry.alloc_id)
        del self._entries[entry.hash]
        del self._by_alloc[entry.alloc_id]
        self._block_bytes -= entry.size
        if entry.state == READY:
            del self._lru[entry.hash]
            self._ready_bytes -= entry.nbytes

    # ---------------------------------------------------------------- time --

    def expire(self, now: Optional[float] = None) -> Expired:
        """End leases and reservations past their deadline, and handoffs past theirs."""
        now = self._clock() if now is None else now
        leases = self._leases.expire(now)
        for lease in leases:
            self._drop_lease(lease)
        handoffs, reservations = [], []
        for alloc in self.allocator.expire(now):  # frees the space already
            h = self._by_alloc.pop(alloc.id, None)
            if h is None:
                handoffs.append(alloc)
                continue
            entry = self._entries.pop(h)  # only WRITING blocks have deadlines
            self._block_bytes -= entry.size
            reservations.append(entry)
        self.counters["leases_expired_total"] += len(leases)
        self.counters["reservations_expired_total"] += len(reservations)
        return Expired(handoffs, reservations, leases)

    def next_deadline(self) -> Optional[float]:
        deadlines = [d for d in (self.allocator.next_deadline(), self._leases.next_deadline()) if d is not None]
        return min(deadlines, default=None)

    # --------------------------------------------------------------- stats --

    def stats(self) -> dict:
        arena = self.allocator.stats()
        return {
            "blocks": len(self._lru),  # READY: servable
            "memory_bytes": self._ready_bytes,
            "writing_blocks": len(self._entries) - len(self._lru),
            "leases": len(self._leases),
            "handoffs": arena["allocations"] - len(self._by_alloc),
            "handoff_bytes": arena["used_bytes"] - self._block_bytes,
            **self.counters,
        }

