"""The storage of a ragged decode batch's rows (workers/decode/ragged_kv.py).

A row (`Row`) is one request's KV in one layer: an optional prefix it
shares with other rows (`SharedKV`), then its own tokens, either in a
buffer it grows alone or, while it is short and decoding, in a slot of the
layer's `Pool`, where one scatter writes every row's new token.
"""

from __future__ import annotations

import mlx.core as mx


class SharedKV:
    """KV of a prompt prefix that several rows of a batch have in common (one
    layer). Immutable: rows append after it, in their own buffers."""

    __slots__ = ("keys", "length", "values")

    def __init__(self, keys, values):
        self.keys, self.values, self.length = keys, values, int(keys.shape[2])


class Row:
    """One request's KV in a RaggedKVCache layer: an optional shared prefix,
    then its own tokens, either in a buffer it grows alone or, for rows
    without a prefix while they decode, in a slot of the batch's Pool."""

    __slots__ = ("keys", "length", "pool", "prefix", "rope_shift", "slot", "values")

    def __init__(self, keys, values, length: int, rope_shift: int = 0, prefix: SharedKV | None = None):
        self.prefix = prefix
        self.keys, self.values = keys, values
        self.length = length  # all tokens, the prefix's included
        self.rope_shift = rope_shift
        self.pool: Pool | None = None  # when set, keys/values are None: the KV is in pool[slot]
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


class Pool:
    """The own tokens' KV (after any shared prefix) of one batch layer's rows,
    a slot per row: (slots, Hkv, capacity, D) keys and values. A decode step
    then writes every row's new token with one scatter and attends over all
    of them with one masked product (ragged_attention.py's _pool_attention)
    instead of ~10 small ops per row, which on the CPU cost more than the
    arithmetic (16 rows of ~200 tokens: 93 ms of attention per step row by
    row). Joining copies the newcomer's KV
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
        self.occupants: list = []  # slot -> the Row that was put there (it may have left)

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

    def append(self, row: Row, keys, values) -> None:
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
