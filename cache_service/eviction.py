"""Which range of the arena to empty for something bigger than a block (a
handoff).

Free bytes only help when contiguous, so evicting in plain LRU order could
empty the cache without ever opening a large enough hole. The block index
(block_index.py) prices each segment of the arena; this picks the range to
evict. Apart from the index because it is a pure choice over those prices,
testable without an arena.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence


def coldest_window(lengths: Sequence[int], costs: Sequence[Optional[int]], size: int) -> Optional[tuple[int, int]]:
    """Among all runs of consecutive segments (their byte `lengths`) that
    hold at least `size` bytes, the one whose newest block is the oldest
    (fewest evicted bytes on ties): (first, last) segment index, or None.
    A segment's cost is -1 for free space, its block's last use for an
    evictable block, None for what must stay (nothing spans it)."""
    best = None  # ((newest use, evicted bytes), first, last)
    first = 0
    span = evicted = 0
    newest: deque[int] = deque()  # indexes in [first, last], their costs decreasing
    for last, length in enumerate(lengths):
        cost = costs[last]
        if cost is None:  # a barrier: nothing spans it
            first, span, evicted = last + 1, 0, 0
            newest.clear()
            continue
        span += length
        evicted += length if cost >= 0 else 0
        while newest and costs[newest[-1]] <= cost:
            newest.pop()
        newest.append(last)
        # Shrink from the left while the window still fits.
        while span - lengths[first] >= size:
            span -= lengths[first]
            evicted -= lengths[first] if costs[first] >= 0 else 0
            first += 1
            if newest[0] < first:
                newest.popleft()
        if span >= size:
            key = (costs[newest[0]], evicted)
            if best is None or key < best[0]:
                best = (key, first, last)
    return None if best is None else best[1:]
