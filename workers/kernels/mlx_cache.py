"""The private parts of mlx-lm's cache classes that Tandem relies on, named.

Outside workers/kernels/ no module touches mlx-lm's private names; these
accessors are the ones the rest of the code needs (checked against mlx-lm
0.32). workers/kernels/slot_batch_cache.py, a BatchKVCache rewritten for
joins and leaves in place, works on the same state directly.
"""

from __future__ import annotations

from mlx_lm.models.cache import _BaseCache

# Every mlx-lm cache kind derives from it; a cache of our own does too, so
# that mlx-lm (and mlx_hooks) treat it as one of theirs.
BaseCache = _BaseCache


def write_index(cache) -> int:
    """Where a BatchKVCache or RotatingKVCache writes its next token (`_idx`):
    a BatchKVCache's rows all end there (its buffers may be longer); a
    RotatingKVCache's equals its offset until its window first fills."""
    return cache._idx


def set_write_index(cache, index: int) -> None:
    """Set `_idx`, for a BatchKVCache whose buffers we filled ourselves (its
    rows end at `index`)."""
    cache._idx = index
