"""A decode batch whose rows join and leave without copying the others' KV.

mlx-lm's BatchKVCache keeps the batch's KV in one left-padded array. Every
request that joins is padded and concatenated into it, every one that leaves
is filtered out of it, and each copies the whole batch's KV; every row is also
padded to the longest context. With a swarm of agents (16 conversations of
1–2k tokens, ~1 GB of fp32 KV on the embedded model) a join or a leave costs
more than a decode step, and they happen every few steps.

Here a row's KV never moves with the others'. Rows with a prompt prefix in
common (a swarm's system prompt) share one copy of it (PrefixSharing). A
row's own tokens (after any shared prefix), up to _Pool.MAX_TOKENS (512),
take a slot of the batch's pool: joining copies that one row in, leaving
frees its slot, and a step writes every row's token with one scatter and
attends with one masked product, plus one product per shared prefix (on the
CPU per-row ops cost more than the arithmetic). Rows with more own tokens
keep the buffer they arrived with (the handoff's KVCache) and grow it alone;
attention runs row by row over exactly that row's tokens. Everything else in
the layer (projections, MLP, lm_head) runs batched.

It plugs into BatchGenerator unchanged: the decode worker hands it caches
whose layers are RowKVCache, and BatchGenerator's `type(c).merge` builds a
RaggedKVCache from them. The model's attention reaches our rows through
mlx-lm's `scaled_dot_product_attention`, which every mlx-lm model module
imports from `mlx_lm.models.base`; workers/mlx_hooks.py wraps that name
in each model module so that a RaggedKVCache attends row by row. A model whose attention does not call it is
caught on its next step (RuntimeError), never silently wrong.

Rows carry a rope position separate from their length (`rope_shift`), which is
what decoding after an M-RoPE prompt needs (Qwen-VL positions differ from the
token count).
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache

from workers.cpu_attention import softmax_weights
from workers.cpu_math import exp_shifted



class RowKVCache(KVCache):
    """One request's KV layer (batch 1), as KVCache, plus the ragged row that
    batching it builds on (`row`, made by `rows_of`): BatchGenerator's merge
    then gathers rows instead of copying buffers."""

    row: _Row

    @classmethod
    def merge(cls, caches):
        return RaggedKVCache([c.row for c in caches])


class SharedKV:
    """KV of a prompt prefix that several rows of a batch have in common (one
    layer). Immutable: rows append after it, in their own buffers."""

    __slots__ = ("keys", "length", "values")

    def __init__(self, keys, values):
        self.keys, self.values, self.length = keys, values, int(keys.shape[2])


class _Row:
    """One request's KV in a RaggedKVCache layer: an optional shared prefix,
    then its own tokens, either in a buffer it grows alone or, for rows
    without a prefix while they decode, in a slot of the batch's _Pool."""

    __slots__ = ("keys", "length", "pool", "prefix", "rope_shift", "slot", "values")

    def __init__(self, keys, values, length: int, rope_shift: int = 0, prefix: SharedKV | None = None):
        self.prefix = prefix
        self.keys, self.values = keys, values
        self.length = length  # all tokens, the prefix's included
        self.rope_shift = rope_shift
        self.pool: _Pool | None = None  # when set, keys/values are None: the KV is in pool[slot]
        self.slot = -1

    @property
    def own_length(self) -> int:
        return self.length - (self.prefix.length if self.prefix is not None else 0)

    def append(self, keys, values, step: int) -> None:
        if self.pool is not None:
            self.pool.append(self, keys, values)
            return
        start = self.own_length
        end = start + keys.shape[2]
        if end > self.keys.shape[2]:
            # Grow this row alone, to the next multiple of `step` with room to spare.
            self.keys = _with_capacity(self.keys[..., :start, :], end, step)
            self.values = _with_capacity(self.values[..., :start, :], end, step)
        self.keys[..., start:end, :] = keys
        self.values[..., start:end, :] = values
        self.length += keys.shape[2]

    def view(self):
        """This row's own tokens (after the prefix)."""
        n = self.own_length
        if self.pool is not None:
            return self.pool.keys[self.slot : self.slot + 1, :, :n, :], self.pool.values[self.slot : self.slot + 1, :, :n, :]
        return self.keys[..., :n, :], self.values[..., :n, :]

    def full(self):
        """Every token's KV, the prefix's included (a copy when there is a prefix)."""
        k, v = self.view()
        if self.prefix is None:
            return k, v
        return (mx.concatenate([self.prefix.keys, k], axis=2), mx.concatenate([self.prefix.values, v], axis=2))

    def detach(self) -> None:
        """Out of its pool slot into a buffer of its own (a copy, evaluated now,
        so that the slot can be reused and the pool's buffer is not kept)."""
        if self.pool is None:
            return
        k, v = self.view()
        self.keys, self.values = mx.contiguous(k), mx.contiguous(v)
        mx.eval(self.keys, self.values)
        self.pool.occupants[self.slot] = None  # the pool no longer keeps this row (and its KV) alive
        self.pool, self.slot = None, -1

    def share(self, prefix: SharedKV, step: int = 256) -> None:
        """Drop the first `prefix.length` tokens of this row's own buffer in
        favour of `prefix` (the same KV, held once for several rows)."""
        if self.prefix is not None:
            raise ValueError("row already has a shared prefix")
        self.detach()
        n = self.length
        self.keys = _with_capacity(self.keys[..., prefix.length:n, :], n - prefix.length, step)
        self.values = _with_capacity(self.values[..., prefix.length:n, :], n - prefix.length, step)
        self.prefix = prefix


