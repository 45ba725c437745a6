"""The prefix cache as a worker sees it: look up the longest cached run of a
prompt's KV blocks in the cache service, read them from the arena; store the
full blocks of a prompt (or of a finished conversation) with a two-phase put.

Everything here is an optimisation: a cache service that is slow, full or gone
costs reuse, never a request.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from mlx_lm.models.cache import KVCache

from cache_service.client import CacheUnavailable
from workers.block_hash import BlockHasher, block_extra, model_fingerprint
from workers.kv_transfer import KVLayout, probe_kv_layout, read_blocks, write_blocks

log = logging.getLogger(__name__)


@dataclass
class PrefixStats:
    lookups: int = 0
    hit_blocks: int = 0  # blocks read from the cache
    stored_blocks: int = 0  # blocks this worker wrote and committed
    failures: int = 0  # calls that failed or were refused (requests went on without reuse)


class PrefixCache:
    """Reads and writes prefix-cache blocks through the cache service.

    fetch: hashes -> lookup (leased) -> read_blocks -> release at once.
    store: hashes -> reserve (the service names the blocks it lacks) ->
           write_blocks -> commit.

    Prefix caching is an optimisation, so nothing here fails a request: every
    failure is logged and means "nothing reused" or "nothing stored". After
    the service misses a deadline, calls are skipped for `retry_after_s`, so
    a dead service costs one timeout rather than one per request.
    One per worker process, used on its MLX thread only.
    """

    def __init__(self, client, arena_buf: Callable[[str], object], hasher: BlockHasher,
                 layout: KVLayout, *, lease_s: float = 30.0, ttl_s: float = 30.0,
                 retry_after_s: float = 10.0):
        if hasher.block_size != layout.block_size:
            raise ValueError("hasher and layout disagree on the block size")
        self.client = client  # lookup / release / reserve / commit (cache_service.client.CacheClient)
        self.arena_buf = arena_buf  # arena name -> its writable buffer
        self.hasher = hasher
        self.layout = layout
        self.lease_s = lease_s
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.stats = PrefixStats()
        self._skip_until = 0.0

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    # ----------------------------------------------------------------- fetch
    def fetch(self, tokens: Sequence[int], max_blocks: int, owner: str) -> Tuple[Optional[List[KVCache]], int]:
        """KV of the longest cached run among the first `max_blocks` full
        blocks of `tokens`: (per-layer caches, tokens they hold) or (None, 0)."""
        try:
            return self._fetch(tokens, max_blocks, owner)
        except Exception:  # noqa: BLE001 - an optimisation never fails the request
            self.stats.failures += 1
            log.warning("prefix lookup for %s failed; computing the whole prompt", owner, exc_info=True)
            return None, 0

    def _fetch(self, tokens, max_blocks, owner):
        hashes = self.hasher.hashes(tokens, max_blocks)
        if not hashes or not self._available():
            return None, 0
        t0 = time.perf_counter()
        self.stats.lookups += 1
        try:
            reply = self.client.lookup(hashes, owner, lease_s=self.lease_s)
        except CacheUnavailable as exc:
            self._unavailable(exc)
            return None, 0
        if not reply.ok:
            self.stats.failures += 1
            log.warning("prefix lookup for %s refused: %s", owner, reply.error)
            return None, 0
        try:
            refs = self._usable(reply.blocks, hashes)
            if not refs:
                return None, 0
            cache = read_blocks(self.arena_buf(reply.arena), [r.offset for r in refs], self.layout)
        finally:
            # read_blocks returned evaluated copies: the blocks may go now.
            self._release(reply.lease)
        self.stats.hit_blocks += len(refs)
        log.debug("prefix hit %s: %d of %d blocks (%d tokens, %d bytes) in %.2f ms", owner, len(refs),
                  len(hashes), len(refs) * self.block_size, len(refs) * self.layout.block_nbytes,
                  (time.perf_counter() - t0) * 1000)
        return cache, len(refs) * self.block_size

    def _usable(self, blocks: Sequence, hashes: List[bytes]) -> list:
        """The leading blocks that answer our hashes with our block size."""
        refs = []
        for ref, h in zip(blocks, hashes):
            if bytes(ref.hash) != h:
                log.warning("prefix lookup answered block %d with another hash; using %d blocks", len(refs), len(refs))
                break
            if ref.nbytes != self.layout.block_nbytes:
                log.warning("prefix block of %d bytes, expected %d; using %d blocks", ref.nbytes,
                            self.layout.block_nbytes, len(refs))
                break
            refs.append(ref)
        return refs

    def _release(self, lease: int) -> None:
        if lease is None or lease < 0:
            return
        try:
            self.client.release(lease)
        except CacheUnavailable as exc:  # the lease expires by itself
            self._unavailable(exc)

    # ----------------------------------------------------------------- store
    def store(self, tokens: Sequence[int], cache: Sequence, owner: str) -> int:
        """Commit every full block of `tokens` that `cache` holds and the
        cache service lacks. `tokens` must be exactly the tokens whose KV the
        cache holds, from position 0 (a wrong token here would poison the
        cache for every later request). Returns the blocks written."""
        try:
            return self._store(tokens, cache, owner)
        except Exception:  # noqa: BLE001 - an optimisation never fails the request
            self.stats.failures += 1
            log.warning("prefix store for %s failed", owner, exc_info=True)
            return 0

    def _store(self, tokens, cache, owner):
        held = min(min(c.offset for c in cache), len(tokens))
        hashes = self.hasher.hashes(tokens, held // self.block_size)
        if not hashes or not self._available():
            return 0
        t0 = time.perf_counter()
        nbytes = self.layout.block_nbytes
        try:
            reply = self.client.reserve(hashes, nbytes, owner, ttl_s=self.ttl_s)
        except CacheUnavailable as exc:
            self._unavailable(exc)
            return 0
        if not reply.ok:  # e.g. the arena is full of leased blocks: skip this time
            self.stats.failures += 1
            log.debug("prefix reserve for %s refused: %s", owner, reply.error)
            return 0
        index = {h: i for i, h in enumerate(hashes)}
        todo = sorted(((index[bytes(r.hash)], r) for r in reply.blocks if bytes(r.hash) in index),
                      key=lambda item: item[0])
        if not todo:
            return 0
        try:
            if any(r.nbytes < nbytes for _, r in todo):
                raise ValueError(f"reserved blocks smaller than {nbytes} bytes")
            buf = self.arena_buf(reply.arena)
            for run in _consecutive_runs(todo):
                write_blocks(buf, [r.offset for _, r in run], cache, run[0][0], self.layout)
            # With our owner: a reservation of ours that expired meanwhile (and
            # was re-reserved by another writer) is not published by us.
            ack = self.client.commit([r.hash for _, r in todo], owner=owner)
        except CacheUnavailable as exc:  # (other failures: store() logs; the reservation expires)
            self._unavailable(exc)
            return 0
        if not ack.ok:
            self.stats.failures += 1
            log.warning("prefix commit for %s refused: %s", owner, ack.error)
            return 0
        # Fewer when a reservation expired before the commit (a very slow write).
        done = int(ack.stats.get("committed", len(todo)))
        self.stats.stored_blocks += done
        log.debug("prefix store %s: %d of %d blocks new (%d bytes) in %.2f ms", owner, done, len(hashes),
                  len(todo) * nbytes, (time.perf_counter() - t0) * 1000)
        return done

    # ------------------------------------------------------------ back-off
    def _available(self) -> bool:
        return time.monotonic() >= self._skip_until

    def _unavailable(self, exc: Exception) -> None:
        self.stats.failures += 1
        self._skip_until = time.monotonic() + self.retry_after_s
        log.warning("prefix cache skipped for %.0f s: %s", self.retry_after_s, exc)


def _consecutive_runs(indexed: list) -> List[list]:
    """[(block index, ref), ...] sorted -> runs of consecutive block indices."""
    runs: List[list] = []
    for item in indexed:
        if runs and runs[-1][-1][0] + 1 == item[0]:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def make_prefix_cache(model, model_dir: str, block_size: int, client,
                      arena_buf: Callable[[str], object], **kw) -> Optional[PrefixCache]:
    """The prefix cache for this model, or None (logged once, with the reason)
    when its cache cannot be cut into blocks. Caches of that kind (sliding
    window, recurrent) need snapshots reused on exact prefix matches instead:
    a later step."""
    if block_size < 1:
        log.info("prefix caching off: block size %d", block_size)
        return None
    if not all(hasattr(client, m) for m in ("lookup", "release", "reserve", "commit")):
        log.warning("prefix caching off: this cache client has no prefix-cache calls")
        return None
    try:
        layout = probe_kv_layout(model, block_size)
    except TypeError as exc:
        log.info("prefix caching off for this model: %s (no block reuse; snapshots are not built yet)", exc)
        return None
    hasher = BlockHasher(block_extra(model_fingerprint(model_dir), layout.dtype, block_size), block_size)
    log.info("prefix cache: %d-token blocks of %d bytes (%s KV)", block_size, layout.block_nbytes, layout.dtype)
    return PrefixCache(client, arena_buf, hasher, layout, **kw)
