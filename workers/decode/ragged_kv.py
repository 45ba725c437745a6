"""A decode batch whose rows join and leave without copying the others' KV.

mlx-lm's BatchKVCache keeps the batch's KV in one left-padded array. Every
request that joins is padded and concatenated into it, every one that leaves
is filtered out of it, and each copies the whole batch's KV; every row is also
padded to the longest context. With a swarm of agents (16 conversations of
1–2k tokens, ~1 GB of fp32 KV on the embedded model) a join or a leave costs
more than a decode step, and they happen every few steps.

Here a row's KV never moves with the others'. Rows with a prompt prefix in
common (a swarm's system prompt) share one copy of it (PrefixSharing,
workers/decode/prefix_sharing.py). A row's own tokens (after any shared
prefix), up to Pool.MAX_TOKENS (512), take a slot of the batch's pool
(workers/decode/ragged_rows.py): joining copies that one row in, leaving
frees its slot, and a step writes every row's token with one scatter and
attends with one masked product, plus one product per shared prefix (on the
CPU per-row ops cost more than the arithmetic). Rows with more own tokens
keep the buffer they arrived with (the handoff's KVCache) and grow it alone;
attention runs row by row over exactly that row's tokens
(workers/decode/ragged_attention.py). Everything else in the layer
(projections, MLP, lm_head) runs batched.

It plugs into BatchGenerator unchanged: the decode worker hands it caches
whose layers are RowKVCache, and BatchGenerator's `type(c).merge` builds a
RaggedKVCache from them. The model's attention reaches our rows through
mlx-lm's `scaled_dot_product_attention`, which every mlx-lm model module
imports from `mlx_lm.models.base`; workers/kernels/mlx_hooks.py wraps that
name in each model module so that a RaggedKVCache attends row by row. A
model whose attention does not call it is caught on its next step
(RuntimeError), never silently wrong.

Rows carry a rope position separate from their length (`rope_shift`), which is
what decoding after an M-RoPE prompt needs (Qwen-VL positions differ from the
token count).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from workers.decode import ragged_attention
from workers.decode.ragged_rows import Pool, Row, SharedKV
from workers.kernels.mlx_cache import BaseCache


class RowKVCache(KVCache):
    """One request's KV layer (batch 1), as KVCache, plus the ragged row that
    batching it builds on (`row`, made by `rows_of`): BatchGenerator's merge
    then gathers rows instead of copying buffers."""

    row: Row

    @classmethod
    def merge(cls, caches):
        return RaggedKVCache([c.row for c in caches])


class RaggedKVCache(BaseCache):
    """The KV of a decode batch, one buffer per row (see the module doc)."""

    step = 256

    def __init__(self, rows: list[Row]):
        self.rows = rows
        self.pool = Pool(self.step)  # rows without a prefix, from their first step here
        # Set by update_and_fetch, cleared when attention reads the rows: a
        # model that bypassed mlx-lm's attention function is caught next step.
        self._unread = False

    # -- what the model reads -------------------------------------------------
    @property
    def offset(self):
        """Per-row rope positions (an array, like BatchKVCache's)."""
        return mx.array([r.length + r.rope_shift for r in self.rows])

    def update_and_fetch(self, keys, values):
        if self._unread:
            raise RuntimeError("this model's attention does not go through mlx-lm's "
                               "scaled_dot_product_attention; it cannot use RaggedKVCache")
        if keys.shape[0] != len(self.rows):
            raise ValueError(f"{keys.shape[0]} rows of keys for a batch of {len(self.rows)}")
        for r in self.rows:
            if r.pool is self.pool and r.own_length + keys.shape[2] > Pool.MAX_TOKENS:
                r.detach()  # grown past the pool: a buffer of its own from now on
        fits = [r for r in self.rows if r.own_length + keys.shape[2] <= Pool.MAX_TOKENS]
        if len(fits) == 1:  # one row alone: its own buffer is cheaper than the pool's bookkeeping
            if fits[0].pool is self.pool:
                fits[0].detach()
        else:
            newcomers = [r for r in fits if r.pool is not self.pool]
            if newcomers:
                self.pool.place(newcomers)
        for r in self.rows:
            if r.pool is not None and r.pool is not self.pool:
                r.detach()  # never write into another batch's pool
        pooled = [i for i, r in enumerate(self.rows) if r.pool is self.pool]
        if keys.shape[2] == 1 and pooled:
            index = None if len(pooled) == len(self.rows) else mx.array(pooled)
            self.pool.write_step([self.rows[i] for i in pooled],
                                 keys if index is None else keys[index], values if index is None else values[index])
        for i, row in enumerate(self.rows):
            if keys.shape[2] > 1 or row.pool is not self.pool:
                row.append(keys[i : i + 1], values[i : i + 1], self.step)
        self._unread = True
        # Attention reads the rows (attend); these are returned only so that
        # code between the cache and attention sees arrays of the usual kind.
        return keys, values

    def attend(self, queries, scale: float, sinks=None):
        """Each row's queries over that row's tokens (causal within the new ones)."""
        self._unread = False
        return ragged_attention.attend(self.rows, self.pool, queries, scale, sinks)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        if window_size is not None:
            raise ValueError("RaggedKVCache holds full-attention layers only")
        # attend() masks each row itself

    # -- what BatchGenerator does with a batch cache ----------------------------
    def filter(self, batch_indices):
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
        kept = [self.rows[int(i)] for i in indices]
        # Rows that leave take their KV out of this batch's pool: they may
        # live on (BatchGenerator splits a batch by copying it and filtering
        # both), and their slots are then free for the next newcomers.
        keep = {id(r) for r in kept}
        for row in self.rows:
            if id(row) not in keep and row.pool is self.pool:
                row.detach()
        self.rows = kept

    def extend(self, other: RaggedKVCache):
        if not isinstance(other, RaggedKVCache):
            raise TypeError(f"cannot extend a RaggedKVCache with {type(other).__name__}")
        self.rows = self.rows + other.rows

    def extract(self, idx: int) -> KVCache:
        """The row as a plain KVCache (what a finished request's KV is committed from)."""
        row = self.rows[idx]
        cache = KVCache()
        cache.keys, cache.values = (mx.contiguous(a) for a in row.full())
        cache.offset = row.length
        return cache

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        # Rows are never padded: BatchGenerator pads only multi-token prompts,
        # and the decode worker's prompts are the single first token.
        if any(max(p, default=0) > 0 for p in (left_padding or [], right_padding or [])):
            raise NotImplementedError("RaggedKVCache rows are never padded")

    def finalize(self):
        pass

    def __deepcopy__(self, memo):
        # BatchGenerator's split() deep-copies a batch, then keeps disjoint rows
        # in each copy: sharing the row objects is safe and copies no KV (the
        # copy has a pool of its own; the original's filter detaches its rows).
        return RaggedKVCache(list(self.rows))

    @property
    def state(self):
        own = [a for r in self.rows if r.pool is None for a in (r.keys, r.values)]
        return own + ([self.pool.keys, self.pool.values] if self.pool.keys is not None else [])

    def _prefixes(self) -> list[SharedKV]:
        return list({id(r.prefix): r.prefix for r in self.rows if r.prefix is not None}.values())

    def size(self):
        return max((r.length for r in self.rows), default=0)

    def empty(self):
        return not self.rows

    def is_trimmable(self):
        return False

    def trim_rows(self, counts) -> None:
        """Drop the last counts[i] tokens of row i (a speculative step's
        rejected drafts, workers/decode/speculation.py): only the lengths
        move; the next write goes where they end."""
        for row, n in zip(self.rows, counts):
            if n > row.own_length:
                raise ValueError(f"cannot trim {n} tokens from a row of {row.own_length} own tokens")
            row.length -= int(n)

    @property
    def nbytes(self):
        own = sum(r.keys.nbytes + r.values.nbytes for r in self.rows if r.pool is None)
        return own + self.pool.nbytes + sum(p.keys.nbytes + p.values.nbytes for p in self._prefixes())


def rows_of(cache: list, rope_shift: int = 0) -> list:
    """A handed-off per-layer cache with its plain KVCache layers as
    RowKVCache (same buffers, no copy); other kinds (windows, recurrent state)
    stay as they are and batch the mlx-lm way."""
    out = []
    for c in cache:
        if type(c) is KVCache:
            if c.keys is None or c.keys.shape[0] != 1:
                raise ValueError("a ragged batch row needs a filled batch-1 KV cache")
            row = RowKVCache()
            row.keys, row.values, row.offset = c.keys, c.values, c.offset
            row.row = Row(c.keys, c.values, int(c.offset), int(rope_shift))
            c = row
        out.append(c)
    return out
