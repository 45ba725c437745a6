"""Ragged decode batches (workers/decode/ragged_kv.py): rows keep their own KV, rows
with a common prompt prefix share one copy of it, and greedy output stays
token-identical to mlx-lm's generate_step."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx_lm.models.cache import KVCache

from tests.support.pipeline import drive, reference
from tests.support.tiny_models import greedy, prompt_of
from workers.decode import ragged_kv
from workers.decode.engine import DecodeEngine
from workers.decode.prefix_sharing import PrefixSharing
from workers.decode.ragged_rows import Pool
from workers.kernels import mlx_hooks


def shared_prompts(n: int, prefix_len: int, seed: int = 0):
    prefix = prompt_of(prefix_len, seed)
    return [prefix + prompt_of(5 + 9 * i, 100 + i) for i in range(n)]


def test_decode_engine_uses_ragged_rows(model):
    assert DecodeEngine(model, 4).ragged


def test_rows_with_a_common_prefix_share_it_and_match_mlx_lm(model):
    prompts = shared_prompts(6, 300)
    jobs = [(f"r{i}", [0, 0, 1, 3, 3, 6][i], p, greedy(10 + 3 * i)) for i, p in enumerate(prompts)]
    seen = {"saved": 0, "groups": 0}

    def observe(step, decode):
        seen["saved"] = max(seen["saved"], decode.sharing.saved_tokens)
        seen["groups"] = decode.sharing.groups_formed

    outs = drive(model, jobs, max_batch=8, transport="shm", observe=observe)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
    # One group: the first two rows formed it, the other four joined it.
    assert seen["groups"] == 1
    assert seen["saved"] >= 300 * 4  # at least five rows shared the 300 tokens at once


def test_rows_with_short_common_prefixes_do_not_share(model):
    prompts = shared_prompts(3, 100)  # below PrefixSharing's 256-token minimum
    jobs = [(f"r{i}", 0, p, greedy(8)) for i, p in enumerate(prompts)]
    seen = []
    outs = drive(model, jobs, observe=lambda step, d: seen.append(d.sharing.groups_formed))
    assert max(seen) == 0
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens


def filled(model, length: int, seed: int) -> list:
    """A per-layer KVCache of `length` tokens of random KV (batch 1)."""
    attn = model.layers[0].self_attn
    h = attn.n_kv_heads
    d = attn.k_proj.weight.shape[0] // h
    cache = [KVCache() for _ in model.layers]
    rng = np.random.default_rng(seed)
    for layer in cache:
        k = mx.array(rng.standard_normal((1, h, length, d)).astype(np.float32))
        layer.update_and_fetch(k, k + 1)
    return cache


def test_joining_and_leaving_move_no_kv(model):
    caches = [ragged_kv.rows_of(filled(model, 20 + i, i)) for i in range(3)]
    batch = type(caches[0][0]).merge([c[0] for c in caches])
    rows = list(batch.rows)
    assert [r.keys for r in rows] == [c[0].keys for c in caches] or all(
        r.keys is c[0].keys for r, c in zip(rows, caches))
    more = type(caches[0][0]).merge([ragged_kv.rows_of(filled(model, 7, 9))[0]])
    batch.extend(more)
    batch.filter([0, 3])
    assert batch.rows[0] is rows[0] and batch.rows[1] is more.rows[0]
    assert batch.offset.tolist() == [20, 7]


def test_sharing_keeps_every_rows_kv(model):
    base = filled(model, 300, 0)
    tail = filled(model, 40, 1)
    # Two requests whose first 300 tokens (and so their KV) are equal.
    a = [KVCache() for _ in base]
    b = [KVCache() for _ in base]
    for la, lb, l0, l1 in zip(a, b, base, tail):
        la.update_and_fetch(l0.keys[..., :300, :], l0.values[..., :300, :])
        lb.update_and_fetch(mx.concatenate([l0.keys[..., :300, :], l1.keys[..., :40, :]], axis=2),
                            mx.concatenate([l0.values[..., :300, :], l1.values[..., :40, :]], axis=2))
    tokens = list(range(300))
    sharing = PrefixSharing(min_tokens=256)
    ra, rb = ragged_kv.rows_of(a), ragged_kv.rows_of(b)
    assert sharing.admit("a", tokens + [7] * 5, ra) == 0
    assert sharing.admit("b", tokens + [8] * 40, rb) == 300
    assert sharing.saved_tokens == 300
    batch = type(ra[0]).merge([ra[0], rb[0]])
    assert batch.rows[0].prefix is batch.rows[1].prefix
    for i, source in enumerate((a, b)):
        got = batch.extract(i)
        assert got.offset == source[0].offset
        assert mx.array_equal(got.keys, source[0].keys[..., : source[0].offset, :])
    sharing.leave("b")
    assert sharing.saved_tokens == 0


def test_rope_shift_moves_the_rows_position(model):
    (row,) = ragged_kv.rows_of(filled(model, 12, 0), rope_shift=-5)[:1]
    assert type(row).merge([row]).offset.tolist() == [7]


class _OwnAttention(nn.Module):  # a model whose code does not call mlx-lm's attention function
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)


def test_install_refuses_models_without_mlx_lm_attention(model):
    assert mlx_hooks.install(model)
    assert not mlx_hooks.install(_OwnAttention())


def test_attention_that_bypasses_the_rows_is_caught(model):
    cache = ragged_kv.RaggedKVCache([])
    cache.rows = type(ragged_kv.rows_of(filled(model, 4, 0))[0]).merge(
        [ragged_kv.rows_of(filled(model, 4, 0))[0]]).rows
    k = mx.zeros((1, cache.rows[0].keys.shape[1], 1, cache.rows[0].keys.shape[3]))
    cache.update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
        cache.update_and_fetch(k, k)  # nobody attended in between


def _pool_of(decode):
    batch = decode._batch.prompt_cache
    return batch[0].pool if batch and isinstance(batch[0], ragged_kv.RaggedKVCache) else None


def test_rows_without_a_prefix_decode_in_one_pool_and_match_mlx_lm(model):
    """Short rows go into the batch's pool (one scatter, one masked attention
    per step); leaving frees a slot that the next row to join reuses."""
    jobs = [(f"r{i}", [0, 0, 0, 2, 5, 9, 12, 12][i], prompt_of(6 + 7 * i, 30 + i), greedy(6 + 2 * i))
            for i in range(8)]
    seen = {"pooled": 0, "slots": 0}

    def observe(step, decode):
        pool = _pool_of(decode)
        if pool is not None:
            seen["pooled"] = max(seen["pooled"], sum(pool.holds(i) for i in range(len(pool.occupants))))
            seen["slots"] = max(seen["slots"], len(pool.occupants))

    outs = drive(model, jobs, max_batch=8, observe=observe)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
    assert seen["pooled"] >= 4  # rows really decoded from the pool, several at once
    assert seen["slots"] == Pool.SLOTS_STEP  # 8 rows over time, slots reused: never grown


def test_rows_of_two_prefix_groups_and_an_unshared_row_decode_in_one_pool(model):
    """A swarm's rows share a system prompt and keep their own tokens in the
    pool: one masked product for every row's own tokens, one product per
    shared prefix, one softmax per row across both. Two groups with prefixes
    of different lengths and a row with none, joining and leaving, stay
    token-identical to mlx-lm's generate_step."""
    a, b = prompt_of(300, 1), prompt_of(270, 2)
    prompts = [a + prompt_of(4 + 6 * i, 200 + i) for i in range(3)]
    prompts += [b + prompt_of(7 + 5 * i, 300 + i) for i in range(3)]
    prompts.append(prompt_of(40, 400))
    joins = [0, 0, 0, 1, 1, 4, 2]
    jobs = [(f"r{i}", joins[i], p, greedy(8 + 3 * i)) for i, p in enumerate(prompts)]
    seen = {"grouped": 0, "pooled": 0}

    def observe(step, decode):
        pool = _pool_of(decode)
        if pool is not None:
            held = [pool.occupants[i] for i in range(len(pool.occupants)) if pool.holds(i)]
            seen["pooled"] = max(seen["pooled"], len(held))
            seen["grouped"] = max(seen["grouped"], len({id(r.prefix) for r in held if r.prefix is not None}))

    outs = drive(model, jobs, max_batch=8, transport="shm", observe=observe)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
    assert seen["grouped"] == 2  # rows of both groups decoded from the pool at once
    assert seen["pooled"] >= 6


