"""mlx-lm's padded decode batch KV, with rows dropped by contiguous copies.

When a request leaves the batch, BatchKVCache.filter keeps the other rows
with a gather (`keys[indices]`). On an H100, for 32 rows of 2k-token contexts
(Qwen3-0.6B shape, 28 layers) that gather took 33.6 ms, against 5.4 ms to
copy the same rows as runs of contiguous slices (BENCHMARKS.md, session 5);
a swarm drops a row every other step. Everything else is mlx-lm's.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


class RunsBatchKVCache(BatchKVCache):
    def filter(self, batch_indices):
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        keys, values, idx = self.keys, self.values, self._idx
        # mlx-lm's filter for the per-row bookkeeping (offsets, left padding,
        # trimming shared padding), with no arrays to gather...
        self.keys = self.values = None
        super().filter(keep)
        if keys is None:
            return
        # ...then the rows, run by run, trimmed as mlx-lm just trimmed _idx.
        trim = idx - self._idx
        self.keys = _rows(keys, keep)[..., trim:, :]
        self.values = _rows(values, keep)[..., trim:, :]


def runs(indices: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted or not, indices -> [(start, end), ...] of consecutive ones, in order."""
    out: List[Tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _rows(a: mx.array, keep: Sequence[int]) -> mx.array:
    parts = [a[s:e] for s, e in runs(keep)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
