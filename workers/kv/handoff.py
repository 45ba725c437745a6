"""The prefill-to-decode KV handoff, both ends, and its layout in the arena.

A prefill worker (workers/prefill/role.py) puts a prompt's KV in the arena
(`write_handoff`: reserve, stage the copy, build the KVHandoff the router
passes on); with a block prefix cache it first holds the prompt's leading
blocks (PrefixCache.hold) and writes only the tail after them, the blocks
going by reference (KVHandoff.blocks). A decode worker (workers/decode/role.py)
takes it in (`take_in`: read the tail, on CUDA from `start_copy`'s copy on its
reader thread; free the slot; take the held blocks, PrefixCache.take; join
them), or gives it back unread (`give_back`, a request cancelled before).

By value (`write_handoff(by_value=True)`, PrefillRequest.kv_by_value: the
decode worker is on another host; or `write_handoff_anyway` when this
host's arena has no room): the same layout written into a numpy
buffer of its own instead of an arena slot, sent in the message itself
(KVHandoff.payload, one zero-copy frame), no blocks by reference; the decode
end reads it from there (`handoff_buf`) and has nothing to free.

Layout: per layer, keys then values, each the first `offset` tokens of the
cache as one C-contiguous array of shape (1, kv_heads, tokens, head_dim)
(arena_io.py's slices). `write_kv` / `read_kv` / `kv_nbytes` take plain
attention KV (mlx_lm KVCache) only and raise TypeError naming any other type;
tests and benchmarks call them, the prefill worker writes through
`cache_state.encode_cache` + `arena_io.stage_arrays`. `write_cache` /
`read_cache` take any mlx-lm cache list (sliding window, recurrent, mixes as
in Gemma 3 or Qwen3-Next): a plain-KV list takes the same path and message
as write_kv; any other list adds per-layer class and state metadata
(KVHandoff.cache_meta, cache_state.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from cache_service.client import CacheUnavailable
from protos.messages import ArenaSlice, HeldBlocks, KVHandoff
from workers.kv.arena_io import (MX_DTYPE_NAMES, arena_kv_views, as_arena_slice, as_stored, read_slice, release_view,
                                 slice_view, stage_arrays, write_arrays)
from workers.kv.cache_state import cache_dtype_name, check_plain_kv, decode_layer, encode_cache
from workers.kv.hot_blocks import join, tail_of

log = logging.getLogger(__name__)

# Handoff reservations (and the leases of held blocks) outlive any sane gap
# between prefill and decode, and still free themselves when a decode worker
# dies holding one.
HANDOFF_TTL_S = 120.0


def kv_dtype_name(cache: Sequence) -> str:
    """The dtype name of a cache's KV (KVHandoff.kv_dtype)."""
    check_plain_kv(cache)
    return MX_DTYPE_NAMES[cache[0].keys.dtype]


def kv_nbytes(cache: Sequence) -> int:
    """Bytes `write_kv` needs for this cache, alignment padding included."""
    check_plain_kv(cache)
    return encode_cache(cache).nbytes


def write_kv(buf, base_offset: int, cache: Sequence) -> List[List[ArenaSlice]]:
    """Copy `cache` into `buf` starting at `base_offset` (must be ALIGN-aligned
    for aligned slices; any offset works). Returns per layer
    [keys ArenaSlice, values ArenaSlice] with offsets absolute in `buf`.

    `buf` must hold base_offset + kv_nbytes(cache) bytes.
    """
    check_plain_kv(cache)
    return write_arrays(buf, base_offset, encode_cache(cache).arrays)


def read_kv(buf, layers: Sequence) -> List[KVCache]:
    """Rebuild per-layer KVCache objects from slices `write_kv` produced.

    The returned caches own their memory: mx.array copies out of `buf` at
    once (nothing keeps `buf` exported, so a shared-memory segment can be
    closed or its slot reused right after). Nothing here waits on the
    device: the caller's next evaluation does what is left (a bfloat16 view).
    """
    return kv_from_copies(copy_kv(buf, layers), layers)


def copy_kv(buf, layers: Sequence) -> List[tuple]:
    """read_kv's copies alone: per layer (keys, values) as MLX arrays of the
    stored dtype (bfloat16 as its uint16 storage). Array creation and
    nothing else (no lazy op, no evaluation), so on MLX's CUDA backend,
    whose allocator takes a lock, a thread other than the MLX thread may
    run it: there these copies are the slow part (page by page into managed
    memory)."""
    mv = memoryview(buf).cast("B")
    try:
        return [tuple(mx.array(slice_view(mv, as_arena_slice(s))) for s in pair) for pair in layers]
    finally:
        release_view(mv)


