"""Leases: which blocks a reader holds, until when.

A lookup leases the blocks it returns so that none is evicted while its
holder copies it; the holder releases the lease, or its deadline ends it (a
holder that died never pins the cache). Apart from the block index
(block_index.py), which counts each block's leases, because the table of
leases and their deadlines is a clock's concern, not the arena's.
"""

from __future__ import annotations

import heapq
import secrets
from dataclasses import dataclass, field
from typing import Iterator, Optional


@dataclass(eq=False)
class Lease:
    id: int
    owner: str
    deadline: float
    hashes: list = field(default_factory=list)


class Leases:
    """The live leases by id, with a heap of their deadlines (a lease
    released early is skipped there lazily)."""

    def __init__(self, first_id: Optional[int] = None):
        self._live: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap
        # Ids start at a random point: the service restarts with fresh ids,
        # and a stale holder's release must not end someone else's new lease.
        self._next = first_id if first_id is not None else 1 + secrets.randbelow(1 << 40)

    def grant(self, owner: str, deadline: float, hashes: list) -> Lease:
        lease = Lease(self._next, owner, deadline, hashes)
        self._next += 1
        self._live[lease.id] = lease
        heapq.heappush(self._deadlines, (deadline, lease.id))
        return lease

    def pop(self, lease_id: int) -> Optional[Lease]:
        """End a lease: it, or None if unknown (released already, or expired)."""
        return self._live.pop(lease_id, None)

    def expire(self, now: float) -> list[Lease]:
        """End the leases past their deadline, and return them."""
        gone = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, lease_id = heapq.heappop(self._deadlines)
            lease = self._live.pop(lease_id, None)  # None: released earlier
            if lease is not None:
                gone.append(lease)
        return gone

    def next_deadline(self) -> Optional[float]:
        while self._deadlines and self._deadlines[0][1] not in self._live:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[int]:
        return iter(self._live)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._live
