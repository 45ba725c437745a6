"""mlx-lm's padded decode batch KV, made cheaper to join and leave.

It lives in workers/kernels/ because it is a rewrite of mlx-lm's
BatchKVCache from the inside: its write index (`_idx`), buffers and padding
are mlx-lm's private state, kept consistent here the way mlx-lm keeps them.

The decode batch on a GPU (Metal or CUDA) is mlx-lm's left-padded
BatchKVCache, which copies the whole batch whenever a row joins (pad and
concatenate) or leaves (a gather, a read-back of the padding that waits for
the step in flight, and a trimmed view that makes the next step's token
write copy the whole batch again). In a swarm rows come and go about once a
step.

  * RunsBatchKVCache drops rows by copying the kept rows as runs of
    contiguous slices, trimmed as they are copied, into fresh arrays
    (session 6: a leave 45-77 -> 15-18 ms on an H100, 32 rows of 1.3-2.4k
    tokens of Qwen3-0.6B). It is also the fallback for any reordering.
  * SlotBatchKVCache (what decode batches use) keeps rows in slots of
    buffers with room to spare: a joining row writes only its own KV, a
    leaving row's slot takes the last row; the whole batch moves only when
    a buffer grows (docs/benchmarks-log.md, session 8).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


class RunsBatchKVCache(BatchKVCache):
    def filter(self, batch_indices):
        """mlx-lm's BatchKVCache.filter: keep rows `batch_indices` and drop
        the left padding they all share; the same result, made cheaper."""
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        # mlx-lm reads the kept rows' padding back from a new array, which
        # waits for the decode step in flight; the whole batch's padding is
        # an array computed long ago.
        pads = self.left_padding.tolist()
        kept = [pads[i] for i in keep]
        trim = min(kept, default=0)
        self.offset = self.offset[mx.array(keep)]
        self.left_padding = mx.array([p - trim for p in kept], dtype=self.left_padding.dtype)
        if self.keys is not None:
            self.keys = _rows(self.keys, keep, trim)
            self.values = _rows(self.values, keep, trim)
        self._idx -= trim


def runs(indices: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted or not, indices -> [(start, end), ...] of consecutive ones, in order."""
    out: List[Tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _rows(a: mx.array, keep: Sequence[int], trim: int) -> mx.array:
    """Rows `keep` of a (B, H, L, D) array, without its first `trim` columns,
    as a new contiguous array (all of `a` itself when nothing changes)."""
    if trim == 0 and keep == list(range(a.shape[0])):
        return a
    parts = [a[s:e, :, trim:, :] for s, e in runs(keep)]
    # One run is a view of `a`; `* 1` makes it an array of its own (exactly).
    return mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0] * 1


