"""Decode after a VLM prefill: mlx-lm's text model with its rope positions shifted.

A VLM prompt is prefilled by mlx-vlm's language model (workers/vision/), and
decode then continues on mlx-lm's *text* model over that same cache. After
the last image every M-RoPE component of a text token is the same number,
`token_index + rope_delta`, and M-RoPE with three equal components is plain
RoPE (each of the t/h/w frequency sections rotates by the same position), so
mlx-lm's qwen2 computes exactly Qwen2.5-VL's decode step if its rope offset is
shifted by the delta (`rope_delta`, negative: an image of h x w merged patches
takes h*w tokens but advances positions by max(h, w)). mlx-lm's attention
reads the rope position from `cache.offset`:

* `KVCache.offset` is also the write index and the mask offset, so it cannot
  be shifted. `shift_rope(cache, delta)` turns each plain KVCache into a
  batch-of-one `BatchKVCache` (same buffers, no copy) whose per-row `offset`
  (an array) only feeds rope, while writes go by `_idx` and the mask by
  `_idx` and `left_padding`.
* In a running `BatchKVCache` a row's shift survives `filter`, `extend` and
  `trim` (they carry `offset` along) but not `merge` or `extract`, which
  rebuild `offset` from the lengths. So a request must get its shift after
  it has joined the batch (BatchGenerator merges on insert;
  `shift_batch_rope` shifts rows of a merged batch), or ride in a cache that
  carries it into the merge: `ShiftedKVCache` (the decode worker's padded
  batches, on a GPU) or workers/decode/ragged_kv.py's rows (on the CPU).
* Gemma 3 (plain rope, sliding-window layers in a RotatingKVCache) has delta 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers.kernels.mlx_cache import set_write_index
from workers.kernels.slot_batch_cache import SlotBatchKVCache


def shift_rope(cache: list, delta: int) -> list:
    """The prefilled `cache` ready for mlx-lm's text model to decode with its
    rope positions moved by `delta` (see the module doc). delta 0: the cache
    itself. Otherwise each plain KVCache becomes a batch-of-one BatchKVCache
    over the same buffers (no copy) whose rope offset is `length + delta`; other kinds
    (windows, recurrent state) cannot carry a shift and raise."""

    if not delta:
        return cache
    out = []
    for c in cache:
        if type(c) is not KVCache:
            raise TypeError(f"cannot shift the rope of a {type(c).__name__}")
        b = BatchKVCache([0])
        b.keys, b.values = c.keys, c.values
        set_write_index(b, c.offset)
        b.offset = mx.array([c.offset + int(delta)])
        out.append(b)
    return out


class ShiftedKVCache(KVCache):
    """A request's plain KVCache layer plus its rope shift, which
    BatchGenerator's merge (`caches[0].merge`) adds to the merged
    BatchKVCache's per-row offsets; filter and extend then carry it along.
    Every row of a batch must be one of these (shift 0 for text), since the
    first row's class does the merge."""

    rope_shift: int = 0

    @classmethod
    def of(cls, cache: list, delta: int) -> list:
        """`cache` (per-layer KVCaches, one request) as ShiftedKVCaches over
        the same buffers; other layer kinds pass through when delta is 0
        and raise otherwise (a window or recurrent state has no offset to move)."""
        out = []
        for c in cache:
            if type(c) is not KVCache:
                if delta:
                    raise TypeError(f"cannot shift the rope of a {type(c).__name__}")
                out.append(c)
                continue
            s = cls()
            s.keys, s.values, s.offset, s.rope_shift = c.keys, c.values, c.offset, int(delta)
            out.append(s)
        return out

    @classmethod
    def merge(cls, caches):
        batch = SlotBatchKVCache.merge(caches)  # workers/kernels/slot_batch_cache.py: joins and leaves in place
        shifts = [getattr(c, "rope_shift", 0) for c in caches]
        if any(shifts):
            batch.offset = batch.offset + mx.array(shifts)
        return batch


def shift_batch_rope(cache: list, deltas: Sequence[int]) -> list:
    """Per-row rope shifts on a running batch's caches (mlx-lm BatchKVCache
    layers, e.g. after BatchKVCache.merge), in place: row i's rope positions
    move by deltas[i]. Call it once the batch is built: merge and extract
    rebuild offsets from the lengths and drop any shift."""
    shift = mx.array([int(d) for d in deltas])
    for c in cache:
        if not isinstance(c, BatchKVCache):
            raise TypeError(f"cannot shift the rope of a {type(c).__name__}")
        c.offset = c.offset + shift
    return cache