def kv_from_copies(copies: Sequence[tuple], layers: Sequence) -> List[KVCache]:
    """copy_kv's arrays as read_kv's caches (on the MLX thread)."""
    caches = []
    for pair, arrays in zip(layers, copies):
        keys, values = (as_stored(a, as_arena_slice(s).dtype) for a, s in zip(arrays, pair))
        if keys.shape[2] != values.shape[2]:
            raise ValueError("keys and values cover different token counts")
        c = KVCache()
        c.state = (keys, values, keys.shape[2])
        caches.append(c)
    return caches


def write_cache(buf, base_offset: int, cache: Sequence) -> Tuple[List[List[ArenaSlice]], list]:
    """Copy any mlx-lm cache list into `buf` (as write_kv does). Returns
    (layers, meta) for KVHandoff.layers and KVHandoff.cache_meta; for plain
    KV, meta is [] and layers are exactly write_kv's."""
    enc = encode_cache(cache)
    return write_arrays(buf, base_offset, enc.arrays), enc.meta


def read_cache(buf, layers: Sequence, meta: Sequence) -> list:
    """Rebuild what `write_cache` wrote: per-layer caches that own their
    memory (copied out of `buf` at once), ready for DecodeEngine.add."""
    if not meta:
        return read_kv(buf, layers)
    if len(meta) != len(layers):
        raise ValueError(f"{len(meta)} layer specs for {len(layers)} layers of slices")
    mv = memoryview(buf).cast("B")
    try:
        arrays = [[read_slice(mv, s) for s in layer] for layer in layers]
    finally:
        release_view(mv)
    mx.eval(arrays)
    return [decode_layer(spec, layer) for spec, layer in zip(meta, arrays)]


# ------------------------------------------------------------- prefill end --
def write_handoff(client, arena_buf: Callable[[str], object], request_id: str, result,
                  held: Optional[HeldBlocks] = None, staged: Optional[list] = None,
                  release_held: Callable[[int], None] = lambda lease: None, by_value: bool = False) -> KVHandoff:
    """Put a prefilled prompt's KV (`result`: a PrefillResult) in the arena,
    where a decode worker will find it: after `held`'s blocks only, when
    given (those are referred to). `client` reserves the slot; `arena_buf`
    names an arena's buffer. With `staged` (a list) the copy into the arena
    is left to the caller: (copy, arrays it reads) is appended
    (arena_io.stage_arrays'). A refused reservation raises CacheUnavailable,
    after `release_held(held.lease)`. With `by_value` the KV goes into a
    buffer of its own (KVHandoff.payload), not the arena: all of it, so
    `held` must be None."""
    t0 = time.perf_counter()
    if by_value and held is not None:
        raise ValueError("a handoff by value carries all its KV: it refers to no held blocks")
    cache, blocks = result.cache, held if held is not None else HeldBlocks()
    if held is not None:
        cache = tail_of(cache, held.tokens) if held.tokens < result.num_tokens else None
    dtype = cache_dtype_name(result.cache)
    if cache is None:  # the prompt ends on a block boundary: all of it is referred to
        return KVHandoff(request_id, result.num_tokens, result.rope_offset, kv_dtype=dtype, blocks=blocks)
    # Any mlx-lm cache: plain KV as [keys, values] per layer (no meta),
    # sliding-window / recurrent layers as class + state (cache_meta).
    enc = encode_cache(cache)
    nbytes = enc.nbytes
    if by_value:  # no reservation: the buffer goes with the message, freed when it is sent
        payload = np.empty(nbytes, np.uint8)
        where = dict(payload=payload)
        layers, copy, kept = stage_arrays(payload, 0, enc.arrays)
    else:
        reply = client.alloc(nbytes, owner=request_id, ttl_s=HANDOFF_TTL_S)
        if not reply.ok:
            if held is not None:
                release_held(held.lease)
            raise CacheUnavailable(f"KV handoff of {nbytes} bytes refused: {reply.error}")
        where = dict(arena=reply.arena, allocation=reply.allocation)
        layers, copy, kept = stage_arrays(arena_buf(reply.arena), reply.offset, enc.arrays)
    if staged is None:
        copy()
    handoff = KVHandoff(request_id, result.num_tokens, result.rope_offset, layers=layers, kv_dtype=dtype,
                        bytes_moved=nbytes, write_ms=(time.perf_counter() - t0) * 1000, cache_meta=enc.meta,
                        blocks=blocks, **where)
    if staged is not None:
        def timed_copy():  # the handoff's write time counts its copy, wherever it runs
            t = time.perf_counter()
            copy()
            handoff.write_ms += (time.perf_counter() - t) * 1000

        staged.append((timed_copy, kept))
    log.debug("handoff %s: %s %d bytes%s in %.2f ms (%d tokens by reference)", request_id,
              "wrote" if staged is None else "laid out", nbytes, " by value" if by_value else "",
              handoff.write_ms, blocks.tokens)
    return handoff


