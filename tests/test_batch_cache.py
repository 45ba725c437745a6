"""The decode batch's KV with rows dropped by contiguous copies
(workers/batch_cache.py): the same rows, offsets and padding as mlx-lm's
gather, and the same tokens through BatchGenerator."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers import batch_cache
from workers.batch_cache import RunsBatchKVCache, runs

try:
    from tests.test_engines import drive, greedy, model, prompt_of, reference
except ImportError:  # pragma: no cover
    from test_engines import drive, greedy, model, prompt_of, reference  # noqa: F401


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
    assert ours.left_padding.dtype == theirs.left_padding.dtype and ours.offset.dtype == theirs.offset.dtype
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert mx.array_equal(ours.keys, theirs.keys) and mx.array_equal(ours.values, theirs.values)
    # It keeps working as a cache: the next token lands in the same place.
    new = mx.ones((len(keep), 2, 1, 4))
    k1, _ = ours.update_and_fetch(new, new)
    k2, _ = theirs.update_and_fetch(new, new)
    assert mx.array_equal(k1, k2)


def test_decode_batch_with_rows_coming_and_going_matches_mlx_lm(model, monkeypatch):
    """The padded batch a GPU decodes with, on this CPU: rows join at
    different steps and leave in every position (first, middle, and the
    longest, whose padding every other row then sheds); each request's
    greedy tokens equal mlx-lm's generate_step alone."""
    lengths = [40, 9, 23, 61, 15, 33]
    joins = [0, 0, 1, 2, 4, 7]
    answers = [6, 14, 9, 3, 12, 8]  # the 61-token row leaves first
    jobs = [(f"r{i}", joins[i], prompt_of(n, 200 + i), greedy(answers[i])) for i, n in enumerate(lengths)]
    classes, sizes, trims = set(), [], []
    rows = batch_cache._rows
    monkeypatch.setattr(batch_cache, "_rows", lambda a, keep, trim: trims.append(trim) or rows(a, keep, trim))

    def observe(step, decode):
        batch = decode._batch.prompt_cache
        if batch:
            classes.add(type(batch[0]))
            sizes.append(len(decode._batch))

    outs = drive(model, jobs, max_batch=8, ragged=False, observe=observe)
    assert classes == {RunsBatchKVCache}
    assert max(sizes) >= 4 and len(set(sizes)) >= 3  # rows really came and went
    assert any(trims)  # and once the longest left, the rest shed padding
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
