"""The decode batch's KV a GPU uses (workers/kernels/slot_batch_cache.py): rows dropped by
contiguous copies (RunsBatchKVCache: the same rows, offsets and padding as
mlx-lm's gather), and rows that join and leave in place (SlotBatchKVCache:
the same rows as mlx-lm's BatchKVCache, with only the rows that move
copied); the same tokens as mlx-lm through the decode engine."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from tests.support.pipeline import drive, reference
from tests.support.tiny_models import greedy, prompt_of
from workers.kernels.slot_batch_cache import RunsBatchKVCache, SlotBatchKVCache, runs, swap_remove_order


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


def test_swap_remove_order():
    assert swap_remove_order([0, 2, 3, 4], 5) == [0, 4, 2, 3]
    assert swap_remove_order([3, 4], 5) == [3, 4]
    assert swap_remove_order([0, 1, 2], 5) == [0, 1, 2]
    assert swap_remove_order([1, 4], 5) == [4, 1]


def _rows_of(cache) -> list:
    """Each row's KV without padding, its rope offset: what attention sees."""
    offsets = cache.offset.tolist()
    return [(cache.extract(i).keys, cache.extract(i).values, offsets[i]) for i in range(len(offsets))]


def test_slot_batch_joins_and_leaves_like_mlx_lms_batch(monkeypatch):
    """Rows join (shorter than the batch, then longer: every row moves right)
    and leave (the last row takes the leaver's slot) through decode steps; each
    row's KV and offset stay those of mlx-lm's BatchKVCache with its rows in
    the same order, and the buffers grow only when they must."""
    grows = []
    grow = SlotBatchKVCache._grow
    monkeypatch.setattr(SlotBatchKVCache, "_grow", lambda self, *a: grows.append(a) or grow(self, *a))
    ours = SlotBatchKVCache.merge([row(n, i) for i, n in enumerate([5, 9, 3])])
    theirs = BatchKVCache.merge([row(n, i) for i, n in enumerate([5, 9, 3])])
    seed = [100]

    def step():
        new = mx.random.normal((len(ours._pads), 2, 1, 4), key=mx.random.key(seed[0]))
        seed[0] += 1
        k1, v1 = ours.update_and_fetch(new, new * 2)
        k2, v2 = theirs.update_and_fetch(new, new * 2)
        assert _same(ours, theirs)

    def join(*lengths):
        ours.extend(SlotBatchKVCache.merge([row(n, seed[0] + i) for i, n in enumerate(lengths)]))
        theirs.extend(BatchKVCache.merge([row(n, seed[0] + i) for i, n in enumerate(lengths)]))
        seed[0] += len(lengths)
        assert _same(ours, theirs)

    def leave(keep):
        order = swap_remove_order(keep, len(ours._pads))
        ours.filter(order)
        theirs.filter(order)
        assert _same(ours, theirs)

    step()
    join(4)  # a merged batch has no spare slots yet: it grows, with spares
    assert len(grows) == 2 and ours.keys.shape[0] > 4
    grows.clear()
    join(2, 6)  # shorter than the batch: into spare slots
    step()
    assert grows == []
    leave([0, 2, 3, 4])  # row 1 leaves, the last row takes its slot
    step()
    leave([1, 2, 3])  # the first row leaves
    assert grows == []
    join(30)  # longer than every row: all rows move right, with headroom
    assert len(grows) == 1
    join(31)  # within the headroom: no move
    step()
    assert len(grows) == 1
    leave([0, 1, 2, 3])  # the last row leaves: nothing moves
    step()
    assert len(grows) == 1


def _same(ours, theirs) -> bool:
    a, b = _rows_of(ours), _rows_of(theirs)
    return len(a) == len(b) and all(
        mx.array_equal(k1, k2) and mx.array_equal(v1, v2) and o1 == o2 for (k1, v1, o1), (k2, v2, o2) in zip(a, b))


