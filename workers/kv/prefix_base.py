"""What a worker's two prefix caches share (prefix_cache.PrefixCache for KV
blocks, snapshot_cache.SnapshotCache for caches that cannot be cut into
blocks): the one interface a worker calls, whichever it has (fetch, store,
capture, hold, take), the cache service client, back-off after a missed
deadline, lease release and the counters.

Everything here is an optimisation: a cache service that is slow, full or gone
costs reuse, never a request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

from cache_service.client import CacheUnavailable
from protos.messages import HeldBlocks
from workers.kv.block_hash import BlockHasher
from workers.kv.hot_blocks import HotBlocks

log = logging.getLogger(__name__)


@dataclass
class PrefixStats:
    lookups: int = 0
    hit_blocks: int = 0  # blocks read from the cache
    stored_blocks: int = 0  # blocks this worker wrote and committed
    failures: int = 0  # calls that failed or were refused (requests went on without reuse)
    hit_snapshots: int = 0  # snapshots read (SnapshotCache)
    stored_snapshots: int = 0  # snapshots written and committed (SnapshotCache)
    recomputed_blocks: int = 0  # hits not loaded: recomputing them was expected to be faster
    hot_blocks: int = 0  # of the hits, blocks this worker held in its own memory (no arena read)
    tail_tokens: int = 0  # tokens read from tail blocks (the ends of conversations, after their full blocks)


class RecentMin:
    """The smallest of the last `window` samples of a cost: a first-time cost
    (a GPU kernel's compilation, fresh pages) only ever adds to the true
    cost, so the minimum shakes it off after one more sample, where a mean
    would carry it for many."""

    def __init__(self, window: int = 8):
        self._samples: deque = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._samples.append(value)

    @property
    def value(self) -> Optional[float]:
        return min(self._samples) if self._samples else None


class PrefixCacheBase:
    """What both caches share: the interface, the client, back-off after a
    missed deadline, lease release. Used on the worker's MLX thread only.

    A prefill fetches the longest cached prefix of its prompt (`fetch`),
    copies the state where `snapshot_point` says (`capture`, snapshots
    only), stores what it made (`store`), and holds its leading blocks for a
    handoff by reference (`hold`: nothing held without blocks); a decode
    worker takes held blocks (`take`). Where a cache has no use for a step,
    it answers it with "nothing" rather than callers asking its kind."""

    kind = ""  # "blocks" | "snapshot": for logs and tests, never for a caller's branch
    # KV in blocks: a handoff may refer to held blocks, and a decode worker
    # stores a finished conversation's blocks (a snapshot is one whole state
    # per prompt, stored by prefill only).
    reuses_blocks = False

    def __init__(self, client, arena_buf: Callable[[str], object], hasher: BlockHasher, *,
                 lease_s: float = 30.0, ttl_s: float = 30.0, retry_after_s: float = 10.0):
        self.client = client  # lookup / release / reserve / commit (cache_service.client.CacheClient)
        self.arena_buf = arena_buf  # arena name -> its writable buffer
        self.hasher = hasher
        self.lease_s = lease_s
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.stats = PrefixStats()
        self.hot = HotBlocks(0, 0)  # no hot tier (PrefixCache's may have one)
        self._skip_until = 0.0

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    def fetch(self, tokens: Sequence[int], max_blocks: int, owner: str, per_block=None,
              compute_s_per_token: Optional[float] = None, *, salt: str = "") -> Tuple[Optional[list], int]:
        """The longest cached prefix of `tokens` within its first `max_blocks`
        blocks: (per-layer caches, tokens they hold) or (None, 0).
        `per_block`: extra bytes per block (workers.kv.block_hash.image_block_extra).
        `compute_s_per_token`: the caller's prefill cost, where a cache
        weighs loading against recomputing. `salt`: the request's cache salt
        (every call below takes it too): only entries stored under the same
        salt are found ("": the shared cache). Never raises."""
        raise NotImplementedError

    def store(self, tokens: Sequence[int], cache: Sequence, owner: str, per_block=None, host=None,
              later: Optional[Callable] = None, snapshot=None, *, salt: str = "") -> int:
        """Store what a prefill of `tokens` made that the cache service
        lacks: `cache`'s blocks (`host`, `later`: PrefixCache.store's), or
        `snapshot` (capture's). Returns the entries written. Never raises."""
        raise NotImplementedError

    def snapshot_point(self, n_tokens: int) -> int:
        """Where a prompt of `n_tokens` has its state captured (0: nowhere)."""
        return 0

    def capture(self, cache: Sequence, tokens: int):
        """A copy of the live cache at snapshot_point, for `store` (None: none)."""
        return None

    def hold(self, tokens: Sequence[int], owner: str, lease_s: float, per_block=None, *,
             salt: str = "") -> HeldBlocks:
        """For a handoff by reference: the leading full blocks of `tokens`
        the cache service has, leased to `owner` (nothing held here)."""
        return HeldBlocks()

    def take(self, hashes: Sequence[bytes], arena: str, offsets: Sequence[int], lease: int) -> list:
        """The KV of blocks a handoff holds for us; the lease is released.
        Raises when they cannot be had (here: this cache keeps no blocks)."""
        self.release(lease)
        raise ValueError(f"handoff refers to {len(hashes)} blocks; this worker's prefix cache keeps none")

    def release(self, lease: int) -> None:
        if lease is None or lease < 0:
            return
        try:
            self.client.release(lease)
        except CacheUnavailable as exc:  # the lease expires by itself
            self._unavailable(exc)

    def _available(self) -> bool:
        return time.monotonic() >= self._skip_until

    def _unavailable(self, exc: Exception) -> None:
        self.stats.failures += 1
        self._skip_until = time.monotonic() + self.retry_after_s
        log.warning("prefix cache skipped for %.0f s: %s", self.retry_after_s, exc)