def test_a_shared_row_outgrows_the_pool_by_its_own_tokens(model, monkeypatch):
    """The pool holds a row's own tokens: a 300-token shared prefix does not
    keep it out, its own tokens past MAX_TOKENS do."""
    monkeypatch.setattr(Pool, "MAX_TOKENS", 20)
    prompts = shared_prompts(3, 300)  # own tokens 5, 14 and 23 at the start
    jobs = [(f"r{i}", 0, p, greedy(12)) for i, p in enumerate(prompts)]
    pooled = []

    def observe(step, decode):
        batch = decode._batch.prompt_cache
        if batch:
            pooled.append(sorted(i for i, r in enumerate(batch[0].rows) if r.pool is not None))

    outs = drive(model, jobs, max_batch=4, observe=observe)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
    assert pooled[0] == [0, 1]  # the third row's 23 own tokens never fit
    assert [] in pooled  # the longer of the other two outgrew it too, then the last one alone


def test_a_row_that_outgrows_the_pool_leaves_it_and_stays_exact(model, monkeypatch):
    monkeypatch.setattr(Pool, "MAX_TOKENS", 24)
    jobs = [(f"r{i}", 0, prompt_of(10 + 3 * i, 50 + i), greedy(18)) for i in range(3)]
    own = []

    def observe(step, decode):
        batch = decode._batch.prompt_cache
        if batch:
            own.append(sum(r.pool is None for r in batch[0].rows))

    outs = drive(model, jobs, max_batch=4, observe=observe)
    for rid, _, prompt, sp in jobs:
        assert outs[rid].tokens == reference(model, prompt, sp.max_tokens).tokens, rid
    assert own[0] == 0 and max(own) >= 1  # pooled at first, then some row outgrew 24 tokens