def test_a_slot_batch_moves_only_the_rows_that_move():
    """A leave copies the moved row, a join its own rows, a step its token:
    never the whole batch (what mlx-lm's BatchKVCache copies each time)."""
    batch = SlotBatchKVCache.merge([row(2000 + 10 * i, i) for i in range(8)])
    grown = mx.ones((8, 2, 1, 4))
    batch.update_and_fetch(grown, grown)  # room for `step` more positions
    mx.eval(batch.keys, batch.values)
    whole = batch.keys.nbytes + batch.values.nbytes
    row_bytes = whole // batch.keys.shape[0]

    def peak(fn) -> int:
        mx.eval(batch.keys, batch.values, batch.offset, batch.left_padding)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        fn()
        mx.eval(batch.keys, batch.values, batch.offset, batch.left_padding)
        return mx.get_peak_memory() - base

    assert peak(lambda: batch.filter(swap_remove_order([0, 1, 3, 4, 5, 6, 7], 8))) < 2 * row_bytes
    newcomer = SlotBatchKVCache.merge([row(1500, 99)])
    mx.eval(newcomer.keys, newcomer.values)
    assert peak(lambda: batch.extend(newcomer)) < row_bytes
    token = mx.ones((8, 2, 1, 4))
    assert peak(lambda: mx.eval(batch.update_and_fetch(token, token))) < row_bytes
    assert whole > 8 * row_bytes - 1  # (the batch is far bigger than what moved)


def test_a_leave_can_leave_its_copies_to_the_next_step():
    """With defer_moves (the decode batch's way), a leave queues its moved
    rows' copies and hands them over (`moved`) instead of waiting for them;
    once they are computed, as the decode batch does just before its next
    step, the writes and the step still copy rows, never the whole batch,
    and every row holds what it held."""
    batch = SlotBatchKVCache.merge([row(1200 + 10 * i, i) for i in range(6)])
    grown = mx.ones((6, 2, 1, 4))
    batch.update_and_fetch(grown, grown)  # room for `step` more positions
    mx.eval(batch.keys, batch.values)
    row_bytes = (batch.keys.nbytes + batch.values.nbytes) // batch.keys.shape[0]
    before = [batch.extract(i) for i in range(6)]  # views: copied to the host, then dropped
    expect = [(np.array(c.keys), np.array(c.values)) for c in before]
    del before
    batch.defer_moves = True
    batch.filter(swap_remove_order([1, 2, 3, 4, 5], 6))  # row 0 leaves, row 5 takes its slot
    assert len(batch.moved) == 2  # its keys and values, queued, not waited for
    mx.eval(batch.moved)
    batch.moved = []
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    token = mx.ones((5, 2, 1, 4))
    mx.eval(batch.update_and_fetch(token, token))
    assert mx.get_peak_memory() - base < 2 * row_bytes
    for slot, old in zip(range(5), [5, 1, 2, 3, 4]):
        got = batch.extract(slot)
        n = expect[old][0].shape[2]
        assert np.array_equal(np.array(got.keys[:, :, :n]), expect[old][0]), (slot, old)
        assert np.array_equal(np.array(got.values[:, :, :n]), expect[old][1]), (slot, old)


def test_decode_batch_with_rows_coming_and_going_matches_mlx_lm(model):
    """The padded batch a GPU decodes with, on this CPU: rows join at
    different steps (longer and shorter than the batch) and leave in every
    position (first, middle, the longest); each request's greedy tokens
    equal mlx-lm's generate_step alone. Every layer holds one offset and
    one left-padding array through joins, leaves and steps (share_row_state:
    a step adds one to the offsets once, not per layer)."""
    lengths = [40, 9, 23, 61, 15, 33]
    joins = [0, 0, 1, 2, 4, 7]
    answers = [6, 14, 9, 3, 12, 8]  # the 61-token row leaves first
    jobs = [(f"r{i}", joins[i], prompt_of(n, 200 + i), greedy(answers[i])) for i, n in enumerate(lengths)]
    classes, sizes, shared = set(), [], []

    def observe(step, decode):
        batch = decode._batch.prompt_cache
        if batch:
            classes.add(type(batch[0]))
            sizes.append(len(decode._batch))
            shared.append(all(c.offset is batch[0].offset and c.left_padding is batch[0].left_padding
                              for c in batch))

    outs = drive(model, jobs, max_batch=8, ragged=False, observe=observe)
    assert classes == {SlotBatchKVCache}
    assert max(sizes) >= 4 and len(set(sizes)) >= 3  # rows really came and went
    assert shared and all(shared)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
