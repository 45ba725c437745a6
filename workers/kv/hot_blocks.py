"""Prefix-cache blocks a worker keeps as MLX arrays: the hot tier of its KV.

The cache service's arena is host memory every worker shares. Taking a block
from it costs two copies (arena -> staging -> MLX), and on a discrete GPU a
transfer from pageable host memory: on an H100 a 32-agent swarm spent 70% of
its prefill worker's time and a third of its decode worker's moving KV that
way (~3.5 GB/s; docs/benchmarks-log.md, session 5). Yet a worker takes the same
blocks again and again: a swarm's system prompt in every request, a
conversation's history in each of its turns. So it keeps the blocks it used
lately, bounded by bytes, least recently used out first.

Keys are the arena's own chained block hashes (model, dtype and image keys
included), so a hit here is exactly as valid as one there. The arena stays
the shared truth and what the disk tier persists; this is a per-process copy.

A block is stored as two arrays, keys and values of every layer stacked:
(layers, kv_heads, block_size, head_dim). Prompts are rebuilt with one
concatenation per kind, not one per layer and block. Models whose layers
differ in shape have no hot tier (`HotBlocks.for_layout` says so).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache

log = logging.getLogger(__name__)

Block = Tuple[mx.array, mx.array]  # keys, values: (layers, kv_heads, block_size, head_dim)


class HotBlocks:
    """An LRU of blocks by hash, at most `max_bytes` of them. MLX thread only."""

    def __init__(self, max_bytes: int, block_nbytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.block_nbytes = block_nbytes
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self.hits = 0  # blocks served from here
        self.puts = 0  # blocks added
        self.evictions = 0

    @classmethod
    def for_layout(cls, max_bytes: int, layout) -> "HotBlocks":
        """The hot tier for a workers.kv.blocks.KVLayout (none, size 0,
        when its layers differ in shape)."""
        if len(set(layout.layers)) != 1:
            if max_bytes:
                log.info("no hot KV tier: this model's layers differ in shape")
            max_bytes = 0
        return cls(max_bytes, layout.block_nbytes)

    @property
    def enabled(self) -> bool:
        return self.max_bytes >= self.block_nbytes > 0

    @property
    def nbytes(self) -> int:
        return len(self._blocks) * self.block_nbytes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: bytes) -> bool:
        return h in self._blocks

    def leading(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, are here."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def get(self, h: bytes) -> Block:
        """A block (KeyError when absent). Callers `touch` what they used."""
        block = self._blocks[h]
        self.hits += 1
        return block

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark a prompt's blocks (in token order) used: the first ends up
        the most recently used, since every later block needs it (a chained
        hash is useless without its ancestors) and a shared system prompt
        is the head of many prompts."""
        for h in reversed(hashes):
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def put(self, h: bytes, keys: mx.array, values: mx.array) -> None:
        """Keep a block. `keys`/`values` must own their memory (a slice of a
        larger array would keep all of it alive): see `block_of`."""
        if not self.enabled:
            return
        if h in self._blocks:
            return
        self._blocks[h] = (keys, values)
        self.puts += 1
        while self.nbytes > self.max_bytes:
            self._blocks.popitem(last=False)
            self.evictions += 1

    def drop(self) -> int:
        """Let go of every block (memory pressure: workers/memory_relief.py);
        the bytes let go. A prompt being built from some keeps those alive
        until it is done; the arena still has them all."""
        freed = self.nbytes
        self.evictions += len(self._blocks)
        self._blocks.clear()
        return freed


def block_of(keys: mx.array, values: mx.array, start: int, end: int) -> Block:
    """Tokens [start, end) of stacked (layers, heads, tokens, dim) KV as a
    block that owns its memory (a copy)."""
    return (mx.contiguous(keys[:, :, start:end, :]), mx.contiguous(values[:, :, start:end, :]))


def stacked_of_cache(cache: Sequence, start: int, end: int) -> Block:
    """Tokens [start, end) of per-layer batch-1 caches, stacked over layers (a copy)."""
    return (mx.concatenate([c.keys[:, :, start:end, :] for c in cache], axis=0),
            mx.concatenate([c.values[:, :, start:end, :] for c in cache], axis=0))


def concat_blocks(blocks: List[Block]) -> Block:
    """Blocks in token order -> stacked KV of all their tokens."""
    if len(blocks) == 1:
        return blocks[0]
    return (mx.concatenate([b[0] for b in blocks], axis=2), mx.concatenate([b[1] for b in blocks], axis=2))


def caches_of(keys: mx.array, values: mx.array) -> List[KVCache]:
    """Per-layer KVCaches over stacked KV (views, no copy: the first write
    past their end reallocates, as KVCache always does)."""
    caches = []
    for i in range(keys.shape[0]):
        c = KVCache()
        c.state = (keys[i:i + 1], values[i:i + 1], keys.shape[2])
        caches.append(c)
    return caches


def tail_of(cache: Sequence[KVCache], start: int) -> List[KVCache]:
    """Tokens [start, offset) of per-layer plain KVCaches, as caches (views)."""
    out = []
    for c in cache:
        t = KVCache()
        t.state = (c.keys[:, :, start:c.offset, :], c.values[:, :, start:c.offset, :], c.offset - start)
        out.append(t)
    return out


def first_tokens(c: KVCache, n: int) -> KVCache:
    """A per-layer cache's first `n` tokens (views)."""
    if c.offset == n and c.keys.shape[2] == n:
        return c
    out = KVCache()
    out.state = (c.keys[..., :n, :], c.values[..., :n, :], n)
    return out


def padded_block(cache: Sequence, start: int, end: int, block_size: int) -> List[KVCache]:
    """Tokens [start, end) of per-layer caches, zero-padded to one block (lazy):
    a tail block to store."""
    out = []
    for c in cache:
        pad = [(0, 0), (0, 0), (0, block_size - (end - start)), (0, 0)]
        t = KVCache()
        t.state = (mx.pad(c.keys[..., start:end, :], pad), mx.pad(c.values[..., start:end, :], pad), block_size)
        out.append(t)
    return out


def join(head: Sequence[KVCache], tail: Sequence[KVCache] | None) -> List[KVCache]:
    """Per-layer caches holding `head`'s tokens then `tail`'s (one copy, lazy:
    a decode worker's next step computes it rather than the host waiting on
    the GPU between steps; `head` alone when there is no tail)."""
    if not tail:
        return list(head)
    if len(tail) != len(head):
        raise ValueError(f"{len(head)} layers of blocks, {len(tail)} of tail")
    out = []
    for h, t in zip(head, tail):
        c = KVCache()
        c.state = (mx.concatenate([h.keys[..., :h.offset, :], t.keys[..., :t.offset, :]], axis=2),
                   mx.concatenate([h.values[..., :h.offset, :], t.values[..., :t.offset, :]], axis=2),
                   h.offset + t.offset)
        out.append(c)
    return out