class SlotBatchKVCache(RunsBatchKVCache):
    """mlx-lm's padded batch KV, where rows join and leave in place.

    Rows live in slots [0, n) of buffers with room for more rows and more
    positions. Joining rows are written into the next free slots, ending at
    the batch's write position like every row (their own KV is all that is
    copied); a leaving row's slot takes the last row (one row copied;
    workers/decode/engine.py orders the batch's other state the same way,
    `swap_remove_order`). mlx-lm's BatchKVCache copies the whole batch on
    every join and leave (pad and concatenate; gather): on an H100, 32 rows
    of ~2k tokens of Qwen3-0.6B, 10-15 ms each, about once a decode step in a
    swarm. Here the whole batch moves only when a buffer grows: more rows
    than slots (`spare_rows` more each time), every `step` positions (as
    mlx-lm), and a newcomer longer than the batch's write position, when
    every row moves right with `headroom` positions to spare so that the next
    few longer newcomers fit. The left padding every row shares (read by
    attention, never used) is trimmed only once it exceeds `max_shared_padding`.

    Each row's padding is also kept on the host (`_pads`): reading the
    device's copy would wait for the decode step in flight.
    """

    spare_rows = 8
    headroom = 128
    max_shared_padding = 512
    # A leave's moved rows are computed by the owner before the buffers are
    # next written (workers/decode/engine.py), not here: see filter.
    defer_moves = False
    moved: List[mx.array] = []

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        batch._pads = [batch._idx - c.size() for c in caches]
        return batch

    def _n(self) -> int:
        return len(self._pads)

    def update_and_fetch(self, keys, values):
        t = keys.shape[2]
        if self.keys is None:  # (decode batches start filled; for completeness)
            self._pads = [0] * keys.shape[0]
            self.keys, self.values = mx.zeros((0,) + keys.shape[1:], keys.dtype), mx.zeros((0,) + values.shape[1:], values.dtype)
            self._grow(keys.shape[0], t)
        elif self._idx + t > self.keys.shape[2]:
            self._grow(self._n(), self._idx + t)
        prev, n = self._idx, self._n()
        self.offset = _once((self.offset,), t, lambda: self.offset + t)
        self._idx += t
        self.keys[:n, :, prev : self._idx, :] = keys
        self.values[:n, :, prev : self._idx, :] = values
        return self.keys_and_values()

    def keys_and_values(self):
        n = self._n()
        return self.keys[:n, :, : self._idx, :], self.values[:n, :, : self._idx, :]

    def extend(self, other):
        """Newcomers (a merged batch of them) into the next free slots."""
        n, m = self._n(), other.left_padding.shape[0]
        pads = list(getattr(other, "_pads", None) or other.left_padding.tolist())
        if other._idx > self._idx:  # longer than every row's end: all rows move right
            shift = other._idx - self._idx + self.headroom
            self._grow(n + m, self._idx + shift, shift)
        elif n + m > self.keys.shape[0]:
            self._grow(n + m, self._idx)
        d = self._idx - other._idx
        self.keys[n : n + m, :, d : self._idx, :] = other.keys[:m, :, : other._idx, :]
        self.values[n : n + m, :, d : self._idx, :] = other.values[:m, :, : other._idx, :]
        self._pads = self._pads + [p + d for p in pads]
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding + d])
        self.offset = mx.concatenate([self.offset, other.offset])

    def filter(self, batch_indices):
        """Keep rows `batch_indices`, in that order: in place when the order
        only moves rows from past its end into the slots of rows that left
        (swap_remove_order's), else as RunsBatchKVCache does."""
        order = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        pads = [self._pads[i] for i in order]
        moves = [(i, j) for i, j in enumerate(order) if i != j]
        if any(j < len(order) for _, j in moves):
            super().filter(order)  # fresh, trimmed buffers of exactly these rows
            self._pads = [p - min(pads) for p in pads]
            return
        if moves:
            # Each moved row as an array of its own, computed before it is
            # written back: a row written into the buffer it is read from
            # makes MLX copy the whole buffer (the write cannot take the
            # buffer over while the read still holds it). Computing the rows
            # waits for the step in flight; with `defer_moves` the owner
            # does that wait later (`moved`), just before its next step.
            rows = [mx.contiguous(a[j, :, : self._idx, :]) for _, j in moves for a in (self.keys, self.values)]
            if self.defer_moves:
                mx.async_eval(rows)
                self.moved = self.moved + rows
            else:
                mx.eval(rows)
            for n, (i, _) in enumerate(moves):
                self.keys[i, :, : self._idx, :] = rows[2 * n]
                self.values[i, :, : self._idx, :] = rows[2 * n + 1]
            del rows
        self.offset, self.left_padding = _once((self.offset, self.left_padding), tuple(order), lambda: (
            self.offset[mx.array(order)], self.left_padding[mx.array(order)]))
        self._pads = pads
        if pads and min(pads) > self.max_shared_padding:
            self._grow(len(pads), self._idx - min(pads), -min(pads))

    def trim_rows(self, counts: Sequence[int], moving: List[mx.array] | None = None) -> None:
        """Drop the last counts[i] positions of row i (a speculative step's
        rejected drafts, workers/decode/speculation.py). Every row ends at
        the write index: it moves back by the smallest count, and each row
        that drops more is moved right by the difference (that row alone is
        copied; its left padding grows by as much). `moving`: this layer's
        `rows_to_move(counts)`, already evaluated (a batch evaluates every
        layer's at once: one wait instead of one a layer)."""
        counts = [int(c) for c in counts]
        least = min(counts)
        extra = [c - least for c in counts]
        moved = [(i, e) for i, e in enumerate(extra) if e]
        if moved and moving is None:
            moving = self.rows_to_move(counts)
            mx.eval(moving)
        self._idx -= least
        if moved:
            for n, (i, e) in enumerate(moved):
                self.keys[i, :, self._pads[i] + e : self._idx, :] = moving[2 * n]
                self.values[i, :, self._pads[i] + e : self._idx, :] = moving[2 * n + 1]
            self._pads = [p + e for p, e in zip(self._pads, extra)]
        self.offset, self.left_padding = _once((self.offset, self.left_padding), ("trim", tuple(counts)), lambda: (
            self.offset - mx.array(counts), self.left_padding + mx.array(extra) if moved else self.left_padding))

    def rows_to_move(self, counts: Sequence[int]) -> List[mx.array]:
        """The rows trim_rows(counts) moves, as copies to evaluate before it
        writes them back (a row written into the buffer it is read from
        copies the whole buffer: see filter). Lazy; keys then values per row."""
        least = min(int(c) for c in counts)
        return [mx.contiguous(a[i, :, self._pads[i] : self._idx - int(c), :])
                for i, c in enumerate(counts) if int(c) > least for a in (self.keys, self.values)]

    def extract(self, idx):
        """Row `idx` as a KVCache over views of the batch's buffers (nothing
        is copied): copy what you keep and drop the views before the batch's
        next step, or that step's write copies the whole buffer (see filter)."""
        cache = KVCache()
        start = self._pads[idx]
        cache.keys = self.keys[idx : idx + 1, :, start : self._idx]
        cache.values = self.values[idx : idx + 1, :, start : self._idx]
        cache.offset = cache.keys.shape[2]
        return cache

    def _grow(self, rows: int, length: int, shift: int = 0) -> None:
        """New buffers with room for `rows` rows (`spare_rows` more when that
        is more than now) and `length` positions (rounded up to `step`),
        holding the live rows `shift` positions further right (left when
        negative: their first -shift positions are dropped)."""
        n, idx = self._n(), self._idx
        if rows > self.keys.shape[0]:
            rows += self.spare_rows
        rows = max(rows, self.keys.shape[0])
        length = -(-max(length, idx + shift, 1) // self.step) * self.step
        lo = max(-shift, 0)

        def grown(old):
            new = mx.zeros((rows, old.shape[1], length, old.shape[3]), old.dtype)
            if n and idx > lo:
                new[:n, :, lo + shift : idx + shift, :] = old[:n, :, lo:idx, :]
            return new

        self.keys, self.values = grown(self.keys), grown(self.values)
        self._idx = idx + shift
        if shift:
            self._pads = [p + shift for p in self._pads]
            self.left_padding = self.left_padding + shift


def share_row_state(caches) -> None:
    """Give a batch's SlotBatchKVCache layers one `offset` and one
    `left_padding` array (the first layer's). Every layer holds the same rows
    at the same positions, so these are equal per layer; shared, a step's
    `offset + 1` and a leave's reordering are computed by the first layer and
    reused by the others (`_once`): on MLX's CUDA backend a decode step is
    host work per kernel, and Qwen3-0.6B's step had 28 such additions of
    ~840 kernels. Call after the batch's rows change (join, leave)."""
    slots = [c for c in caches if isinstance(c, SlotBatchKVCache)]
    for c in slots[1:]:
        if c._pads == slots[0]._pads and c._idx == slots[0]._idx:  # the same rows, as they must be
            c.offset, c.left_padding = slots[0].offset, slots[0].left_padding


# The last row-state result computed for a batch's layers: (sources, key, result).
_LAST = [((), None, None)]


def _once(sources: tuple, key, compute):
    """compute(), or the result it gave the previous layer when that layer
    had these very arrays (`sources`, by identity) and `key`."""
    last_sources, last_key, result = _LAST[0]
    if last_key == key and len(last_sources) == len(sources) and all(
            a is b for a, b in zip(last_sources, sources)):
        return result
    result = compute()
    _LAST[0] = (sources, key, result)
    return result


def swap_remove_order(keep: Sequence[int], n: int) -> List[int]:
    """The rows `keep` (ascending) of a batch of `n`, reordered so that rows
    past the new end fill the slots of the rows that left, and every other
    row stays where it is: what SlotBatchKVCache.filter does in place."""
    keep = sorted(int(i) for i in keep)
    m = len(keep)
    kept = set(keep)
    holes = [i for i in range(m) if i not in kept]
    tail = [j for j in keep if j >= m]
    order = list(range(m))
    for h, j in zip(holes, tail):
        order[h] = j
    return order
