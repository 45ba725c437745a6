"""A decode batch whose rows keep their own KV buffers: joining and leaving copy nothing.

mlx-lm's BatchKVCache keeps the batch's KV in one left-padded array. Every
request that joins is padded and concatenated into it, every one that leaves
is filtered out of it, and each copies the whole batch's KV; every row is also
padded to the longest context. With a swarm of agents (16 conversations of
1–2k tokens, ~1 GB of fp32 KV on the embedded model) a join or a leave costs
more than a decode step, and they happen every few steps.

Here each row keeps the buffer it arrived with (the handoff's KVCache) and
grows it on its own; attention runs row by row over exactly that row's
tokens, while everything else in the layer (projections, MLP, lm_head) still
runs batched, which is where batching pays. Joining appends a row, leaving
drops one: no KV moves.

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


import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, _BaseCache

from workers.cpu_attention import softmax_weights



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
    then its own tokens in a buffer it grows alone."""

    __slots__ = ("keys", "length", "prefix", "rope_shift", "values")

    def __init__(self, keys, values, length: int, rope_shift: int = 0, prefix: SharedKV | None = None):
        self.prefix = prefix
        self.keys, self.values = keys, values
        self.length = length  # all tokens, the prefix's included
        self.rope_shift = rope_shift

    @property
    def own_length(self) -> int:
        return self.length - (self.prefix.length if self.prefix is not None else 0)

    def append(self, keys, values, step: int) -> None:
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
        return self.keys[..., :n, :], self.values[..., :n, :]

    def full(self):
        """Every token's KV, the prefix's included (a copy when there is a prefix)."""
        k, v = self.view()
        if self.prefix is None:
            return k, v
        return (mx.concatenate([self.prefix.keys, k], axis=2), mx.concatenate([self.prefix.values, v], axis=2))

    def share(self, prefix: SharedKV, step: int = 256) -> None:
        """Drop the first `prefix.length` tokens of this row's own buffer in
        favour of `prefix` (the same KV, held once for several rows)."""
        if self.prefix is not None:
            raise ValueError("row already has a shared prefix")
        n = self.length
        self.keys = _with_capacity(self.keys[..., prefix.length:n, :], n - prefix.length, step)
        self.values = _with_capacity(self.values[..., prefix.length:n, :], n - prefix.length, step)
        self.prefix = prefix


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


class RaggedKVCache(_BaseCache):
    """The KV of a decode batch, one buffer per row (see the module doc)."""

    step = 256

    def __init__(self, rows: list[_Row]):
        self.rows = rows
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
        for i, row in enumerate(self.rows):
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
        n_kv = self.rows[0].keys.shape[1]
        q = (queries * scale).reshape(b, n_kv, n_heads // n_kv, d)
        outputs: list = [None] * b
        groups: dict = {}
        for i, row in enumerate(self.rows):
            if row.prefix is None:
                k, v = row.view()
                e, total = softmax_weights(q[i : i + 1] @ k.swapaxes(-1, -2))
                outputs[i] = (e @ v) / total
            else:
                groups.setdefault(id(row.prefix), (row.prefix, []))[1].append(i)
        for prefix, members in groups.values():
            index = mx.array(members) if len(members) > 1 else None
            group_q = q[index] if index is not None else q[members[0] : members[0] + 1]
            for i, out in zip(members, _group_attention(group_q, prefix, [self.rows[i] for i in members])):
                outputs[i] = out
        return mx.concatenate(outputs, axis=0).reshape(b, n_heads, 1, d)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        if window_size is not None:
            raise ValueError("RaggedKVCache holds full-attention layers only")
        # attend() masks each row itself

    # -- what BatchGenerator does with a batch cache ----------------------------
    def filter(self, batch_indices):
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
        self.rows = [self.rows[int(i)] for i in indices]

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
        # in each copy: sharing the row objects is safe and copies no KV.
        return RaggedKVCache(list(self.rows))

    @property
    def state(self):
        return [a for r in self.rows for a in (r.keys, r.values)]

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
        own = sum(r.keys.nbytes + r.values.nbytes for r in self.rows)
        return own + sum(p.keys.nbytes + p.values.nbytes for p in self._prefixes())


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
                SharedKV(mx.contiguous(r.keys[..., :best_len, :]), mx.contiguous(r.values[..., :best_len, :]))
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
