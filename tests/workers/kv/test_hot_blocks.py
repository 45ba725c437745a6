"""The hot tier: prefix-cache blocks a worker keeps as MLX arrays, and the
handoff by reference that lets decode take a prompt's blocks from there.

Real MLX on a tiny random llama; the cache service is the in-memory
FakeCacheService (tests/support/cache_fakes.py: one bytearray), so a test can
see every call and can wipe the arena to prove a block came from the hot tier.
Greedy output must equal mlx-lm's own generation.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protos.messages import DecodeRequest, KVHandoff
from tests.support.cache_fakes import FakeCacheService
from tests.support.tiny_models import Counting, greedy, prompt_of, reference
from workers.decode.engine import DecodeEngine
from workers.kv.hot_blocks import HotBlocks, join, tail_of
from workers.kv.blocks import KVLayout
from workers.prefill.engine import PrefillEngine
from workers.kv.prefix_cache import make_prefix_cache

BS = 8  # small blocks: short prompts span several
BIG = 64 << 20


def hot_prefix(model, model_dir, fake, hot_bytes=BIG):
    prefix = make_prefix_cache(model, str(model_dir), BS, fake, fake.buffer, hot_bytes=hot_bytes)
    assert prefix is not None and prefix.hot.enabled == (hot_bytes >= prefix.layout.block_nbytes)
    return prefix


def block(value: float):
    a = mx.full((2, 1, 4, 3), value)
    return a, a


# ------------------------------------------------------------------- the LRU --
def test_lru_by_bytes_keeps_a_prompts_head_longest():
    nbytes = block(0)[0].nbytes * 2
    hot = HotBlocks(3 * nbytes, nbytes)
    for i, h in enumerate([b"a", b"b", b"c"]):  # one prompt's blocks, in order
        hot.put(h, *block(i))
    hot.touch([b"a", b"b", b"c"])  # used: the head becomes the most recent
    hot.put(b"d", *block(3))  # over the limit: the least recent goes, the tail "c"
    assert b"c" not in hot and all(h in hot for h in (b"a", b"b", b"d"))
    assert hot.evictions == 1 and hot.nbytes == 3 * nbytes
    assert hot.leading([b"a", b"b", b"c", b"d"]) == 2
    assert float(hot.get(b"d")[0][0, 0, 0, 0]) == 3.0 and hot.hits == 1


def test_a_tier_smaller_than_a_block_is_off():
    hot = HotBlocks(10, 100)
    hot.put(b"a", *block(0))
    assert not hot.enabled and len(hot) == 0


def test_layers_of_different_shapes_get_no_hot_tier():
    layout = KVLayout(block_size=BS, dtype="float32", layers=((2, 16, 16), (4, 16, 16)))
    assert not HotBlocks.for_layout(BIG, layout).enabled
    uniform = KVLayout(block_size=BS, dtype="float32", layers=((2, 16, 16), (2, 16, 16)))
    assert HotBlocks.for_layout(BIG, uniform).enabled


# ------------------------------------------------------------ prefill fetch --
def test_hot_hits_need_no_lookup_and_match_mlx_lm(model, tiny_dir):
    fake = FakeCacheService()
    counted = Counting(model)
    prefix = hot_prefix(counted, tiny_dir, fake)
    prompt = prompt_of(49, 7)  # 6 full blocks, (49 - 1) // 8 = 6 looked up
    expect = reference(model, prompt, 8)

    PrefillEngine(counted, chunk_size=16, prefix=prefix).run(prompt, greedy(8), owner="cold")
    assert len(prefix.hot) == 6  # the stored blocks stay in this worker too
    fake.calls.clear()
    fake.buf[:] = bytes(len(fake.buf))  # wipe the arena: a read from it would be wrong
    counted.tokens = 0
    res = PrefillEngine(counted, chunk_size=16, prefix=prefix).run(prompt, greedy(8), owner="warm")
    assert res.cached_tokens == 48 and counted.tokens == 1
    assert "lookup" not in fake.calls  # every block came from the hot tier
    assert prefix.stats.hot_blocks == 6
    decode = DecodeEngine(model, max_batch=2)
    decode.add(DecodeRequest("warm", prompt, res.first_token, KVHandoff("warm", 49, 49), greedy(8)), res.cache)
    tokens = [res.first_token]
    while decode.has_work:
        tokens += [u.token for u in decode.step()]
    assert tokens == expect


def test_a_worker_without_the_blocks_reads_them_once(model, tiny_dir):
    """Blocks another worker stored: the first hit reads the arena (and keeps
    them), the next needs no lookup; a longer prompt reads only its new blocks."""
    fake = FakeCacheService()
    writer = hot_prefix(model, tiny_dir, fake)
    prompt = prompt_of(41, 8)  # 5 full blocks
    PrefillEngine(model, chunk_size=16, prefix=writer).run(prompt, greedy(), owner="w")
    reader = hot_prefix(model, tiny_dir, fake)
    first = PrefillEngine(model, chunk_size=16, prefix=reader).run(prompt, greedy(), owner="r1")
    assert first.cached_tokens == 40 and reader.stats.hot_blocks == 0 and len(reader.hot) == 5
    fake.calls.clear()
    again = PrefillEngine(model, chunk_size=16, prefix=reader).run(prompt, greedy(), owner="r2")
    assert again.cached_tokens == 40 and reader.stats.hot_blocks == 5 and "lookup" not in fake.calls
    assert again.first_token == first.first_token == reference(model, prompt, 1)[0]


# ---------------------------------------------------- handoff by reference --
def test_hold_and_take_move_only_what_decode_lacks(model, tiny_dir):
    fake = FakeCacheService()
    prefill_side = hot_prefix(model, tiny_dir, fake)
    decode_side = hot_prefix(model, tiny_dir, fake)
    prompt = prompt_of(44, 9)  # 5 full blocks + 4 tokens
    res = PrefillEngine(model, chunk_size=16, prefix=prefill_side).run(prompt, greedy(), owner="a")
    hold = prefill_side.hold(prompt, owner="a", lease_s=60)
    assert len(hold.hashes) == 5 and hold.lease in fake.leases  # leased until decode takes them

    head = decode_side.take(hold.hashes, hold.arena, hold.offsets, hold.lease)
    assert hold.lease not in fake.leases  # released
    kv = join(head, tail_of(res.cache, 40))
    assert all(c.offset == 44 for c in kv)
    for got, want in zip(kv, res.cache):
        np.testing.assert_array_equal(np.array(got.keys[..., :44, :]), np.array(want.keys[..., :44, :]))
        np.testing.assert_array_equal(np.array(got.values[..., :44, :]), np.array(want.values[..., :44, :]))

    # The same blocks again: all from decode's own memory; the arena is not read.
    hold = prefill_side.hold(prompt, owner="b", lease_s=60)
    fake.buf[:] = bytes(len(fake.buf))
    again = decode_side.take(hold.hashes, hold.arena, hold.offsets, hold.lease)
    assert decode_side.stats.hot_blocks == 5 and not fake.leases
    for got, want in zip(again, head):
        np.testing.assert_array_equal(np.array(got.keys), np.array(want.keys))


def test_take_with_a_tier_too_small_for_the_prompt(model, tiny_dir):
    """Two blocks of hot tier for a five-block prompt: blocks are evicted
    while the prompt is assembled, and the KV is still exact."""
    fake = FakeCacheService()
    prefill_side = hot_prefix(model, tiny_dir, fake)
    prompt = prompt_of(40, 10)
    res = PrefillEngine(model, chunk_size=16, prefix=prefill_side).run(prompt, greedy(), owner="a")
    decode_side = hot_prefix(model, tiny_dir, fake, hot_bytes=2 * prefill_side.layout.block_nbytes)
    for owner in ("a", "b"):
        hold = prefill_side.hold(prompt, owner=owner, lease_s=60)
        kv = decode_side.take(hold.hashes, hold.arena, hold.offsets, hold.lease)
        assert len(decode_side.hot) == 2 and decode_side.hot.evictions > 0
        for got, want in zip(kv, res.cache):
            np.testing.assert_array_equal(np.array(got.keys), np.array(want.keys[..., :40, :]))
    assert not fake.leases


def _turn(model, prefill_side, decode, rid, prompt, n):
    """One turn of a conversation: prefilled with `prefill_side`'s blocks,
    decoded to its end by `decode`, which commits as the decode worker does.
    (its tokens, the prefill's result)."""
    res = PrefillEngine(model, chunk_size=16, prefix=prefill_side).run(prompt, greedy(n), owner=rid)
    decode.add(DecodeRequest(rid, prompt, res.first_token, KVHandoff(rid, res.num_tokens, res.rope_offset),
                             greedy(n)), res.cache)
    tokens = [res.first_token]
    while decode.has_work:
        tokens += [u.token for u in decode.step()]
        decode.commit_finished()
    return tokens, res


def test_decode_commits_keep_the_conversation_hot(model, tiny_dir):
    """A finished request's blocks (prompt + answer) stay in the decode
    worker: the next turn's handoff finds them there."""
    fake = FakeCacheService()
    prefill_side = hot_prefix(model, tiny_dir, fake)
    decode_side = hot_prefix(model, tiny_dir, fake)
    prompt = prompt_of(30, 11)
    decode = DecodeEngine(model, max_batch=2, prefix=decode_side)
    answer, _ = _turn(model, prefill_side, decode, "t1", prompt, 20)
    assert answer == reference(model, prompt, 20)
    conversation = prompt + answer  # 50 tokens: 6 full blocks committed by decode
    assert len(decode_side.hot) == 6
    turn2 = conversation[:48] + prompt_of(5, 12)
    hold = prefill_side.hold(turn2, owner="t2", lease_s=60)
    assert len(hold.hashes) == 6
    fake.buf[:] = bytes(len(fake.buf))
    decode_side.take(hold.hashes, hold.arena, hold.offsets, hold.lease)
    assert decode_side.stats.hot_blocks == 6  # nothing read from the (wiped) arena


def test_a_next_turn_reads_the_conversations_tail_with_its_hot_blocks(model, tiny_dir):
    """The tokens after a conversation's last full block come from its tail
    block, after the blocks this worker holds and those it reads: the next
    turn computes its new message alone, and answers as mlx-lm does; again
    once every full block is hot, with the tail read alone."""
    fake = FakeCacheService()
    prefill_side = hot_prefix(model, tiny_dir, fake)
    decode_side = hot_prefix(model, tiny_dir, fake)
    prompt = prompt_of(30, 21)
    decode = DecodeEngine(model, max_batch=2, prefix=decode_side)
    answer, _ = _turn(model, prefill_side, decode, "t1", prompt, 20)
    conversation = prompt + answer  # 50 tokens: 6 full blocks and a tail of 2
    for i, hot in ((0, 3), (1, 6)):  # the prompt's 3 blocks are hot here, then all 6
        turn2 = conversation + prompt_of(5, 30 + i)
        counted = Counting(model)
        before = prefill_side.stats.hot_blocks
        got, res = _turn(counted, prefill_side, decode, f"t2{i}", turn2, 8)
        assert res.cached_tokens == 50 and counted.tokens == 5 and prefill_side.stats.hot_blocks - before == hot
        assert got == reference(model, turn2, 8)
    assert prefill_side.stats.tail_tokens == 4


def test_a_block_neither_hot_nor_readable_fails_the_take(model, tiny_dir):
    fake = FakeCacheService()
    prefix = hot_prefix(model, tiny_dir, fake)
    prompt = prompt_of(24, 13)
    PrefillEngine(model, chunk_size=16, prefix=prefix).run(prompt, greedy(), owner="a")
    hold = prefix.hold(prompt, owner="a", lease_s=60)
    other = hot_prefix(model, tiny_dir, fake)
    with pytest.raises(ValueError):
        other.take(hold.hashes, hold.arena, [len(fake.buf)] * len(hold.hashes), hold.lease)
    assert not fake.leases  # released all the same


def test_without_a_hot_tier_the_handoff_still_refers_to_blocks(model, tiny_dir):
    """--hot-kv-memory 0: fetch and take read the arena every time, exactly."""
    fake = FakeCacheService()
    prefill_side = hot_prefix(model, tiny_dir, fake, hot_bytes=0)
    decode_side = hot_prefix(model, tiny_dir, fake, hot_bytes=0)
    prompt = prompt_of(36, 14)
    res = PrefillEngine(model, chunk_size=16, prefix=prefill_side).run(prompt, greedy(), owner="a")
    again = PrefillEngine(model, chunk_size=16, prefix=prefill_side).run(prompt, greedy(), owner="b")
    assert again.cached_tokens == 32 and again.first_token == res.first_token
    hold = prefill_side.hold(prompt, owner="c", lease_s=60)
    kv = join(decode_side.take(hold.hashes, hold.arena, hold.offsets, hold.lease), tail_of(res.cache, 32))
    for got, want in zip(kv, res.cache):
        np.testing.assert_array_equal(np.array(got.keys[..., :36, :]), np.array(want.keys[..., :36, :]))
    assert len(decode_side.hot) == 0 and decode_side.stats.hot_blocks == 0 and not fake.leases


def test_hot_tier_size_per_worker():
    """An eighth of a discrete GPU's memory per model process, a thirty-second
    of a Mac's working set (unified memory: that is RAM), a small fixed tier
    on a CPU; fed an H100's and a Mac's device info."""
    from workers.models.loading import CPU_HOT_KV, hot_kv_bytes

    assert hot_kv_bytes(True, {}, 2) == CPU_HOT_KV
    assert hot_kv_bytes(False, {"total_memory": 85520809984}, 2) == 85520809984 // 16
    mac = {"memory_size": 68719476736, "max_recommended_working_set_size": 51539607552}
    assert hot_kv_bytes(False, mac, 3) == 51539607552 // 96
    assert hot_kv_bytes(False, {}, 1) == CPU_HOT_KV  # unknown device: the small tier
