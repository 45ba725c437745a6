"""Whole-cache snapshots for models whose cache cannot be cut into blocks
(sliding window, recurrent): the whole cache state at one block boundary of
a prompt, stored as one entry and reused only when a later prompt starts
with exactly those tokens (docs/ARCHITECTURE.md, "The prefix cache").
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Callable, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from cache_service.client import CacheUnavailable
from workers.kv.block_hash import BlockHasher, Shard, block_extra, model_fingerprint
from workers.kv.cache_state import cache_dtype_name
from workers.kv.prefix_base import PrefixCacheBase
from workers.kv.snapshot import Snapshot, capture_snapshot, read_snapshot, write_snapshot

log = logging.getLogger(__name__)


# Keys of snapshots: derived from the chained block hash at the snapshot
# point, so a snapshot names its whole prefix (exact match only) and never
# collides with a block's key. Bump the version when the snapshot format
# (workers/kv/snapshot.py) changes: old entries then simply stop matching.
SNAPSHOT_KEY_VERSION = b"tandem-snapshot-v1"
# How far back from a prompt's own last boundary it looks for a snapshot:
# the previous turn's prompt, behind its answer and a new message. Each
# candidate boundary costs one round trip to the cache service (0.26 ms on
# the 2-core dev box), paid in full by every prompt that misses: 1024 tokens
# are 128 lookups (~33 ms) at 8-token boundaries, 64 at 16.
SNAPSHOT_REACH_TOKENS = 1024
# Snapshots sit at boundaries at least this far apart, whatever the block
# size: finer ones would only add lookups (each snapshot is a whole cache).
SNAPSHOT_MIN_BLOCK = 8


def snapshot_key(block_hash: bytes) -> bytes:
    return hashlib.sha256(SNAPSHOT_KEY_VERSION + block_hash).digest()


class SnapshotCache(PrefixCacheBase):
    """Whole-cache snapshots for models whose cache cannot be cut into blocks.

    Prefill makes the prompt's last block boundary b <= n-1 (at least one
    token must run to give the first token's logits) a chunk boundary,
    copies the cache state there (`capture`) and, after PrefillDone, stores
    it as ONE cache-service entry keyed by snapshot_key(h_b) (`store`: reserve
    -> write -> commit). A new prompt asks for its boundaries from the longest
    down (`fetch`: one single-hash KVLookup each, at most `max_lookups`) and
    resumes from the first snapshot found: its state is exactly that of the
    first b tokens, because the chained hash names all of them.
    Decode stores nothing (see workers.decode.engine).
    """

    kind = "snapshot"

    def __init__(self, client, arena_buf: Callable[[str], object], hasher: BlockHasher,
                 layer_classes: Sequence[str], *, max_lookups: Optional[int] = None, **kw):
        super().__init__(client, arena_buf, hasher, **kw)
        self.layer_classes = list(layer_classes)  # what make_prompt_cache gives: a snapshot must match
        if max_lookups is None:
            max_lookups = SNAPSHOT_REACH_TOKENS // self.block_size
        self.max_lookups = max(1, int(max_lookups))

    def snapshot_point(self, n_tokens: int) -> int:
        """The boundary a prompt of `n_tokens` is snapshotted at (0: none)."""
        return (n_tokens - 1) // self.block_size * self.block_size if n_tokens > 0 else 0

    def capture(self, cache: Sequence, tokens: int) -> Optional[Snapshot]:
        """Copy the live cache (holding exactly `tokens` tokens) for `store`;
        None (logged) if it cannot be copied."""
        try:
            return capture_snapshot(cache, tokens)
        except Exception:  # noqa: BLE001 - an optimisation never fails the request
            self.stats.failures += 1
            log.warning("snapshot of %d tokens failed; not stored", tokens, exc_info=True)
            return None

    # ----------------------------------------------------------------- fetch
    def fetch(self, tokens: Sequence[int], max_blocks: int, owner: str, per_block=None,
              compute_s_per_token: Optional[float] = None, *, salt: str = "") -> Tuple[Optional[list], int]:
        """The latest snapshot of a prefix of `tokens` ending at or before
        snapshot_point(len(tokens)) and the first `max_blocks` blocks:
        (per-layer caches, tokens they hold) or (None, 0). `per_block`: as
        PrefixCache.fetch's; a snapshot is always worth loading, whatever
        `compute_s_per_token`. `salt`: the request's cache salt (its chain
        seeds the snapshot keys)."""
        try:
            return self._fetch(tokens, max_blocks, owner, per_block, salt)
        except Exception:  # noqa: BLE001 - an optimisation never fails the request
            self.stats.failures += 1
            log.warning("snapshot lookup for %s failed; computing the whole prompt", owner, exc_info=True)
            return None, 0

    def _fetch(self, tokens, max_blocks, owner, per_block=None, salt=""):
        blocks = min(max_blocks, self.snapshot_point(len(tokens)) // self.block_size)
        if blocks <= 0 or not self._available():
            return None, 0
        t0 = time.perf_counter()
        hashes = self.hasher.hashes(tokens, blocks, per_block, salt)
        for k in range(len(hashes), max(0, len(hashes) - self.max_lookups), -1):
            key = snapshot_key(hashes[k - 1])
            self.stats.lookups += 1
            try:
                reply = self.client.lookup([key], owner, lease_s=self.lease_s)
            except CacheUnavailable as exc:
                self._unavailable(exc)
                return None, 0
            if not reply.ok:
                self.stats.failures += 1
                log.warning("snapshot lookup for %s refused: %s", owner, reply.error)
                return None, 0
            if not reply.blocks:
                self.release(reply.lease)  # -1 from the real service: no call
                continue
            try:
                ref = reply.blocks[0]
                if bytes(ref.hash) != key:
                    raise ValueError("lookup answered with another key")
                cache, held = read_snapshot(self.arena_buf(reply.arena), ref.offset, ref.nbytes)
            finally:
                # read_snapshot returned evaluated copies: the entry may go now.
                self.release(reply.lease)
            self._check(cache, held, k * self.block_size)
            self.stats.hit_snapshots += 1
            log.debug("snapshot hit %s: %d of %d tokens (%d bytes, %d lookups) in %.2f ms", owner, held,
                      len(tokens), ref.nbytes, len(hashes) - k + 1, (time.perf_counter() - t0) * 1000)
            return cache, held
        return None, 0

    def _check(self, cache: list, held: int, expect: int) -> None:
        """A snapshot whose key matched but whose content does not fit this
        model (a bug, never a request's fault) is not used."""
        if held != expect:
            raise ValueError(f"snapshot holds {held} tokens, its key says {expect}")
        classes = [type(c).__name__ for c in cache]
        if classes != self.layer_classes:
            raise ValueError(f"snapshot layers {classes} do not match the model's {self.layer_classes}")

    # ----------------------------------------------------------------- store
    def store(self, tokens: Sequence[int], cache: Sequence, owner: str, per_block=None, host=None,
              later=None, snapshot: Optional[Snapshot] = None, *, salt: str = "") -> int:
        """Commit `snapshot` (capture's: the state of the first
        snapshot.tokens of `tokens`) unless the cache service has it, under
        `salt` (fetch's); the live `cache` (and `host`, `later`) play no
        part. Returns 1 if written."""
        if snapshot is None:
            return 0
        try:
            return self._store(tokens, snapshot, owner, per_block, salt)
        except Exception:  # noqa: BLE001 - an optimisation never fails the request
            self.stats.failures += 1
            log.warning("snapshot store for %s failed", owner, exc_info=True)
            return 0

    def _store(self, tokens, snapshot: Snapshot, owner, per_block=None, salt=""):
        k, rest = divmod(snapshot.tokens, self.block_size)
        if k == 0 or rest or snapshot.tokens > len(tokens) or not self._available():
            return 0
        t0 = time.perf_counter()
        key = snapshot_key(self.hasher.hashes(tokens, k, per_block, salt)[-1])
        try:
            reply = self.client.reserve([key], snapshot.nbytes, owner, ttl_s=self.ttl_s)
        except CacheUnavailable as exc:
            self._unavailable(exc)
            return 0
        if not reply.ok:  # e.g. larger than the arena's free + evictable space
            self.stats.failures += 1
            log.debug("snapshot reserve for %s (%d bytes) refused: %s", owner, snapshot.nbytes, reply.error)
            return 0
        refs = [r for r in reply.blocks if bytes(r.hash) == key]
        if not refs:  # cached already, or another writer has it in flight
            return 0
        try:
            if refs[0].nbytes < snapshot.nbytes:
                raise ValueError(f"reserved {refs[0].nbytes} bytes for a {snapshot.nbytes}-byte snapshot")
            write_snapshot(self.arena_buf(reply.arena), refs[0].offset, snapshot)
            ack = self.client.commit([key], owner=owner)
        except CacheUnavailable as exc:  # (other failures: store() logs; the reservation expires)
            self._unavailable(exc)
            return 0
        if not ack.ok:
            self.stats.failures += 1
            log.warning("snapshot commit for %s refused: %s", owner, ack.error)
            return 0
        done = int(ack.stats.get("committed", 1))
        self.stats.stored_snapshots += done
        log.debug("snapshot store %s: %d tokens, %d bytes in %.2f ms", owner, snapshot.tokens,
                  snapshot.nbytes, (time.perf_counter() - t0) * 1000)
        return done


def make_snapshot_cache(model, model_dir, block_size, client, arena_buf, reason, shard: Shard | None = None, **kw):
    """Probe the model with one token (its state dtype keys the hashes; a
    cache that cannot be snapshotted shows here, not in a request)."""
    log.info("prefix cache: no block reuse for this model (%s); snapshots at %d-token boundaries instead",
             reason, block_size)
    try:
        cache = make_prompt_cache(model)
        model(mx.array([[0]], dtype=mx.int32), cache=cache)
        capture_snapshot(cache, 1)
        dtype = cache_dtype_name(cache)
    except Exception as exc:  # noqa: BLE001 - any model we cannot snapshot just runs uncached
        log.info("prefix caching off for this model: %s (%s: %s)", reason, type(exc).__name__, exc)
        return None
    hasher = BlockHasher(block_extra(model_fingerprint(model_dir), f"snapshot-{dtype}", block_size), block_size)
    hasher = hasher.for_shard(shard)
    return SnapshotCache(client, arena_buf, hasher, [type(c).__name__ for c in cache], **kw)
