"""mlx-lm's padded decode batch KV, with rows dropped by contiguous copies.

When a request leaves the batch, mlx-lm's BatchKVCache.filter keeps the
other rows with a gather (`keys[indices]`), reads the kept rows' padding back
from the device (waiting for the step in flight) and trims the shared padding
as a view, which makes the next step's in-place token write copy the whole
batch again. On an H100, 32 rows of 1.3-2.4k tokens (Qwen3-0.6B shape): a
leave cost 45-60 ms plus up to 100 ms in the step after; copying the kept
rows as runs of contiguous slices, trimmed as they are copied, costs ~25 ms
and leaves the next step alone (BENCHMARKS.md, session 6). Everything else is
mlx-lm's.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache


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