class _Pool:
    """The own tokens' KV (after any shared prefix) of one batch layer's rows,
    a slot per row: (slots, Hkv, capacity, D) keys and values. A decode step then writes
    every row's new token with one scatter and attends over all of them with
    one masked product (_pool_attention) instead of ~10 small ops per row,
    which on the CPU cost more than the arithmetic (16 rows of ~200 tokens:
    93 ms of attention per step row by row). Joining copies the newcomer's KV
    into a free slot once; leaving frees the slot (its KV is copied out only
    if the row lives on elsewhere). Capacity grows for all slots at once, by
    `step` tokens, like a row's own buffer, up to MAX_TOKENS: every slot has
    the capacity of the longest row, so longer rows (where the per-row ops
    matter less than the arithmetic) keep buffers of their own."""

    SLOTS_STEP = 8
    MAX_TOKENS = 512

    def __init__(self, step: int):
        self.step = step
        self.keys = self.values = None
        self.occupants: list = []  # slot -> the _Row that was put there (it may have left)

    def holds(self, slot: int) -> bool:
        row = self.occupants[slot]
        return row is not None and row.pool is self and row.slot == slot

    def place(self, rows: list) -> None:
        """Copy `rows` (in a buffer of their own or another pool) into free slots."""
        free = [i for i in range(len(self.occupants)) if not self.holds(i)]
        need = len(rows) - len(free)
        template = rows[0].view()[0]
        if need > 0:
            add = -(-need // self.SLOTS_STEP) * self.SLOTS_STEP
            free += list(range(len(self.occupants), len(self.occupants) + add))
            self.occupants += [None] * add
            self._grow(slots=len(self.occupants), template=template)
        self.reserve(max(r.own_length for r in rows), template)
        for row, slot in zip(rows, free):
            k, v = row.view()
            n = row.own_length
            if n:
                self.keys[slot : slot + 1, :, :n, :] = k
                self.values[slot : slot + 1, :, :n, :] = v
            row.keys = row.values = None
            row.pool, row.slot = self, slot
            self.occupants[slot] = row

    def reserve(self, length: int, template=None) -> None:
        """Room for `length` tokens in every slot."""
        if self.keys.shape[2] < length:
            room = ((length + self.step - 1) // self.step + 1) * self.step
            self._grow(capacity=max(length, min(room, self.MAX_TOKENS)), template=template)

    def _grow(self, slots: int | None = None, capacity: int | None = None, template=None) -> None:
        if self.keys is None:
            _, h, _, d = template.shape
            shape = (slots, h, capacity or self.step, d)
            self.keys, self.values = mx.zeros(shape, template.dtype), mx.zeros(shape, template.dtype)
            return
        s, h, c, d = self.keys.shape
        if slots is not None and slots > s:
            pad = mx.zeros((slots - s, h, c, d), self.keys.dtype)
            self.keys, self.values = mx.concatenate([self.keys, pad]), mx.concatenate([self.values, pad])
        if capacity is not None and capacity > c:
            pad = mx.zeros((self.keys.shape[0], h, capacity - c, d), self.keys.dtype)
            self.keys = mx.concatenate([self.keys, pad], axis=2)
            self.values = mx.concatenate([self.values, pad], axis=2)

    def append(self, row: _Row, keys, values) -> None:
        """One row's new tokens (not a decode step's path: see write_step)."""
        start, end = row.own_length, row.own_length + keys.shape[2]
        self.reserve(end)
        self.keys[row.slot : row.slot + 1, :, start:end, :] = keys
        self.values[row.slot : row.slot + 1, :, start:end, :] = values
        row.length += keys.shape[2]

    def write_step(self, rows: list, keys, values) -> None:
        """One new token for each of `rows` ((G, Hkv, 1, D) keys and values, in
        the order of `rows`), written after each row's own tokens with one scatter."""
        self.reserve(max(r.own_length for r in rows) + 1)
        slots = len(self.occupants)
        if sum(self.holds(i) for i in range(slots)) != len(rows):
            raise RuntimeError("a pool slot is held by a row outside this step")
        src = [0] * slots
        pos = [0] * slots  # free slots get a harmless write at position 0
        for j, row in enumerate(rows):
            src[row.slot], pos[row.slot] = j, row.own_length
        order = mx.array(src)
        index = mx.broadcast_to(mx.array(pos)[:, None, None, None], (slots, *keys.shape[1:]))
        self.keys = mx.put_along_axis(self.keys, index, keys[order], axis=2)
        self.values = mx.put_along_axis(self.values, index, values[order], axis=2)
        for row in rows:
            row.length += 1

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _with_capacity(buf, needed: int, step: int):
    """`buf`'s tokens in a new buffer with room for `needed` tokens and more."""
    b, h, n, d = buf.shape
    capacity = ((needed + step - 1) // step + 1) * step
    return mx.concatenate([buf, mx.zeros((b, h, capacity - n, d), buf.dtype)], axis=2)


def _group_attention(q, prefix: SharedKV, rows: list[_Row]):
    """One new token per row for rows that share `prefix`; `q` (G, Hkv, rep, D)
    already scaled. The prefix's K and V are read once for the whole group
    (one product with G*rep query rows per KV head), each row's own tokens
    on their own; one softmax per row over [prefix, own] keeps it exact,
    normalised after the V products (D values per row instead of L)."""
    g, n_kv, rep, d = q.shape
    grouped = q.transpose(1, 0, 2, 3).reshape(1, n_kv, g * rep, d)
    shared = (grouped @ prefix.keys.swapaxes(-1, -2)).reshape(n_kv, g, rep, prefix.length)
    weights_shared, own_out, totals = [], [], []
    for j, row in enumerate(rows):
        k, v = row.view()
        scores = shared[:, j][None]  # (1, Hkv, rep, Lp)
        if k.shape[2]:
            scores = mx.concatenate([scores, q[j : j + 1] @ k.swapaxes(-1, -2)], axis=-1)
        e, total = softmax_weights(scores)
        weights_shared.append(e[..., : prefix.length])
        own_out.append(e[..., prefix.length :] @ v if k.shape[2] else None)
        totals.append(total)
    e = mx.concatenate(weights_shared, axis=0).transpose(1, 0, 2, 3).reshape(1, n_kv, g * rep, prefix.length)
    out = (e @ prefix.values).reshape(n_kv, g, rep, d).transpose(1, 0, 2, 3)  # (G, Hkv, rep, D)
    return [(out[j : j + 1] + own if own is not None else out[j : j + 1]) / totals[j]
            for j, own in enumerate(own_out)]


def _pool_attention(q, pool: _Pool, rows: list[_Row]):
    """One new token per row for `rows`, all in `pool`; `q` (G, Hkv, rep, D),
    already scaled, in the order of `rows`. The rows' own tokens: one masked
    product over the pool's slots, cut at the longest row (free slots attend
    to one zero token and are dropped). Rows that share a prefix add it the
    way _group_attention does, one product per prefix for all its rows; the
    softmax over [prefix, own] stays one per row (a common maximum, the sums
    added before dividing). Returns (G, Hkv, rep, D) in the order of `rows`."""
    slots = max(row.slot for row in rows) + 1  # free slots above the last row cost nothing
    src, lengths = [0] * slots, [1] * slots
    groups: dict = {}  # id(prefix) -> (prefix, slots of its rows)
    for j, row in enumerate(rows):
        src[row.slot], lengths[row.slot] = j, row.own_length
        if row.prefix is not None:
            groups.setdefault(id(row.prefix), (row.prefix, []))[1].append(row.slot)
    longest = max(lengths)
    in_order = src == list(range(slots))
    q_slots = q if in_order else q[mx.array(src)]
    keys, values = pool.keys[:slots, :, :longest, :], pool.values[:slots, :, :longest, :]
    scores = q_slots @ keys.swapaxes(-1, -2) + _length_bias(tuple(lengths), longest)
    if not groups:
        e, total = softmax_weights(scores)  # past a row's length: weight exactly 0
        out = (e @ values) / total
    else:
        _, n_kv, rep, d = q.shape
        top = mx.stop_gradient(scores.max(axis=-1, keepdims=True))  # (S, Hkv, rep, 1)
        shared = []
        for prefix, members in groups.values():
            index, g = mx.array(members), len(members)
            grouped = q_slots[index].transpose(1, 0, 2, 3).reshape(1, n_kv, g * rep, d)
            s = grouped @ prefix.keys.swapaxes(-1, -2)  # (1, Hkv, G*rep, Lp)
            s_top = mx.stop_gradient(s.max(axis=-1, keepdims=True)).reshape(n_kv, g, rep, 1).transpose(1, 0, 2, 3)
            top[index] = mx.maximum(top[index], s_top)
            shared.append((prefix, index, g, s))
        e = exp_shifted(scores, top)
        out, total = e @ values, e.sum(axis=-1, keepdims=True)
        for prefix, index, g, s in shared:
            s_top = top[index].transpose(1, 0, 2, 3).reshape(1, n_kv, g * rep, 1)
            e = exp_shifted(s, s_top)
            out = out.at[index].add((e @ prefix.values).reshape(n_kv, g, rep, d).transpose(1, 0, 2, 3))
            total = total.at[index].add(e.sum(axis=-1, keepdims=True).reshape(n_kv, g, rep, 1).transpose(1, 0, 2, 3))
        out = out / total
    return out if in_order else out[mx.array([row.slot for row in rows])]


@functools.lru_cache(maxsize=4)
def _length_bias(lengths: tuple, longest: int) -> mx.array:
    """(G, 1, 1, longest): 0 for each row's own positions, -inf after (the
    same for every layer of a step, so built once)."""
    bias = mx.where(mx.arange(longest)[None] < mx.array(lengths)[:, None], 0.0, -mx.inf)
    bias = bias.astype(mx.float32)[:, None, None, :]
    mx.eval(bias)
    return bias


class RaggedKVCache(_BaseCache):
    """The KV of a decode batch, one buffer per row (see the module doc)."""

    step = 256

    def __init__(self, rows: list[_Row]):
        self.rows = rows
        self.pool = _Pool(self.step)  # rows without a prefix, from their first step here
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
            if r.pool is self.pool and r.own_length + keys.shape[2] > _Pool.MAX_TOKENS:
                r.detach()  # grown past the pool: a buffer of its own from now on
        fits = [r for r in self.rows if r.own_length + keys.shape[2] <= _Pool.MAX_TOKENS]
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
        b, n_heads, n, d = queries.shape
        if n > 1 or sinks is not None:  # not a decode step: plain attention per row
            outputs = []
            for i, row in enumerate(self.rows):
                k, v = row.full()
                outputs.append(mx.fast.scaled_dot_product_attention(
                    queries[i : i + 1], k, v, scale=scale, mask="causal" if n > 1 else None, sinks=sinks))
            return mx.concatenate(outputs, axis=0)
        # The query heads that share a KV head form one (repeats x D) @ (D x L)
        # product per KV head: on the CPU backend ~1.5x faster than
        # mx.fast.scaled_dot_product_attention, whose grouped-query path
        # multiplies each query head alone against a broadcast copy of K and V.
        n_kv = self.rows[0].view()[0].shape[1]
        q = (queries * scale).reshape(b, n_kv, n_heads // n_kv, d)
        pooled: list = []
        groups: dict = {}
        for i, row in enumerate(self.rows):
            if row.pool is self.pool:
                pooled.append(i)
            else:
                groups.setdefault(id(row.prefix), (row.prefix, []))[1].append(i)
        order, blocks = [], []
        if pooled:
            order += pooled
            whole = len(pooled) == b
            blocks.append(_pool_attention(q if whole else q[mx.array(pooled)], self.pool,
                                          [self.rows[i] for i in pooled]))
        for prefix, members in groups.values():
            index = mx.array(members) if len(members) > 1 else None
            group_q = q[index] if index is not None else q[members[0] : members[0] + 1]
            rows = [self.rows[i] for i in members]
            if prefix is None:  # a row alone outside the pool (never a decode step's usual case)
                outs = []
                for j, row in enumerate(rows):
                    k, v = row.view()
                    e, total = softmax_weights(group_q[j : j + 1] @ k.swapaxes(-1, -2))
                    outs.append((e @ v) / total)
            else:
                outs = _group_attention(group_q, prefix, rows)
            order += members
            blocks.append(mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0])
        out = mx.concatenate(blocks, axis=0) if len(blocks) > 1 else blocks[0]
        if order != list(range(b)):
            out = out[mx.array(sorted(range(b), key=order.__getitem__))]
        return out.reshape(b, n_heads, 1, d)

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
            row.row = _Row(c.keys, c.values, int(c.offset), int(rope_shift))
            c = row
        out.append(c)
    return out


class _Member:
    __slots__ = ("group", "request_id", "rows", "tokens")

    def __init__(self, request_id, tokens, rows):
        self.request_id, self.tokens, self.rows, self.group = request_id, tokens, rows, None


class _Group:
    __slots__ = ("layers", "members", "tokens")

    def __init__(self, tokens, layers):
        self.tokens, self.layers, self.members = tokens, layers, set()


class PrefixSharing:
    """Finds rows of a decode batch whose prompts begin with the same tokens
    (agents of a swarm resending one system prompt) and makes them share one
    copy of that prefix's KV: attention reads it once per step for all of
    them (see _group_attention) and memory holds it once.

    Equal tokens at equal positions give equal KV, so tokens decide; callers
    pass only requests whose KV is a function of their tokens (no images, no
    rope shift). A prefix is shared from `min_tokens` on; each row shares at
    most one prefix (the longest found when it joins)."""

    def __init__(self, min_tokens: int = 256):
        self.min_tokens = min_tokens
        self._members: dict = {}  # request id -> _Member
        self.groups_formed = 0  # a counter, for the worker's stats

    @property
    def saved_tokens(self) -> int:
        """Prefix tokens of KV the batch does not hold twice right now."""
        groups = {id(m.group): m.group for m in self._members.values() if m.group is not None}
        return sum(len(g.tokens) * (len(g.members) - 1) for g in groups.values())

    def admit(self, request_id: str, tokens, cache: list) -> int:
        """Register a joining request (its cache from rows_of); share a prefix
        with a live one if it can. Returns the tokens shared (0 if none)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        rows = [c.row for c in cache if isinstance(c, RowKVCache)]
        if not rows or len(tokens) < self.min_tokens:
            return 0
        best_group, best_member, best_len = None, None, self.min_tokens - 1
        for m in self._members.values():
            if m.group is not None and len(m.group.tokens) > best_len and _starts_with(tokens, m.group.tokens):
                best_group, best_member, best_len = m.group, None, len(m.group.tokens)
        for m in self._members.values():
            if m.group is None and len(m.rows) == len(rows):
                n = _common_prefix(tokens, m.tokens)
                if n > best_len:
                    best_group, best_member, best_len = None, m, n
        if best_member is not None:  # the first two rows of a new group
            best_group = _Group(tokens[:best_len], [
                SharedKV(*(mx.contiguous(a[..., :best_len, :]) for a in r.view()))
                for r in best_member.rows])
            self._join(best_member, best_group)
            self.groups_formed += 1
        member = _Member(request_id, tokens, rows)
        self._members[request_id] = member
        if best_group is None:
            return 0
        self._join(member, best_group)
        return len(best_group.tokens)

    def leave(self, request_id: str) -> None:
        member = self._members.pop(request_id, None)
        if member is not None and member.group is not None:
            member.group.members.discard(request_id)

    def _join(self, member: _Member, group: _Group) -> None:
        for row, layer in zip(member.rows, group.layers):
            row.share(layer, RaggedKVCache.step)
        group.members.add(member.request_id)
        member.group = group


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _starts_with(tokens, prefix) -> bool:
    return len(tokens) >= len(prefix) and bool(np.array_equal(tokens[: len(prefix)], prefix))
