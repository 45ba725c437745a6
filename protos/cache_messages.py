"""Anyone <-> the cache service (the service binds ROUTER, clients connect
DEALER): arena reservations, and the prefix cache's KV blocks. Every call
carries a call_id; the reply echoes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# --------------------------------------------------------------------------- #
# Arena reservations (a handoff's KV) and the service's numbers
# --------------------------------------------------------------------------- #


@dataclass
class CacheAlloc:
    """Reserve `nbytes` in the arena for `owner` (a request id).

    The reservation expires after `ttl_s` unless freed first, so a holder that
    dies never leaks arena space.
    """

    call_id: int
    nbytes: int
    owner: str
    ttl_s: float = 120.0


@dataclass
class CacheAllocReply:
    call_id: int
    ok: bool
    allocation: int = -1
    offset: int = 0
    nbytes: int = 0
    arena: str = ""
    error: str = ""


@dataclass
class CacheFree:
    """Release reservations by id, or every reservation of an owner.

    `arena` (when set) must name the service's current arena: ids restart when
    the service restarts, so a free meant for the old arena is refused instead
    of releasing someone else's new reservation.
    """

    call_id: int
    allocations: list[int] = field(default_factory=list)
    owner: str = ""
    arena: str = ""


@dataclass
class CacheStats:
    call_id: int


@dataclass
class CacheReply:
    """Generic reply: ok flag, an error text, and a dict of numbers."""

    call_id: int
    ok: bool
    error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- #
# Prefix cache: KV blocks keyed by chained block hashes (same cache service socket)
# A block holds the KV of `block_size` tokens for every layer, in the layout
# workers/kv/ defines; the service only sees opaque byte ranges.
# --------------------------------------------------------------------------- #


@dataclass
class BlockRef:
    hash: bytes  # 32-byte chained block hash, never truncated
    offset: int  # in the arena named by the reply
    nbytes: int


@dataclass
class KVLookup:
    """Find the longest run of cached blocks from the start of `hashes` and
    lease them: leased blocks are never evicted until released or expired.
    With `first`, lease only the first of `hashes` that is cached: a tail
    block's candidates, longest first (workers/kv/block_hash.py)."""

    call_id: int
    hashes: list[bytes]  # chained, in prompt order (or candidates, with `first`)
    owner: str
    lease_s: float = 30.0
    first: bool = False


@dataclass
class KVLookupReply:
    call_id: int
    ok: bool
    arena: str = ""
    lease: int = -1  # give back with KVRelease (or let it expire)
    blocks: list[BlockRef] = field(default_factory=list)  # for hashes[0:len(blocks)]
    error: str = ""


@dataclass
class KVRelease:
    call_id: int
    lease: int


@dataclass
class KVReserve:
    """Phase one of a put: space for blocks not cached yet (evicting unleased
    LRU blocks if needed). Reserved blocks are invisible to lookups until
    KVCommit; a reservation not committed within `ttl_s` is dropped."""

    call_id: int
    hashes: list[bytes]
    nbytes: int  # per block
    owner: str
    ttl_s: float = 30.0


@dataclass
class KVReserveReply:
    call_id: int
    ok: bool
    arena: str = ""
    blocks: list[BlockRef] = field(default_factory=list)  # to write; cached or in-flight hashes are left out
    error: str = ""


@dataclass
class KVCommit:
    """Phase two: the reserved blocks are written; make them visible. Reply: CacheReply
    (stats: committed, unknown). With `owner` set, only that owner's reservations
    are committed: a writer whose reservation expired cannot publish the block
    another writer has since reserved and not yet written."""

    call_id: int
    hashes: list[bytes]
    owner: str = ""

