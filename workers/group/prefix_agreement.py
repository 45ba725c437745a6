"""The prefix cache of a worker group's rank: its own shard of every block,
and hits the ranks agree on.

Each rank keeps its shard of a block (its KV heads; pipeline parallel: its
layers) in the host's one cache service under a key of its own
(workers/kv/block_hash.py `shard_extra`), and looks its prompts up there
itself. What the cache holds may differ between
ranks: a block one rank lost to eviction, a store that failed on one, a hot
tier or a load-or-recompute call (timed per rank) that went another way. The
one cache decision that changes the work a rank runs is how many prompt
tokens a hit skips: a rank that skipped more would run fewer or shorter
chunks, and the group's collectives would hang. So every lookup ends in an
agreement, on every rank:

- each rank finds its own hit, then the group takes the smallest and the
  largest (one `all_min`, `agree_hit`); equal: that is the hit;
- a rank above the smallest cuts its hit down to it (KV blocks: the first
  tokens of what it read, exact for any shorter prefix; a snapshot: the
  latest one at or before it, looked up again) and the group checks again.
  The largest hit falls at every round, so it ends, at worst at 0 (compute
  the whole prompt), which every rank can do.

Why an agreement in the lockstep rather than rank 0 deciding: rank 0's hit
cannot bind a follower that lacks one of its blocks; the smallest binds
every rank. It is safe against deadlock because `fetch` runs at the same
point of the same unit on every rank (the followers replay rank 0's loop:
workers/group/lockstep.py), whether to agree at all depends on the request
alone, and the inner lookup never raises, so every rank enters the same
collective. Everything else the cache decides per rank issues no collective
(stores, the hot tier, a decode worker's commit of a finished
conversation: host copies and cache-service calls only) and only changes
what this rank's cache holds, which the next lookup's agreement absorbs.
`hold` leases nothing: a split group's handoff carries each rank's whole
shard (workers/group/handoff_shards.py), as how much it referred to would
otherwise differ per rank (and with it how many prompts a batch takes).

What the router sees of the cache (hello's counters, cached_tokens in
PrefillDone) is rank 0's, whose hit is the agreed one.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence, Tuple

import mlx.core as mx

from protos.messages import HeldBlocks
from workers.kv.block_hash import Shard
from workers.kv.hot_blocks import first_tokens

log = logging.getLogger(__name__)


def min_and_max(value: int, group) -> Tuple[int, int]:
    """The smallest and the largest of `value` over the group's ranks (one
    collective: every rank must call it at the same point)."""
    both = mx.distributed.all_min(mx.array([value, -value], dtype=mx.int32), group=group)
    low, neg_high = both.tolist()
    return int(low), -int(neg_high)


def agree_hit(cache, hit: int, extremes: Callable[[int], Tuple[int, int]],
              cut: Callable[[int], tuple]) -> tuple:
    """(cache, hit) agreed by every rank: `extremes(hit)` gives the group's
    smallest and largest hit (a collective), `cut(n)` this rank's cache
    holding at most the first n tokens, as (cache, hit). Ends: the largest
    hit falls at every round that disagrees."""
    while True:
        low, high = extremes(hit)
        if low == high:
            return cache, hit
        if hit > low:
            cache, hit = cut(low)
            if hit > low:  # a cut that did not: compute the whole prompt rather than loop
                cache, hit = None, 0


def first_tokens_of(cache: Sequence, n: int) -> tuple:
    """Per-layer plain KV caches cut to their first `n` tokens: (caches, n),
    (None, 0) for none."""
    if n <= 0:
        return None, 0
    return [first_tokens(c, n) for c in cache], n


class GroupPrefixCache:
    """A rank's prefix cache: `inner` (this rank's PrefixCache or
    SnapshotCache, keyed by its shard: `group_prefix` makes it so) behind
    the interface of workers.kv.prefix_base.PrefixCacheBase, with `fetch`'s
    hit agreed by the group and `hold` leasing nothing. Every other call is
    this rank's own, named here one by one: the interface's, and the block
    writes a PrefixCache adds (a decode worker's commit, the store thread's
    writes), which issue no collective."""

    def __init__(self, inner, group):
        self.inner = inner
        self.group = group

    # What the cache is and counts: the inner's.
    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def reuses_blocks(self) -> bool:
        return self.inner.reuses_blocks

    @property
    def block_size(self) -> int:
        return self.inner.block_size

    @property
    def hasher(self):
        return self.inner.hasher

    @property
    def stats(self):
        return self.inner.stats

    @property
    def hot(self):
        return self.inner.hot

    @property
    def layout(self):  # a PrefixCache's block layout
        return self.inner.layout

    # The lookup, agreed; a hold, none.
    def fetch(self, tokens: Sequence[int], max_blocks: int, owner: str, per_block=None,
              compute_s_per_token: Optional[float] = None, *, salt: str = "") -> tuple:
        inner = self.inner
        # No full block within reach: no rank can hit (a fact of the request,
        # the same on every rank), so nothing to agree on.
        if min(max_blocks, len(tokens) // inner.block_size) <= 0:
            return None, 0
        cache, hit = inner.fetch(tokens, max_blocks, owner, per_block, compute_s_per_token, salt=salt)

        def cut(n: int) -> tuple:
            if inner.kind == "blocks":
                return first_tokens_of(cache, n)
            return inner.fetch(tokens, n // inner.block_size, owner, per_block, compute_s_per_token, salt=salt)

        agreed = agree_hit(cache, hit, lambda h: min_and_max(h, self.group), cut)
        if agreed[1] != hit:
            log.debug("prefix hit %s: %d tokens here, %d agreed by the group", owner, hit, agreed[1])
        return agreed

    def hold(self, tokens, owner: str, lease_s: float, per_block=None, *, salt: str = "") -> HeldBlocks:
        return HeldBlocks()

    # Everything else: this rank's own cache.
    def store(self, tokens: Sequence[int], cache: Sequence, owner: str, per_block=None, host=None,
              later: Optional[Callable] = None, snapshot=None, *, salt: str = "") -> int:
        return self.inner.store(tokens, cache, owner, per_block, host, later, snapshot, salt=salt)

    def snapshot_point(self, n_tokens: int) -> int:
        return self.inner.snapshot_point(n_tokens)

    def capture(self, cache: Sequence, tokens: int):
        return self.inner.capture(cache, tokens)

    def take(self, hashes, arena: str, offsets, lease: int) -> list:
        return self.inner.take(hashes, arena, offsets, lease)

    def release(self, lease: int) -> None:
        self.inner.release(lease)

    def prepare_store(self, tokens: Sequence[int], cache: Sequence, owner: str, per_block=None, host=None,
                      tail: bool = False, *, salt: str = ""):
        return self.inner.prepare_store(tokens, cache, owner, per_block, host, tail, salt=salt)

    def finish_store(self, prepared) -> int:
        return self.inner.finish_store(prepared)

    def detach(self, prepared) -> None:
        self.inner.detach(prepared)

    def write_store(self, prepared, client=None) -> int:
        return self.inner.write_store(prepared, client=client)


def group_prefix(prefix, group):
    """The prefix cache of this rank of `group` over `prefix` (this rank's
    PrefixCache or SnapshotCache, made keyed by its shard: `rank_shard`; or
    None), or None unless every rank has one (one collective, at load: every
    rank loads alike)."""
    have, _ = min_and_max(int(prefix is not None), group)
    if not have:
        if prefix is not None:
            log.info("prefix caching off: another rank of the group has none")
        return None
    return GroupPrefixCache(prefix, group)


def rank_shard(group, pipeline: bool = False) -> Shard:
    """The share of every block this rank keeps (its heads, or with
    `pipeline` its layers), which keys its prefix cache's blocks."""
    return Shard(group.rank(), group.size(), "pipeline" if pipeline else "tensor")
