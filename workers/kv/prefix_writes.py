"""The store half of the KV-block prefix cache (prefix_cache.PrefixCache):
a prompt's (or a finished conversation's) new full blocks put into the cache
service in two phases. Reserve the blocks the service lacks and lay their KV
out on the MLX thread (`prepare_store`), then copy them into the arena and
commit (`finish_store`, or `write_store` on a store thread once `detach`ed);
the hot tier takes its copies on the MLX thread.

Apart from the read half (lookups, reads, held blocks) because a store
crosses threads and a read does not. Everything here is an optimisation:
a store that fails is logged and counted, never raised.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

from cache_service.client import CacheUnavailable
from workers.kv.arena_io import host_view
from workers.kv.blocks import blocks_for_write, write_prepared_blocks
from workers.kv.hot_blocks import block_of, padded_block, stacked_of_cache
from workers.kv.store_thread import PreparedStore

log = logging.getLogger(__name__)


class PrefixWrites:
    """PrefixCache's store calls, over what PrefixCacheBase and PrefixCache
    give it (client, arena_buf, hasher, hot tier, layout, ttl_s, stats, the
    back-off). Used on the MLX thread, but for `write_store` of host copies
    (a prefill worker's store thread)."""

    def store(self, tokens: Sequence[int], cache: Sequence, owner: str, per_block=None, host=None,
              later: Optional[Callable[["PreparedStore"], None]] = None, snapshot=None, *, salt: str = "") -> int:
        """Commit every full block of `tokens` that `cache` holds and the
        cache service lacks. `tokens` must be exactly the tokens whose KV the
        cache holds, from position 0 (a wrong token here would poison the
        cache for every later request). `host`: (start, arrays), the same KV
        from token `start` on already in host memory (arena_io.arena_kv_views
        of a handoff's tail): blocks from there are copied from it, not from
        the device. `later`: given, it is handed the prepared store instead
        (`detach`ed: the hot tier has the blocks by then), whose `write_store`
        (host work and a commit, no MLX) another thread may run, keeping
        `prepared.kept` alive meanwhile. Returns the blocks written (or
        handed on). `salt`: the request's cache salt (fetch's). (`snapshot`:
        a SnapshotCache's; there are none here.)"""
        prepared = self.prepare_store(tokens, cache, owner, per_block, host, salt=salt)
        if prepared is None:
            return 0
        mx.eval(prepared.arrays())
        if later is not None and prepared.todo:
            self.detach(prepared)
            later(prepared)
            return len(prepared.todo)
        return self.finish_store(prepared)

    def detach(self, prepared: "PreparedStore") -> None:
        """Ready an evaluated prepared store for another thread's write_store:
        the hot tier takes its blocks here (on the MLX thread), and the blocks
        to write become host views of their device copies, whose MLX arrays
        (`prepared.kept`) the MLX thread must keep until the write is done
        (StoreThread.submit's `keep`) and then free itself."""
        try:
            self.keep_hot(prepared)
        except Exception:  # noqa: BLE001 - an optimisation; the store goes on
            log.warning("hot tier store for %s failed", prepared.owner, exc_info=True)
        prepared.kept = [a for a in prepared.blocks + prepared.tail_arrays() if isinstance(a, mx.array)]
        prepared.hot = []  # the hot tier holds them; the thread touches no MLX array
        prepared.blocks = [host_view(a) for a in prepared.blocks]
        if prepared.tail is not None:
            prepared.tail = (prepared.tail[0], [host_view(a) for a in prepared.tail[1]])

    def prepare_store(self, tokens: Sequence[int], cache: Sequence, owner: str, per_block=None, host=None,
                      tail: bool = False, *, salt: str = "") -> Optional["PreparedStore"]:
        """store()'s first half: reserve the blocks the service lacks and lay
        out their KV (and the blocks the hot tier lacks) as device copies,
        lazily. Evaluate `arrays()`, then finish_store() writes and commits:
        the decode worker evaluates while its next step is queued and writes
        while that step runs, so the GPU never waits on the host's copy.
        Once prepared, `cache` may be dropped (and its batch's buffers
        written in place again). None when there is nothing to do or the
        call failed (logged: an optimisation never fails the request).
        `tail`: the tokens after the last full block go in a tail block too
        (a finished conversation's end, which its next turn reuses). `salt`:
        the request's cache salt (fetch's)."""
        try:
            return self._prepare_store(tokens, cache, owner, per_block, host, tail, salt)
        except Exception:  # noqa: BLE001
            self.stats.failures += 1
            log.warning("prefix store for %s failed", owner, exc_info=True)
            return None

    def _prepare_store(self, tokens, cache, owner, per_block=None, host=None, tail=False, salt=""):
        held = min(min(c.offset for c in cache), len(tokens))
        hashes = self.hasher.hashes(tokens, held // self.block_size, per_block, salt)
        if not hashes:
            return None
        prepared = PreparedStore(owner, hashes, time.perf_counter())
        bs = self.block_size
        hot_new = [j for j, h in enumerate(hashes) if h not in self.hot] if self.hot.enabled else []
        end_full = len(hashes) * bs
        tail_key = (self.hasher.tail_key(hashes[-1], tokens[end_full:held])
                    if tail and per_block is None and held > end_full else None)
        prepared.arena, prepared.todo = self._reserve(hashes + ([tail_key] if tail_key else []), owner)
        if prepared.todo and prepared.todo[-1][0] == len(hashes):  # the tail block is ours to write
            _, ref = prepared.todo.pop()
            prepared.tail = (ref, blocks_for_write(padded_block(cache, end_full, held, bs), 0, 1, self.layout))
        span = sorted(set(hot_new) | {j for j, _ in prepared.todo})
        if not span:
            return prepared
        first, end = span[0], span[-1] + 1
        prepared.first = first
        if hot_new:
            # One stacking of the span, then a copy per block: a stacking per
            # block would be layers x blocks small ops.
            keys, values = stacked_of_cache(cache, first * bs, end * bs)
            prepared.hot = [(hashes[j], block_of(keys, values, (j - first) * bs, (j - first + 1) * bs))
                            for j in hot_new]
        if prepared.todo and host is not None and prepared.todo[0][0] * bs >= host[0]:
            # On a GPU the host copy saves a device-to-host transfer per block.
            start = prepared.blocks_first = prepared.todo[0][0]
            prepared.blocks = [a[..., start * bs - host[0]:, :] for a in host[1]]
        elif prepared.todo:
            prepared.blocks_first = first
            prepared.blocks = blocks_for_write(cache, first, end - first, self.layout)
        return prepared

    def _reserve(self, hashes: List[bytes], owner: str) -> Tuple[str, list]:
        """(arena, [(block index, reserved ref), ...] in index order): the
        blocks of `hashes` the cache service asks us to write."""
        if not self._available():
            return "", []
        nbytes = self.layout.block_nbytes
        try:
            reply = self.client.reserve(hashes, nbytes, owner, ttl_s=self.ttl_s)
        except CacheUnavailable as exc:
            self._unavailable(exc)
            return "", []
        if not reply.ok:  # e.g. the arena is full of leased blocks: skip this time
            self.stats.failures += 1
            log.debug("prefix reserve for %s refused: %s", owner, reply.error)
            return "", []
        index = {h: i for i, h in enumerate(hashes)}
        todo = sorted(((index[bytes(r.hash)], r) for r in reply.blocks if bytes(r.hash) in index),
                      key=lambda item: item[0])
        if any(r.nbytes < nbytes for _, r in todo):
            raise ValueError(f"reserved blocks smaller than {nbytes} bytes")
        return reply.arena, todo

    def finish_store(self, prepared: "PreparedStore") -> int:
        """store()'s second half, once `prepared.arrays()` are evaluated: the
        hot tier takes its blocks, the reserved blocks are copied into the
        arena and committed. Returns the blocks committed; never raises."""
        try:
            self.keep_hot(prepared)
        except Exception:  # noqa: BLE001 (the reservation expires by itself)
            self.stats.failures += 1
            log.warning("prefix store for %s failed", prepared.owner, exc_info=True)
            return 0
        return self.write_store(prepared)

    def keep_hot(self, prepared: "PreparedStore") -> None:
        """finish_store's first part, on the MLX thread: the hot tier takes
        the prepared blocks (evaluated MLX arrays)."""
        for h, (k, v) in prepared.hot:
            self.hot.put(h, k, v)
        self.hot.touch(prepared.hashes)

    def write_store(self, prepared: "PreparedStore", client=None) -> int:
        """finish_store's second part: copy the reserved blocks into the arena
        and commit them. No MLX when the blocks are host copies
        (`prepared.host_only()`), so another thread may run it with a
        `client` of its own (a CacheClient serves one thread). Returns the
        blocks committed; never raises."""
        try:
            return self._write_store(prepared, client or self.client)
        except Exception:  # noqa: BLE001 (the reservation expires by itself)
            self.stats.failures += 1
            log.warning("prefix store for %s failed", prepared.owner, exc_info=True)
            return 0

    def _write_store(self, prepared: "PreparedStore", client) -> int:
        todo = prepared.todo
        if not todo and prepared.tail is None:
            return 0
        try:
            buf = self.arena_buf(prepared.arena)
            if todo:
                write_prepared_blocks(buf, [r.offset for _, r in todo], prepared.blocks,
                                      [j - prepared.blocks_first for j, _ in todo], self.layout)
            refs = [r for _, r in todo]
            if prepared.tail is not None:
                ref, arrays = prepared.tail
                write_prepared_blocks(buf, [ref.offset], arrays, [0], self.layout)
                refs.append(ref)
            # With our owner: a reservation of ours that expired meanwhile (and
            # was re-reserved by another writer) is not published by us.
            ack = client.commit([r.hash for r in refs], owner=prepared.owner)
        except CacheUnavailable as exc:
            self._unavailable(exc)
            return 0
        if not ack.ok:
            self.stats.failures += 1
            log.warning("prefix commit for %s refused: %s", prepared.owner, ack.error)
            return 0
        # Fewer when a reservation expired before the commit (a very slow write).
        done = int(ack.stats.get("committed", len(refs)))
        self.stats.stored_blocks += done
        log.debug("prefix store %s: %d of %d blocks new (%d bytes) in %.2f ms", prepared.owner, done,
                  len(prepared.hashes), len(refs) * self.layout.block_nbytes,
                  (time.perf_counter() - prepared.started) * 1000)
        return done
