"""Byte ranges of the arena: who holds which, until when.

Pure bookkeeping over [0, capacity): it never touches the memory. Best-fit on
a free list kept sorted by offset, coalesced on every free, so freeing all
allocations always gives back one free range. Every allocation has a deadline;
`expire` frees those past it, so a holder that died never leaks space.

The KV block index (`block_index.py`: content hashes, leases, LRU) sits on
top of this: it gives a committed block no deadline (`set_deadline(id, inf)`)
and reads `segments()` to find contiguous room to evict.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

ALIGNMENT = 64  # a cache line; keeps every array's start aligned for SIMD loads


@dataclass
class Allocation:
    id: int
    offset: int
    nbytes: int  # what was asked for
    size: int  # what is reserved: nbytes rounded up to ALIGNMENT
    owner: str
    deadline: float  # clock time after which `expire` frees it; math.inf: never


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class Allocator:
    def __init__(self, capacity: int, *, alignment: int = ALIGNMENT,
                 clock: Callable[[], float] = time.monotonic):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.alignment = alignment
        # A tail shorter than the alignment can never start an aligned block.
        self.capacity = capacity // alignment * alignment
        self._clock = clock
        self._free_offsets: list[int] = []  # sorted starts of free ranges
        self._free_size: dict[int, int] = {}  # start -> length
        if self.capacity:
            self._free_offsets.append(0)
            self._free_size[0] = self.capacity
        self._live: dict[int, Allocation] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped lazily
        self._next_id = 1
        self._used = 0
        self._allocs_total = 0
        self._frees_total = 0
        self._expired_total = 0
        self._failed_total = 0

    # ---------------------------------------------------------------- alloc --

    def alloc(self, nbytes: int, owner: str, ttl_s: float) -> Optional[Allocation]:
        """Reserve `nbytes`; None when no free range is large enough.

        Raises ValueError for a request that could never succeed (nbytes not a
        positive int, or ttl_s not a positive finite number).
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r}")
        if not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise ValueError(f"ttl_s must be a positive finite number of seconds, got {ttl_s!r}")
        size = _round_up(nbytes, self.alignment)
        start = self._best_fit(size)
        if start is None:
            self._failed_total += 1
            return None
        self._take(start, size)
        alloc = Allocation(self._next_id, start, nbytes, size, owner, self._clock() + ttl_s)
        self._next_id += 1
        self._live[alloc.id] = alloc
        self._by_owner.setdefault(owner, set()).add(alloc.id)
        heapq.heappush(self._deadlines, (alloc.deadline, alloc.id))
        self._used += size
        self._allocs_total += 1
        return alloc

    def _best_fit(self, size: int) -> Optional[int]:
        # Smallest range that fits (lowest offset on ties): big ranges stay
        # whole for big KV handoffs. O(free ranges), which stay few because
        # they are coalesced.
        best, best_len = None, None
        for start in self._free_offsets:
            length = self._free_size[start]
            if length >= size and (best_len is None or length < best_len):
                best, best_len = start, length
                if length == size:
                    break
        return best

    def _take(self, start: int, size: int) -> None:
        length = self._free_size.pop(start)
        i = bisect.bisect_left(self._free_offsets, start)
        if length == size:
            del self._free_offsets[i]
        else:  # the remainder keeps the same place in the sorted list
            self._free_offsets[i] = start + size
            self._free_size[start + size] = length - size

    def fits(self, nbytes: int) -> bool:
        """Whether `alloc(nbytes, ...)` would find room now."""
        return 0 < nbytes and self._best_fit(_round_up(nbytes, self.alignment)) is not None

    def size_for(self, nbytes: int) -> int:
        """Bytes an allocation of `nbytes` really takes."""
        return _round_up(nbytes, self.alignment)

    def set_deadline(self, alloc_id: int, deadline: float) -> bool:
        """Move a live allocation's deadline (math.inf: never expires); False if not live."""
        alloc = self._live.get(alloc_id)
        if alloc is None:
            return False
        alloc.deadline = deadline
        if math.isfinite(deadline):  # the old heap entry goes stale; expire skips it
            heapq.heappush(self._deadlines, (deadline, alloc_id))
        return True

    # ----------------------------------------------------------------- free --

    def get(self, alloc_id: int) -> Optional[Allocation]:
        return self._live.get(alloc_id)

    def free(self, alloc_id: int) -> Optional[Allocation]:
        """Release one allocation; None if it is not live (already freed or expired)."""
        alloc = self._release(alloc_id)
        if alloc is not None:
            self._frees_total += 1
        return alloc

    def owned_by(self, owner: str) -> list[int]:
        """Ids of the live allocations of `owner`, oldest first."""
        return sorted(self._by_owner.get(owner, ()))

    def free_owner(self, owner: str) -> list[Allocation]:
        """Release every allocation of `owner`."""
        freed = [self.free(i) for i in sorted(self._by_owner.get(owner, ()))]
        return [a for a in freed if a is not None]

    def expire(self, now: Optional[float] = None) -> list[Allocation]:
        """Release every allocation whose deadline is at or before `now`."""
        now = self._clock() if now is None else now
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, alloc_id = heapq.heappop(self._deadlines)
            if not self._is_current(deadline, alloc_id):
                continue  # freed earlier, or its deadline moved: a stale heap entry
            expired.append(self._release(alloc_id))
        self._expired_total += len(expired)
        return expired

    def next_deadline(self) -> Optional[float]:
        """The earliest deadline among live allocations (None if none)."""
        while self._deadlines and not self._is_current(*self._deadlines[0]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _is_current(self, deadline: float, alloc_id: int) -> bool:
        alloc = self._live.get(alloc_id)
        return alloc is not None and alloc.deadline == deadline

    def _release(self, alloc_id: int) -> Optional[Allocation]:
        alloc = self._live.pop(alloc_id, None)
        if alloc is None:
            return None
        ids = self._by_owner[alloc.owner]
        ids.discard(alloc_id)
        if not ids:
            del self._by_owner[alloc.owner]
        self._used -= alloc.size
        self._give_back(alloc.offset, alloc.size)
        return alloc

    def _give_back(self, start: int, size: int) -> None:
        offsets = self._free_offsets
        i = bisect.bisect_left(offsets, start)
        # Merge with the following free range if it starts where this one ends.
        if i < len(offsets) and offsets[i] == start + size:
            size += self._free_size.pop(offsets[i])
            del offsets[i]
        # Merge into the preceding free range if it ends where this one starts.
        if i > 0 and offsets[i - 1] + self._free_size[offsets[i - 1]] == start:
            self._free_size[offsets[i - 1]] += size
        else:
            offsets.insert(i, start)
            self._free_size[start] = size

    # ---------------------------------------------------------------- stats --

    def allocations(self) -> list[Allocation]:
        return sorted(self._live.values(), key=lambda a: a.offset)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(start, length) of every free range, by offset."""
        return [(o, self._free_size[o]) for o in self._free_offsets]

    def segments(self) -> list[tuple[int, int, Optional[int]]]:
        """The whole arena in address order: (start, length, allocation id or
        None for a free range). Consecutive segments touch."""
        spans = [(a.offset, a.size, a.id) for a in self._live.values()]
        spans += [(o, n, None) for o, n in self.free_ranges()]
        spans.sort(key=lambda s: s[0])
        return spans

    def stats(self) -> dict:
        return {
            "arena_bytes": self.capacity,
            "used_bytes": self._used,
            "free_bytes": self.capacity - self._used,
            "allocations": len(self._live),
            "largest_free": max(self._free_size.values(), default=0),
            "allocs_total": self._allocs_total,
            "frees_total": self._frees_total,  # explicit frees (by id or owner)
            "expired_total": self._expired_total,
            "failed_total": self._failed_total,  # alloc calls that found no room
        }
