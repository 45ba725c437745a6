"""The cache side, in memory: one fake of the cache service's client calls
and one of the embedding store a vision prefill reads.

`FakeCacheService` answers the calls workers make on
cache_service.client.CacheClient (lookup / release / reserve / commit for
prefix blocks and snapshots, alloc / free for handoffs, stats, close) over one
bytearray, its arena, with the semantics the real service promises. Tests look
at what it holds (`blocks`, `reserved`, `leases`, `allocations`), at what came
back (`released`, `freed`), at the calls in order (`calls`), and can make every
call time out (`fail = True`).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cache_service.client import CacheUnavailable
from protos.messages import BlockRef, CacheAllocReply, CacheReply, KVLookupReply, KVReserveReply


@dataclass
class _Reserved:
    hash: bytes
    offset: int
    nbytes: int
    owner: str


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


class FakeCacheService:
    """The cache service's client calls, in memory, over one bytearray.

    Same semantics the real service promises: lookup leases the longest
    committed run from hashes[0]; reserve hands out space only for hashes
    neither committed nor in flight; commit makes reserved blocks visible;
    alloc carves a handoff's bytes (from the arena's end: blocks fill it
    from the start). `fail = True` makes every call time out.

    `strict_leases`: releasing a lease this fake never handed out (or one
    already released) fails the test; off for a decode worker's side, whose
    handoffs carry leases a prefill worker's lookups took.
    """

    arena = "fake-arena"

    def __init__(self, nbytes: int = 32 << 20, *, strict_leases: bool = True):
        self.buf = bytearray(nbytes)
        self.blocks: dict[bytes, BlockRef] = {}
        self.reserved: dict[bytes, _Reserved] = {}
        self.leases: dict[int, int] = {}
        self.allocations: dict[int, CacheAllocReply] = {}
        self.released: list[int] = []
        self.freed: list[int] = []
        self.next_offset = 0  # blocks, upwards
        self.alloc_end = nbytes  # handoffs, downwards
        self.next_lease = 1
        self.next_allocation = 0
        self.strict_leases = strict_leases
        self.fail = False
        self.closed = False
        self.calls: list[str] = []

    def buffer(self, arena: str):
        """The arena's writable buffer (what a worker's attachment gives)."""
        assert arena == self.arena
        return self.buf

    def _maybe_fail(self, name):
        self.calls.append(name)
        if self.fail:
            raise CacheUnavailable(f"fake: no reply to {name}")

    # ------------------------------------------------------------ blocks --
    def lookup(self, hashes, owner, lease_s=30.0, first=False):
        self._maybe_fail("lookup")
        refs = []
        for h in hashes:
            if h not in self.blocks:
                if first:
                    continue
                break
            refs.append(self.blocks[h])
            if first:
                break
        lease = self.next_lease
        self.next_lease += 1
        self.leases[lease] = len(refs)
        return KVLookupReply(call_id=0, ok=True, arena=self.arena, lease=lease, blocks=refs)

    def release(self, lease):
        if lease < 0:  # nothing leased: the real client sends nothing
            return None
        self._maybe_fail("release")
        self.released.append(lease)
        if self.strict_leases or lease in self.leases:
            self.leases.pop(lease)
        return CacheReply(call_id=0, ok=True)

    def reserve(self, hashes, nbytes, owner, ttl_s=30.0):
        self._maybe_fail("reserve")
        out = []
        for h in hashes:
            if h in self.blocks or h in self.reserved:
                continue
            if self.next_offset + nbytes > self.alloc_end:
                return KVReserveReply(call_id=0, ok=False, error="full")
            ref = BlockRef(hash=h, offset=self.next_offset, nbytes=nbytes)
            self.next_offset += _aligned(nbytes)
            self.reserved[h] = _Reserved(h, ref.offset, nbytes, owner)
            out.append(ref)
        return KVReserveReply(call_id=0, ok=True, arena=self.arena, blocks=out)

    def commit(self, hashes, owner=""):
        self._maybe_fail("commit")
        for h in hashes:
            assert owner and self.reserved[h].owner == owner  # workers always commit as the reserving owner
            ref = self.reserved.pop(h)
            self.blocks[h] = BlockRef(hash=ref.hash, offset=ref.offset, nbytes=ref.nbytes)
        return CacheReply(call_id=0, ok=True, stats={"committed": len(hashes), "unknown": 0})

    # ---------------------------------------------------------- handoffs --
    def alloc(self, nbytes, owner, ttl_s=30.0):
        self._maybe_fail("alloc")
        start = (self.alloc_end - nbytes) // 64 * 64
        if start < self.next_offset:
            return CacheAllocReply(call_id=0, ok=False, error="cache arena full")
        self.alloc_end = start
        reply = CacheAllocReply(call_id=0, ok=True, allocation=self.next_allocation, offset=start, nbytes=nbytes,
                                arena=self.arena)
        self.allocations[reply.allocation] = reply
        self.next_allocation += 1
        return reply

    def free(self, allocations=None, owner=None, arena=None, wait=True):
        """Unknown ids are fine, as in the service (freed already, or expired)."""
        self._maybe_fail("free")
        ids = list(allocations or [])
        self.freed += ids
        for i in ids:
            self.allocations.pop(i, None)
        return CacheReply(call_id=0, ok=True) if wait else None

    def stats(self) -> dict:
        self._maybe_fail("stats")
        return {"blocks": len(self.blocks), "reserved": len(self.reserved), "leases": len(self.leases),
                "handoffs": len(self.allocations)}

    def close(self) -> None:
        self.closed = True


class FakeEmbeddingStore:
    """The cache service's embedding store as prefill sees it: float32 rows
    of `feature_dim` columns by content hash (workers/vision/embeddings.py).
    `gets` records the width of every row asked for."""

    def __init__(self):
        self.rows, self.gets = {}, []

    def get(self, content_hash, n_tokens, hidden, owner):
        self.gets.append(hidden)
        data = self.rows.get(content_hash)
        return None if data is None else mx.array(data.reshape(n_tokens, hidden))

    def put(self, content_hash, features, owner):
        self.rows[content_hash] = np.array(features.astype(mx.float32)).reshape(-1)
        return True