def write_handoff_anyway(client, arena_buf: Callable[[str], object], request_id: str, result,
                         held: Optional[HeldBlocks] = None, staged: Optional[list] = None,
                         release_held: Callable[[int], None] = lambda lease: None,
                         by_value: bool = False) -> KVHandoff:
    """`write_handoff` (by value when asked), or, when the arena refuses it (full
    of other handoffs in flight and leased blocks, as under a burst of
    prompts on a small arena; or the cache service restarting), by value:
    all the prompt's KV in the message, `held` released. Slower (the KV
    crosses the sockets), but the request goes on instead of failing."""
    try:
        return write_handoff(client, arena_buf, request_id, result, held, staged, release_held, by_value)
    except CacheUnavailable as exc:
        log.warning("handoff %s: %s; its KV goes in the message instead", request_id, exc)
        return write_handoff(client, arena_buf, request_id, result, None, staged, by_value=True)


def handoff_buf(h: KVHandoff, arena_buf: Callable[[str], object]):
    """The buffer a handoff's `layers` point into: its payload when it came
    by value, else its arena."""
    return h.payload if h.payload is not None else arena_buf(h.arena)


def handoff_tail(h: KVHandoff, arena_buf: Callable[[str], object]):
    """(first token, host views) of a handoff's plain-KV tail in the arena
    (or its payload), as PrefixCache.store's `host`; None when it has none."""
    if not h.layers or h.cache_meta:
        return None
    return h.blocks.tokens, arena_kv_views(handoff_buf(h, arena_buf), h.layers)


# -------------------------------------------------------------- decode end --
def start_copy(reader, arena_buf: Callable[[str], object], h: KVHandoff):
    """The future of `reader`'s copy_kv of a handoff's tail out of the arena
    (a CUDA decode worker's thread), or None when there is no reader or
    nothing it can copy (local, no tail, not plain KV)."""
    if reader is None or not h.layers or h.local or h.cache_meta:
        return None
    return reader.submit(copy_kv, handoff_buf(h, arena_buf), h.layers)


def take_in(h: KVHandoff, client, arena_buf: Callable[[str], object], prefix, clock, copies=None) -> Optional[list]:
    """A handoff's KV as per-layer caches, the decode end of it: its tail read
    from the arena (or from `copies`, start_copy's future), its slot freed,
    its held blocks taken from `prefix` and joined before the tail. `clock`:
    the worker's LoopClock, for the parts. A handoff by value is read from
    its payload and frees nothing."""
    t0 = time.perf_counter()
    if h.payload is not None and (h.blocks.hashes or h.allocation >= 0):
        raise ValueError("a handoff by value must carry all its KV (no held blocks, no arena slot)")
    cache = None
    if h.layers:
        with clock.part("read handoff"):
            if copies is not None:
                cache = kv_from_copies(copies.result(timeout=0), h.layers)
            else:
                cache = read_cache(handoff_buf(h, arena_buf), h.layers, h.cache_meta)
    if h.allocation >= 0:  # the arena slot is free to reuse once the KV is ours
        client.free(allocations=[h.allocation], arena=h.arena, wait=False)
    if h.blocks.hashes:
        with clock.part("take blocks"):
            blocks = take_blocks(prefix, client, h.blocks)
        with clock.part("join"):
            cache = join(blocks, cache)
    log.debug("handoff %s: read %d bytes%s and %d tokens by reference in %.2f ms (write took %.2f ms)",
              h.request_id, h.bytes_moved, " by value" if h.payload is not None else "", h.blocks.tokens,
              (time.perf_counter() - t0) * 1000, h.write_ms)
    return cache


def take_blocks(prefix, client, held: HeldBlocks) -> list:
    """The KV of the blocks a handoff refers to, from `prefix` (its hot tier
    or the arena); raises, their lease released, when this worker cannot
    take them (no prefix cache, another block size)."""
    bs = prefix.block_size if prefix is not None else 0
    if prefix is None or held.tokens != len(held.hashes) * bs:
        try:
            client.release(held.lease)
        except CacheUnavailable:
            pass  # its TTL ends it
        raise ValueError(f"handoff refers to {len(held.hashes)} blocks of {held.tokens} tokens; "
                         f"this worker's prefix cache has blocks of {bs}")
    return prefix.take([bytes(x) for x in held.hashes], held.arena, held.offsets, held.lease)


def give_back(client, h: KVHandoff) -> None:
    """Give back what a handoff holds in the cache service (a request
    cancelled before it started decoding); their TTLs end them otherwise."""
    try:
        if h.allocation >= 0:
            client.free(allocations=[h.allocation], arena=h.arena, wait=False)
        if h.blocks.hashes:
            client.release(h.blocks.lease)
    except CacheUnavailable:
        pass