def test_a_split_batch_keeps_every_rows_kv(model):
    """BatchGenerator splits a batch by deep-copying it and filtering both:
    rows that leave a pool take their KV with them."""
    caches = [ragged_kv.rows_of(filled(model, 10 + i, i)) for i in range(4)]
    expected = [mx.array(c[0].keys[..., : 10 + i, :]) for i, c in enumerate(caches)]
    batch = type(caches[0][0]).merge([c[0] for c in caches])
    k = mx.zeros((4, expected[0].shape[1], 1, expected[0].shape[3]))
    batch.update_and_fetch(k, k)  # a step: every row into the pool
    batch.attend(k, 1.0)
    assert all(r.pool is batch.pool for r in batch.rows)
    other = copy.deepcopy(batch)
    batch.filter([0, 2])
    other.filter([1, 3])
    for cache in (other, batch):  # the copy's rows go into a pool of its own
        cache.update_and_fetch(k[:2], k[:2])
        cache.attend(k[:2], 1.0)
    assert other.pool is not batch.pool and all(r.pool is other.pool for r in other.rows)
    for cache, picks in ((batch, [0, 2]), (other, [1, 3])):
        for j, i in enumerate(picks):
            got = cache.extract(j).keys
            assert got.shape[2] == 10 + i + 2
            assert mx.array_equal(got[..., : 10 + i, :], expected[i]).item()


def test_a_row_alone_keeps_its_own_buffer(model):
    """One row has nothing to batch its attention with: the pool would only add bookkeeping."""
    held = []
    outs = drive(model, [("solo", 0, prompt_of(12, 70), greedy(8))],
                 observe=lambda step, d: held.append(_pool_of(d) and _pool_of(d).occupants))
    assert outs["solo"].tokens == reference(model, prompt_of(12, 70), 8).tokens
    assert not any(held)
