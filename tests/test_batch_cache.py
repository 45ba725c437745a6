"""The decode batch's KV with rows dropped by contiguous copies
(workers/batch_cache.py): the same rows, offsets and padding as mlx-lm's
gather, and the same tokens through BatchGenerator."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers.batch_cache import RunsBatchKVCache, runs


def row(length: int, seed: int) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, 2, length, 4), key=mx.random.key(seed))
    c.update_and_fetch(k, k + 1)
    return c


def test_runs():
    assert runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]
    assert runs([3]) == [(3, 4)] and runs([]) == []


@pytest.mark.parametrize("keep", [[0, 1, 3, 4], [1, 2, 3, 4], [0, 2, 4], [2], [0, 1, 2, 3]])
def test_filter_equals_mlx_lms(keep):
    """Any rows kept, including dropping the longest (which trims the
    padding every remaining row shares)."""
    lengths = [5, 9, 3, 7, 12]
    ours = RunsBatchKVCache.merge([row(n, i) for i, n in enumerate(lengths)])
    theirs = BatchKVCache.merge([row(n, i) for i, n in enumerate(lengths)])
    assert type(ours) is RunsBatchKVCache
    ours.filter(keep)
    theirs.filter(keep)
    assert ours._idx == theirs._idx
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert mx.array_equal(ours.keys, theirs.keys) and mx.array_equal(ours.values, theirs.values)
    # It keeps working as a cache: the next token lands in the same place.
    new = mx.ones((len(keep), 2, 1, 4))
    k1, _ = ours.update_and_fetch(new, new)
    k2, _ = theirs.update_and_fetch(new, new)
    assert mx.array_equal(k1, k2)
