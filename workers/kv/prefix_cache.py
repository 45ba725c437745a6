"""The prefix cache as a worker sees it: look up the longest cached run of a
prompt's KV blocks in the cache service, read them from the arena, hold them
for a handoff by reference; store the full blocks of a prompt (or of a
finished conversation) with a two-phase put (prefix_writes.py, the store
half).

Models whose cache cannot be cut into blocks (sliding window, recurrent) get
`SnapshotCache` instead (snapshot_cache.py); `make_prefix_cache` picks.

Everything here is an optimisation: a cache service that is slow, full or gone
costs reuse, never a request.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from cache_service.client import CacheUnavailable
from protos.messages import HeldBlocks
from workers.kv.block_hash import BlockHasher, Shard, block_extra, model_fingerprint
from workers.kv.blocks import KVLayout, probe_kv_layout, read_blocks, read_blocks_stacked, unblockable_reason
from workers.kv.hot_blocks import HotBlocks, block_of, caches_of, concat_blocks, first_tokens
from workers.kv.prefix_base import PrefixCacheBase, RecentMin
from workers.kv.prefix_writes import PrefixWrites
from workers.kv.snapshot_cache import SNAPSHOT_MIN_BLOCK, make_snapshot_cache

log = logging.getLogger(__name__)


class PrefixCache(PrefixWrites, PrefixCacheBase):
    """Reads and writes prefix-cache blocks through the cache service.

    fetch: hashes -> lookup (leased) -> read_blocks -> release at once.
    store: hashes -> reserve (the service names the blocks it lacks) ->
           the arena copy (prepare_store, finish_store) -> commit
           (PrefixWrites, prefix_writes.py).

    Prefix caching is an optimisation, so nothing here fails a request: every
    failure is logged and means "nothing reused" or "nothing stored". After
    the service misses a deadline, calls are skipped for `retry_after_s`, so
    a dead service costs one timeout rather than one per request.
    One per worker process, used on its MLX thread only, but for
    `write_store` of host copies (a prefill worker's store thread).
    """

    kind = "blocks"
    reuses_blocks = True

    REPROBE = 8

    def __init__(self, client, arena_buf: Callable[[str], object], hasher: BlockHasher,
                 layout: KVLayout, hot_bytes: int = 0, **kw):
        if hasher.block_size != layout.block_size:
            raise ValueError("hasher and layout disagree on the block size")
        super().__init__(client, arena_buf, hasher, **kw)
        self.layout = layout
        # Blocks this worker used lately, as MLX arrays (workers/kv/hot_blocks.py).
        self.hot = HotBlocks.for_layout(hot_bytes, layout)
        # Seconds to read one block into MLX arrays, recent reads. On a CPU a
        # block loads ~100x faster than its tokens compute; on a fast GPU
        # with a small model, recomputing a prefix can beat moving its KV
        # through host memory.
        self.load_cost = RecentMin()
        self._unread_hits = 0  # hits left unread since the last read

    # ----------------------------------------------------------------- fetch
    def fetch(self, tokens: Sequence[int], max_blocks: int, owner: str, per_block=None,
              compute_s_per_token: Optional[float] = None, *, salt: str = "") -> Tuple[Optional[List[KVCache]], int]:
        """KV of the longest cached run among the first `max_blocks` full
        blocks of `tokens`: (per-layer caches, tokens they hold) or (None, 0).
        `per_block`: extra bytes per block (workers.kv.block_hash.image_block_extra).
        `compute_s_per_token`: the caller's prefill cost; a hit whose
        estimated load time exceeds recomputing it is left unread. `salt`:
        the request's cache salt (PrefixCacheBase.fetch)."""
        try:
            return self._fetch(tokens, max_blocks, owner, per_block, compute_s_per_token, salt)
        except Exception:  # noqa: BLE001 - an optimisation never fails the request
            self.stats.failures += 1
            log.warning("prefix lookup for %s failed; computing the whole prompt", owner, exc_info=True)
            return None, 0

    def _fetch(self, tokens, max_blocks, owner, per_block=None, compute_s_per_token=None, salt=""):
        hashes = self.hasher.hashes(tokens, max_blocks, per_block, salt)
        if not hashes:
            return None, 0
        t0 = time.perf_counter()
        self.stats.lookups += 1
        # The leading blocks this worker holds need no lookup and no read
        # (and no cache service: they serve even while it is away).
        n_hot = self.hot.leading(hashes)
        blocks = [self.hot.get(h) for h in hashes[:n_hot]]
        # A tail block may follow the run, up to the prompt's last token
        # (which always runs: its logits give the first token); not with images.
        tail_end = len(tokens) - 1 if per_block is None else None
        n_read = k = 0
        if self._available():
            read, n_read, k = self._read_run(tokens, hashes, n_hot, owner, compute_s_per_token, tail_end)
            if read is not None and not self.hot.enabled:  # per-layer caches, as read
                held = n_read * self.block_size + k
                self.stats.hit_blocks += n_read
                self.stats.tail_tokens += k
                return [first_tokens(c, held) for c in read], held
            if read is not None:
                self._keep(hashes[n_hot:n_hot + n_read], *read)
                blocks.append(read)
        n = n_hot + n_read
        if n == 0:
            return None, 0
        self.hot.touch(hashes[:n])
        self.stats.hit_blocks += n
        self.stats.hot_blocks += n_hot
        self.stats.tail_tokens += k
        held = n * self.block_size + k
        log.debug("prefix hit %s: %d of %d blocks (%d from this worker's memory) and a tail of %d (%d tokens) "
                  "in %.2f ms", owner, n, len(hashes), n_hot, k, held, (time.perf_counter() - t0) * 1000)
        keys, values = concat_blocks(blocks)
        return caches_of(keys[:, :, :held], values[:, :, :held]), held

    def _read_run(self, tokens, hashes, n_hot, owner, compute_s_per_token=None, tail_end=None):
        """The longest run of hashes[n_hot:] the cache service has, and the
        tail block after it (when `tail_end` is given: the longest that fits
        before it), read from the arena in one go: (stacked (keys, values)
        when the hot tier is on, else per-layer caches; blocks read; tail
        tokens read), or (None, 0, 0) when there is nothing (worth) reading.
        The read may hold a tail block's unused positions past those."""
        leases, arena, refs = [], "", []
        try:
            if n_hot < len(hashes):
                reply = self.client.lookup(hashes[n_hot:], owner, lease_s=self.lease_s)
                if not reply.ok:
                    self.stats.failures += 1
                    log.warning("prefix lookup for %s refused: %s", owner, reply.error)
                    return None, 0, 0
                leases.append(reply.lease)
                arena = reply.arena
                refs = self._usable(reply.blocks, hashes[n_hot:])
                if refs and not self._worth_loading(len(refs), compute_s_per_token):
                    self.stats.recomputed_blocks += len(refs)
                    log.debug("prefix hit %s: %d blocks left unread (load %.2f ms/block, compute %.3f ms/token)",
                              owner, len(refs), self.load_cost.value * 1000, compute_s_per_token * 1000)
                    return None, 0, 0
            n, k, offsets = n_hot + len(refs), 0, [r.offset for r in refs]
            if tail_end is not None and n > 0 and self._tail_worth_looking(compute_s_per_token):
                reply, k = self._lookup_tail(tokens, hashes[n - 1], n * self.block_size, tail_end, owner)
                if reply is not None:
                    leases.append(reply.lease)
                if k:
                    arena = reply.arena
                    offsets.append(reply.blocks[0].offset)
            if not offsets:
                return None, 0, 0
            t_read = time.perf_counter()
            read = self._read(arena, offsets)
            self.load_cost.add((time.perf_counter() - t_read) / len(offsets))
            return read, len(refs), k
        except CacheUnavailable as exc:
            self._unavailable(exc)
            return None, 0, 0
        finally:
            # The read copied the blocks out of the arena: they may go now.
            for lease in leases:
                self.release(lease)

    def _lookup_tail(self, tokens, parent: bytes, start: int, end: int, owner: str):
        """The longest tail block after `parent` within tokens[start:end] that
        the cache service has, leased: (its reply, its tokens); the reply is
        None when nothing was asked or it failed, the tokens 0 for no tail."""
        candidates = self.hasher.tail_keys(tokens, parent, start, end)
        if not candidates:
            return None, 0
        reply = self.client.lookup([key for _, key in candidates], owner, lease_s=self.lease_s, first=True)
        if not reply.ok:
            return None, 0
        lengths = {key: k for k, key in candidates}
        ref = reply.blocks[0] if reply.blocks else None
        if ref is None or ref.nbytes != self.layout.block_nbytes:
            return reply, 0
        return reply, lengths.get(bytes(ref.hash), 0)

    def _tail_worth_looking(self, compute_s_per_token: Optional[float]) -> bool:
        """A tail saves half a block's tokens on average, for a round trip
        and a block's read: looked for unless both costs are known and the
        read alone costs more (a fast GPU with a small model)."""
        load = self.load_cost.value
        if load is None or not compute_s_per_token:
            return True
        return load <= (self.block_size - 1) / 2 * compute_s_per_token

    def _read(self, arena: str, offsets: Sequence[int]):
        if self.hot.enabled:
            return read_blocks_stacked(self.arena_buf(arena), offsets, self.layout)
        return read_blocks(self.arena_buf(arena), offsets, self.layout)

    def _keep(self, hashes: Sequence[bytes], *read) -> None:
        """Blocks just read from the arena (stacked keys, values) into the hot tier."""
        if not self.hot.enabled or not hashes:
            return
        keys, values = read
        bs = self.block_size
        kept = [block_of(keys, values, j * bs, (j + 1) * bs) for j in range(len(hashes))]
        mx.eval(kept)
        for h, (k, v) in zip(hashes, kept):
            self.hot.put(h, k, v)
        self.hot.touch(hashes)

    # --------------------------------------------------------------- handoff
    def hold(self, tokens: Sequence[int], owner: str, lease_s: float, per_block=None, *,
             salt: str = "") -> HeldBlocks:
        """For a handoff by reference: the leading full blocks of `tokens`
        that the cache service has, leased to `owner` for `lease_s` so that
        none is evicted before decode takes them (no blocks when the service
        is away or has none). `per_block`, `salt`: as fetch's (a prompt with
        images; the request's cache salt)."""
        hashes = self.hasher.hashes(tokens, len(tokens) // self.block_size, per_block, salt)
        if not hashes or not self._available():
            return HeldBlocks()
        try:
            reply = self.client.lookup(hashes, owner, lease_s=lease_s)
        except CacheUnavailable as exc:
            self._unavailable(exc)
            return HeldBlocks()
        if not reply.ok:
            self.stats.failures += 1
            return HeldBlocks()
        refs = self._usable(reply.blocks, hashes)
        if not refs:
            self.release(reply.lease)
            return HeldBlocks()
        return HeldBlocks([bytes(r.hash) for r in refs], [int(r.offset) for r in refs], reply.arena,
                          int(reply.lease), len(refs) * self.block_size)

    def take(self, hashes: Sequence[bytes], arena: str, offsets: Sequence[int], lease: int):
        """The KV of blocks a handoff holds for us (`hold` in the prefill
        worker): those in the hot tier from there, the others read from the
        arena at `offsets`; then the lease is released. Per-layer caches;
        raises when a block cannot be had (the request fails)."""
        try:
            if len(offsets) != len(hashes):
                raise ValueError(f"{len(hashes)} block hashes, {len(offsets)} offsets")
            if not self.hot.enabled:
                return read_blocks(self.arena_buf(arena), offsets, self.layout)
            have = {h: self.hot.get(h) for h in hashes if h in self.hot}
            missing = [j for j, h in enumerate(hashes) if h not in have]
            if missing:
                keys, values = read_blocks_stacked(self.arena_buf(arena), [offsets[j] for j in missing], self.layout)
                bs = self.block_size
                read = [block_of(keys, values, i * bs, (i + 1) * bs) for i in range(len(missing))]
                for j, block in zip(missing, read):
                    have[hashes[j]] = block
                    self.hot.put(hashes[j], *block)
            self.hot.touch(hashes)
            self.stats.hot_blocks += len(hashes) - len(missing)
            return caches_of(*concat_blocks([have[h] for h in hashes]))
        finally:
            self.release(lease)

    def _worth_loading(self, blocks: int, compute_s_per_token: Optional[float]) -> bool:
        """Load unless both costs are known and loading is the slower. Every
        `REPROBE`th hit in a row left unread is read anyway, so one slow read
        (the first touches fresh pages) cannot rule loading out for good."""
        load = self.load_cost.value
        if load is None or not compute_s_per_token:
            return True
        if load <= self.block_size * compute_s_per_token or self._unread_hits >= self.REPROBE:
            self._unread_hits = 0
            return True
        self._unread_hits += 1
        return False

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


def make_prefix_cache(model, model_dir: str, block_size: int, client,
                      arena_buf: Callable[[str], object], hot_bytes: int = 0, shard: Shard | None = None, **kw):
    """The prefix cache for this model: a PrefixCache (KV blocks) when its
    cache is plain attention KV, a SnapshotCache when it is not (sliding
    window, recurrent), or None (logged once, with the reason) when caching
    is off or the model's cache cannot be transferred at all. `shard`: a
    group's rank keys its blocks by the share of the KV it keeps."""
    if block_size < 1:
        log.info("prefix caching off: block size %d", block_size)
        return None
    if not all(hasattr(client, m) for m in ("lookup", "release", "reserve", "commit")):
        log.warning("prefix caching off: this cache client has no prefix-cache calls")
        return None
    reason = unblockable_reason(make_prompt_cache(model))
    if reason is not None:
        return make_snapshot_cache(model, model_dir, max(block_size, SNAPSHOT_MIN_BLOCK), client, arena_buf,
                                    reason, shard=shard, **kw)
    layout = probe_kv_layout(model, block_size)
    hasher = BlockHasher(block_extra(model_fingerprint(model_dir), layout.dtype, block_size), block_size).for_shard(shard)
    log.info("prefix cache: %d-token blocks of %d bytes (%s KV)", block_size, layout.block_nbytes, layout.dtype)
    return PrefixCache(client, arena_buf, hasher, layout, hot_bytes=hot_bytes, **kw)
