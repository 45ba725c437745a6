"""The prefix cache's data path: the index's blocks in arena memory, backed
by the disk tier (optional).

- lookup: a block missing from memory but on disk is read (verified) into a
  fresh arena slot and served as a hit;
- commit: every newly committed block is written through to disk in the
  background, pinned (never evicted) until the copy is over; while the power
  policy defers disk writes (saver: a laptop's SSD and CPU rest), the blocks
  are remembered instead and written once it allows them, those still in
  memory then;
- everything else is the index's.

Service thread only, like the index; the disk tier's writer thread only ever
reads pinned arena bytes and reports back through `finished()`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from cache_service.arena import Arena
from cache_service.block_index import READY, BlockEntry, BlockIndex
from cache_service.disk_tier import DiskTier, empty_stats

_PROMOTE_TTL_S = 60.0  # a disk read that never finishes (it cannot, but) still frees its slot
DEFERRED_KEPT = 65536  # blocks remembered for a deferred write; older ones stay memory-only


class BlockStore:
    def __init__(self, arena: Arena, index: BlockIndex, disk: Optional[DiskTier] = None):
        self.arena = arena
        self.index = index
        self.disk = disk
        self.defer_writes = False  # the power policy's (cache_service/main.py follows it)
        self._deferred: OrderedDict[bytes, None] = OrderedDict()  # committed while deferred, oldest first

    def lookup(self, hashes: list, owner: str, lease_s: float, first: bool = False) -> tuple[int, list[BlockEntry]]:
        self.collect_disk_writes()  # finished copies unpin blocks: more room to promote into
        lease, entries = self.index.lookup(hashes, owner, lease_s, self._promote if self.disk else None, first)
        if self.disk is not None and entries:
            # Memory hits are uses too: the disk copies of hot prefixes must not
            # age out. Head last: the most recent, like in memory.
            self.disk.touch([e.hash for e in reversed(entries)])
        return lease, entries

    def release(self, lease_id: int) -> bool:
        return self.index.release(lease_id)

    def reserve(self, hashes: list, nbytes: int, owner: str, ttl_s: float) -> list[BlockEntry]:
        self.collect_disk_writes()
        return self.index.reserve(hashes, nbytes, owner, ttl_s)

    def commit(self, hashes: list, owner: str = "") -> list[BlockEntry]:
        done = self.index.commit(hashes, owner)
        if self.disk is not None and done and self.defer_writes:
            for entry in done:
                self._deferred[entry.hash] = None
            while len(self._deferred) > DEFERRED_KEPT:
                self._deferred.popitem(last=False)
        elif self.disk is not None and done:
            # A chain serves only from its head: when the writer's queue has no
            # room for every new block, the ones nearest the head go.
            kept, room = 0, self.disk.room_bytes()
            for entry in done:  # head first
                room -= entry.nbytes
                if room < 0 and kept:
                    break
                kept += 1
            self.disk.count_dropped(len(done) - kept)
            # Same order as in memory: tail written first, cached ancestors touched last.
            order = self.index.use_order(done[:kept])
            for entry in order[:kept]:
                self._write_through(entry)
            self.disk.touch([e.hash for e in order[kept:]])
        return done

    def flush_deferred(self) -> int:
        """Once writes are allowed again: the deferred blocks still in memory,
        as many as the writer's queue takes now (the rest at the next call).
        Returns how many were queued."""
        if self.defer_writes or self.disk is None or not self._deferred:
            return 0
        queued, room = 0, self.disk.room_bytes()
        while self._deferred and room > 0:
            h, _ = self._deferred.popitem(last=False)
            entry = self.index.get(h)
            if entry is None or entry.state != READY:  # evicted meanwhile: stays out of both tiers
                continue
            room -= entry.nbytes
            self._write_through(entry)
            queued += 1
        return queued

    def collect_disk_writes(self) -> None:
        if self.disk is not None:
            for h in self.disk.finished():
                self.index.unpin(h)

    def stats(self) -> dict:
        return {**self.index.stats(), **(self.disk.stats() if self.disk else empty_stats()),
                "disk_writes_deferred": len(self._deferred)}

    def close(self, flush_timeout_s: float = 1.0) -> None:
        if self.disk is not None:
            self.disk.close(flush_timeout_s)

    def _write_through(self, entry: BlockEntry) -> None:
        self.index.pin(entry.hash)
        view = self.arena.view(entry.offset, entry.nbytes)
        if not self.disk.submit(entry.hash, view):  # queue full: this block stays memory-only
            view.release()
            self.index.unpin(entry.hash)

    def _promote(self, h: bytes) -> bool:
        """Disk -> a new READY block in the arena; False on a miss (absent,
        corrupt, or no room in memory)."""
        nbytes = self.disk.payload_size(h)
        if nbytes is None:
            return False
        try:
            placed = self.index.reserve([h], nbytes, owner="disk", ttl_s=_PROMOTE_TTL_S)
        except ValueError:  # a block bigger than this arena (another model's, wrongly hashed)
            return False
        if not placed:
            return False
        entry = placed[0]
        view = self.arena.view(entry.offset, nbytes)
        try:
            ok = self.disk.read_into(h, view)
        finally:
            view.release()
        if ok:
            self.index.commit([h])  # already on disk: no write-through
        else:
            self.index.abort(h)
        return ok
