"""Prefill reusing cached blocks and decode committing a finished
conversation (workers/kv/prefix_cache.py), against the fake cache service and
the real one. Greedy output with cache hits must equal mlx-lm's own
generation (no cache)."""

from __future__ import annotations

import multiprocessing as mp
from typing import List

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from cache_service.client import CacheClient
from protos.messages import BlockRef, DecodeRequest, KVHandoff, SamplingParams
from tests.support.cache_fakes import FakeCacheService
from tests.support.prefix import filled_kv, prefix_for, run_request
from tests.support.tiny_models import Counting, greedy, prompt_of, reference
from workers.decode.engine import DecodeEngine
from workers.kv.block_hash import BlockHasher
from workers.kv.blocks import kv_layout
from workers.kv.prefix_cache import PrefixCache, make_prefix_cache
from workers.prefill.engine import PrefillEngine

BS = 8  # small blocks: short prompts span several


# ---------------------------------------------------------- prefill and decode --
def test_cold_partial_and_full_hits_match_mlx_lm(model, tiny_dir):
    fake = FakeCacheService()
    counted = Counting(model)
    prefix = prefix_for(counted, tiny_dir, fake)
    shared = prompt_of(40, 2)  # 5 full blocks
    a = shared + prompt_of(9, 3)  # 49 tokens: 6 full blocks, (49-1)/8 = 6 looked up
    b = shared + prompt_of(13, 4)  # same first 5 blocks, another tail
    expect = {name: reference(model, p, 10) for name, p in (("a", a), ("b", b))}
    counted.tokens = 0

    # Cold: everything computed, the prompt's 6 full blocks stored.
    res = PrefillEngine(counted, chunk_size=16, prefix=prefix).run(a, greedy(), owner="a1")
    assert res.cached_tokens == 0 and counted.tokens == 49 and len(fake.blocks) == 6
    # Full hit: the same prompt again; only its last token runs.
    counted.tokens = 0
    res = PrefillEngine(counted, chunk_size=16, prefix=prefix).run(a, greedy(), owner="a2")
    assert res.cached_tokens == 48 and counted.tokens == 1
    assert res.first_token == expect["a"][0] and res.num_tokens == 49
    assert not fake.leases  # released at once
    # Partial hit: 5 shared blocks reused, the new tail computed.
    counted.tokens = 0
    res = PrefillEngine(counted, chunk_size=16, prefix=prefix).run(b, greedy(), owner="b")
    assert res.cached_tokens == 40 and counted.tokens == 13
    assert len(fake.blocks) == 6 + 1  # b's 6th block (53 // 8 = 6) is new
    # Whole generations through prefill (hits) + decode equal mlx-lm's.
    for name, p in (("a", a), ("b", b)):
        tokens, res = run_request(model, prefix, p, greedy(10), rid=name)
        assert res.cached_tokens == (len(p) - 1) // BS * BS
        assert tokens == expect[name], name
    assert prefix.stats.failures == 0


def _assert_reads_back(prefix, tokens, cache, blocks):
    """`prefix` serves the first `blocks` full blocks of `tokens`, equal to `cache`'s KV."""
    got, hit = prefix.fetch(tokens + [0], blocks, "reader")
    assert hit == blocks * BS
    for a, b in zip(cache, got):
        assert mx.array_equal(a.keys[..., :hit, :], b.keys) and mx.array_equal(a.values[..., :hit, :], b.values)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_new_blocks_are_stored_from_a_host_copy_of_the_tail(dtype, tiny_dir, model, monkeypatch):
    """A prefill worker stores a prompt's new blocks from its handoff's tail,
    already in host memory (on a GPU: no second device-to-host transfer);
    the blocks read back equal the KV, and a tail that starts after the first
    new block leaves the store to the device copy."""
    import workers.kv.prefix_writes as pc
    from workers.kv import arena_io, blocks, handoff
    from workers.kv.hot_blocks import tail_of

    monkeypatch.setattr(arena_io, "rearrange_on_host", lambda: False)  # the GPU path, where it matters
    device_copies = []
    monkeypatch.setattr(pc, "blocks_for_write", lambda *a: device_copies.append(a) or blocks.blocks_for_write(*a))
    cache = filled_kv(dtype, 45, 5)  # 5 full blocks
    tokens = prompt_of(45, 9)
    layout = kv_layout(cache, BS)
    fake = FakeCacheService()
    prefix = PrefixCache(fake, fake.buffer, BlockHasher(b"m", BS), layout)
    # Blocks 0-1 are cached already (referred to); the tail from token 16 is the handoff's.
    assert prefix.store(tokens[:16], tail_of(cache, 0)[:3], "first") == 2 and len(device_copies) == 1
    buf = bytearray(handoff.kv_nbytes(tail_of(cache, 16)) + 64)
    layers = handoff.write_kv(buf, 0, tail_of(cache, 16))
    host = (16, arena_io.arena_kv_views(buf, layers))
    assert prefix.store(tokens, cache, "second", host=host) == 3 and len(device_copies) == 1
    _assert_reads_back(prefix, tokens, cache, 5)
    # A tail from token 24 does not hold block 2 (tokens 16-23): the device copy serves.
    other = prompt_of(45, 10)
    prefix.store(other[:16], cache, "third")
    calls = len(device_copies)
    assert prefix.store(other, cache, "fourth", host=(24, arena_io.arena_kv_views(buf, layers))) == 3
    assert len(device_copies) == calls + 1


def test_a_store_from_host_copies_can_be_written_by_another_thread(tiny_dir, model, monkeypatch):
    """With `later`, a store from a handoff's host copy reserves and fills
    the hot tier on the calling (MLX) thread, then hands the arena write and
    the commit on: until they run, this worker serves the new blocks from its
    hot tier and the cache service does not have them; after they run on
    another thread (no MLX there), another worker reads them back exact. A
    store that needs device copies hands on host views of them."""
    import threading

    from workers.kv import arena_io, handoff
    from workers.kv.hot_blocks import tail_of

    monkeypatch.setattr(arena_io, "rearrange_on_host", lambda: False)  # the GPU path: host copies vs device copies
    cache = filled_kv(mx.float32, 45, 6)  # 5 full blocks
    tokens = prompt_of(45, 11)
    layout = kv_layout(cache, BS)
    fake = FakeCacheService()
    prefix = PrefixCache(fake, fake.buffer, BlockHasher(b"m", BS), layout, hot_bytes=64 << 20)
    other = PrefixCache(fake, fake.buffer, BlockHasher(b"m", BS), layout)  # another worker: no hot tier
    assert prefix.store(tokens[:16], tail_of(cache, 0)[:3], "first") == 2
    buf = bytearray(handoff.kv_nbytes(tail_of(cache, 16)) + 64)
    layers = handoff.write_kv(buf, 0, tail_of(cache, 16))
    pending = []
    assert prefix.store(tokens, cache, "second", host=(16, arena_io.arena_kv_views(buf, layers)),
                        later=pending.append) == 3
    assert len(pending) == 1 and pending[0].host_only()
    assert other.fetch(tokens + [0], 5, "reader")[1] == 2 * BS  # not committed yet
    assert prefix.fetch(tokens + [0], 5, "self")[1] == 5 * BS  # this worker's hot tier has them
    calls = len(fake.calls)
    done = []
    writer = threading.Thread(target=lambda: done.append(prefix.write_store(pending[0], client=fake)))
    writer.start()
    writer.join(10)
    assert done == [3] and fake.calls[calls:] == ["commit"]
    _assert_reads_back(other, tokens, cache, 5)
    # A tail from token 24 lacks block 2: device copies serve, evaluated here
    # and handed on as host views of them, whose MLX arrays the caller keeps
    # until the write is done (a colocated prefill's store, a decode worker's commit).
    third = prompt_of(45, 12)
    prefix.store(third[:16], cache, "third")
    pending.clear()
    assert prefix.store(third, cache, "fourth", host=(24, arena_io.arena_kv_views(buf, layers)),
                        later=pending.append) == 3
    assert len(pending) == 1 and pending[0].host_only() and pending[0].hot == []
    assert pending[0].kept and all(isinstance(a, mx.array) for a in pending[0].kept)
    assert other.fetch(third + [0], 5, "reader")[1] == 2 * BS  # not committed yet
    assert prefix.fetch(third + [0], 5, "self")[1] == 5 * BS
    writer = threading.Thread(target=lambda: done.append(prefix.write_store(pending[0], client=fake)))
    writer.start()
    writer.join(10)
    assert done[-1] == 3
    _assert_reads_back(other, third, cache, 5)


def test_a_hit_is_recomputed_when_that_is_faster(model, tiny_dir):
    """With measured costs saying a block loads slower than its tokens
    compute (a fast GPU, a small model), the hit is left unread: computed,
    not reported as cached, same tokens; every REPROBE-th such hit is read
    anyway to refresh the load estimate."""
    fake = FakeCacheService()
    counted = Counting(model)
    prefix = prefix_for(counted, tiny_dir, fake)
    a = prompt_of(49, 5)
    engine = PrefillEngine(counted, chunk_size=16, prefix=prefix)
    want = engine.run(a, greedy(), owner="cold").first_token  # stores 6 blocks
    assert engine.compute_cost.value is None  # 16-token chunks are too short to time
    res = engine.run(a, greedy(), owner="warm")
    load = prefix.load_cost.value
    assert res.cached_tokens == 48 and load is not None  # unknown compute cost: load
    engine.compute_cost.add(load / BS / 10)  # compute 10x cheaper than loading
    counted.tokens = 0
    res = engine.run(a, greedy(), owner="recompute")
    assert res.cached_tokens == 0 and counted.tokens == 49 and res.first_token == want
    assert prefix.stats.recomputed_blocks == 6 and not fake.leases
    for i in range(prefix.REPROBE - 1):
        assert engine.run(a, greedy(), owner=f"again{i}").cached_tokens == 0
    assert engine.run(a, greedy(), owner="reprobe").cached_tokens == 48
    for _ in range(8):
        engine.compute_cost.add(prefix.load_cost.value)  # loading cheaper again
    assert engine.run(a, greedy(), owner="cheap").cached_tokens == 48


def test_second_turn_reuses_prompt_and_answer(model, tiny_dir):
    fake = FakeCacheService()
    counted = Counting(model)
    prefix = prefix_for(counted, tiny_dir, fake)
    turn1 = prompt_of(30, 5)
    answer, res = run_request(counted, prefix, turn1, greedy(20), rid="t1")
    assert res.cached_tokens == 0 and answer == reference(model, turn1, 20)
    # The decode worker committed prompt + all 20 answer tokens: 50 // 8
    # blocks, and the 2 tokens after them as a tail block.
    held = turn1 + answer
    hashes = prefix.hasher.hashes(held)
    assert len(hashes) == 6 and all(h in fake.blocks for h in hashes)
    assert len(fake.blocks) == 7 and prefix.hasher.tail_key(hashes[-1], held[48:]) in fake.blocks
    # Turn two: the conversation so far plus a new message. It computes the
    # new message alone: all 50 tokens of turn one come from the cache.
    turn2 = held + prompt_of(7, 6)
    counted.tokens = 0
    res = PrefillEngine(counted, chunk_size=16, prefix=prefix).run(turn2, greedy(), owner="t2")
    assert res.cached_tokens == 50 and counted.tokens == len(turn2) - 50
    assert prefix.stats.tail_tokens == 2
    tokens, res = run_request(model, prefix, turn2, greedy(12), rid="t2b")
    assert res.cached_tokens == 56 and tokens == reference(model, turn2, 12)  # now its own 7 blocks
    # A tail serves only whole: a prompt that leaves it midway takes the full blocks.
    turn2c = held[:49] + prompt_of(7, 7)
    tokens, res = run_request(model, prefix, turn2c, greedy(12), rid="t2c")
    assert res.cached_tokens == 48 and tokens == reference(model, turn2c, 12)


def test_stop_commits_the_stop_token_too(model, tiny_dir):
    """mlx-lm feeds every token it returns (it computes one step ahead), so the
    KV of a stopped request holds the stop token: the next turn's prompt
    (which repeats it) reuses it as well."""
    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    prompt = prompt_of(19, 12)
    ref = reference(model, prompt, 30)
    # A stop whose KV completes a block: that block exists only if the stop
    # token's KV was committed.
    k = next(k for k in range(len(ref)) if (len(prompt) + k + 1) % BS == 0 and ref[k] not in ref[:k])
    stop = ref[k]
    sp = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop])
    tokens, _ = run_request(model, prefix, prompt, sp, rid="s")
    assert tokens == ref[: ref.index(stop) + 1] and tokens[-1] == stop
    held = prompt + tokens
    assert len(fake.blocks) == len(held) // BS
    assert all(h in fake.blocks for h in prefix.hasher.hashes(held))


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_an_ended_request_is_committed_while_the_next_step_runs(model, tiny_dir, ragged, monkeypatch):
    """When a request ends its blocks are reserved at once, but written and
    committed only once the batch's next step is queued (on a GPU the step
    computes while the host copies), and its last token comes back from that
    step() call, after the commit: the next turn finds the answer's blocks.
    Greedy tokens equal mlx-lm's and every full block of each conversation
    ends up in the cache. Fails if the commit runs before the next forward
    (the previous order: the GPU idled through every commit)."""
    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    prompts = {"a": prompt_of(19, 31), "b": prompt_of(26, 32)}
    answers = {"a": 6, "b": 13}
    decode = DecodeEngine(model, max_batch=4, prefix=prefix, ragged=ragged)
    firsts = {}
    for rid, prompt in prompts.items():
        res = PrefillEngine(model, chunk_size=16, prefix=prefix).run(prompt, greedy(answers[rid]), owner=rid)
        firsts[rid] = res.first_token
        decode.add(DecodeRequest(rid, prompt, res.first_token, KVHandoff(rid, res.num_tokens, res.rope_offset),
                                 greedy(answers[rid])), res.cache)
    events = []
    forward = type(model).__call__
    monkeypatch.setattr(type(model), "__call__",
                        lambda self, *a, **k: (events.append(("forward",)), forward(self, *a, **k))[1])
    for call in ("reserve", "commit"):
        real = getattr(fake, call)
        monkeypatch.setattr(fake, call, lambda hashes, *a, _real=real, _call=call, **k: (
            events.append((_call, k.get("owner", a[-1] if a else None))), _real(hashes, *a, **k))[1])
    tokens = {rid: [t] for rid, t in firsts.items()}
    while decode.has_work:
        out = decode.step()
        for u in out:
            tokens[u.request_id].append(u.token)
        events.append(("returned",) + tuple(u.request_id for u in out if u.finish_reason))
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference(model, prompt, answers[rid]), rid
        assert all(h in fake.blocks for h in prefix.hasher.hashes(prompt + tokens[rid])), rid
    # "a" ends while "b" decodes on: reserve, the next step's forward, the
    # commit, then its last token.
    reserve = events.index(("reserve", "a"))
    commit = events.index(("commit", "a"))
    returned = next(i for i, e in enumerate(events) if e[0] == "returned" and "a" in e[1:])
    assert reserve < commit < returned
    assert ("forward",) in events[reserve:commit]
    assert all(e[0] != "returned" or "a" not in e[1:] for e in events[:commit])


def test_a_gpu_decode_worker_commits_on_its_store_thread_then_sends_the_last_token(model, tiny_dir, monkeypatch):
    """On a GPU (the packed device copies: `_on_cpu` False) the decode
    worker's StoreThread writes and commits an ended request's blocks, off
    the MLX thread, and only then sends its last token (a TokenBatch); step()
    never returns it. The device copies are freed on the MLX thread once the
    thread is done. Greedy tokens equal mlx-lm's; every full block of each
    conversation is committed, before its last token leaves. Fails if the
    commit ran on the MLX thread or the last token overtook its commit."""
    import threading

    from protos.messages import TokenBatch
    from workers.kv import arena_io
    from workers.kv.store_thread import StoreThread

    monkeypatch.setattr(arena_io, "rearrange_on_host", lambda: False)
    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    prompts = {"a": prompt_of(19, 41), "b": prompt_of(26, 42)}
    answers = {"a": 6, "b": 13}
    commits, sent, lock = [], [], threading.Lock()
    real_commit = fake.commit

    def commit(hashes, owner=""):
        with lock:
            commits.append((owner, threading.get_ident(), len(sent)))
        return real_commit(hashes, owner=owner)

    monkeypatch.setattr(fake, "commit", commit)
    monkeypatch.setattr(fake, "close", lambda: None, raising=False)

    def send(msg):
        assert isinstance(msg, TokenBatch)
        with lock:
            for u in msg.updates:  # its blocks are in the cache before the token leaves
                want = prompts[u.request_id] + tokens[u.request_id] + [u.token]
                hashes = prefix.hasher.hashes(want)
                assert all(h in fake.blocks for h in hashes), u.request_id
                assert prefix.hasher.tail_key(hashes[-1], want[len(hashes) * BS:]) in fake.blocks  # 25, 39 tokens
            sent.extend(msg.updates)

    decode = DecodeEngine(model, max_batch=4, prefix=prefix, ragged=False)
    decode.stores = StoreThread(prefix, fake, send)
    tokens = {}
    for rid, prompt in prompts.items():
        res = PrefillEngine(model, chunk_size=16, prefix=prefix).run(prompt, greedy(answers[rid]), owner=rid)
        tokens[rid] = [res.first_token]
        decode.add(DecodeRequest(rid, prompt, res.first_token, KVHandoff(rid, res.num_tokens, res.rope_offset),
                                 greedy(answers[rid])), res.cache)
    prefill_commits = len(commits)
    while decode.has_work:
        for u in decode.step():
            assert u.finish_reason is None  # last tokens come from the thread
            with lock:
                tokens[u.request_id].append(u.token)
    decode.stores.close(timeout_s=10)
    for u in sent:
        assert u.finish_reason == "length"
        tokens[u.request_id].append(u.token)
    assert sorted(u.request_id for u in sent) == ["a", "b"]
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference(model, prompt, answers[rid]), rid
        assert all(h in fake.blocks for h in prefix.hasher.hashes(prompt + tokens[rid])), rid
    ours = commits[prefill_commits:]
    assert {owner for owner, _, _ in ours} == {"a", "b"}
    assert all(thread != threading.get_ident() for _, thread, _ in ours)
    decode.stores.release_done()
    assert not decode.stores.kept
    # The tails the thread wrote from host views hold the right KV: each
    # conversation's next turn reuses all of it and answers as mlx-lm does.
    for rid, prompt in prompts.items():
        held = prompt + tokens[rid]
        nxt = held + prompt_of(5, 50)
        got, res = run_request(model, prefix, nxt, greedy(6), rid=rid + "2")
        assert res.cached_tokens == len(held) and got == reference(model, nxt, 6), rid


def test_cancel_commits_what_the_kv_holds(model, tiny_dir):
    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    prompt = prompt_of(21, 7)
    res = PrefillEngine(model, 16, prefix=prefix).run(prompt, greedy(40), owner="c")
    assert len(fake.blocks) == 2
    decode = DecodeEngine(model, 4, prefix=prefix)
    decode.add(DecodeRequest("c", prompt, res.first_token, KVHandoff("c", 21, 21), greedy(40)), res.cache)
    seen = [res.first_token]
    for _ in range(13):
        seen += [u.token for u in decode.step()]
    assert decode.cancel("c") and decode.has_work  # the commit is pending
    held = prompt + seen
    assert len(held) % BS  # a tail too
    assert decode.commit_finished() == len(held) // BS - 2 + 1
    assert not decode.has_work
    hashes = prefix.hasher.hashes(held)
    assert all(h in fake.blocks for h in hashes)
    assert prefix.hasher.tail_key(hashes[-1], held[len(hashes) * BS:]) in fake.blocks
    # save=False (a failed batch) commits nothing.
    decode.add(DecodeRequest("d", prompt, res.first_token, KVHandoff("d", 21, 21), greedy(40)),
               _copy(res.cache))
    for _ in range(20):
        decode.step()
    before = len(fake.blocks)
    decode.cancel("d", save=False)
    assert decode.commit_finished() == 0 and len(fake.blocks) == before


def _copy(cache):
    out = []
    for c in cache:
        n = KVCache()
        n.state = (mx.array(c.keys[..., : c.offset, :]), mx.array(c.values[..., : c.offset, :]), c.offset)
        out.append(n)
    return out


def test_unavailable_cache_service_does_not_fail_the_request(model, tiny_dir):
    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    fake.fail = True
    prompt = prompt_of(33, 8)
    tokens, res = run_request(model, prefix, prompt, greedy(10), rid="x")
    assert tokens == reference(model, prompt, 10) and res.cached_tokens == 0
    assert fake.calls == ["lookup"]  # then skipped: one timeout, not one per call
    assert prefix.stats.failures == 1
    fake.fail = False
    prefix._skip_until = 0.0  # the back-off elapsed
    tokens, res = run_request(model, prefix, prompt, greedy(10), rid="y")
    assert res.cached_tokens == 0 and len(fake.blocks) == (33 + 10) // BS + 1  # and its tail


def test_refused_and_broken_replies_fall_back(model, tiny_dir):
    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    prompt = prompt_of(26, 9)
    want = reference(model, prompt, 6)
    PrefillEngine(model, 16, prefix=prefix).run(prompt, greedy(), owner="w")
    # A block of the wrong size (another layout) is never read.
    h0 = prefix.hasher.hashes(prompt)[0]
    fake.blocks[h0] = BlockRef(hash=h0, offset=fake.blocks[h0].offset, nbytes=prefix.layout.block_nbytes - 4)
    res = PrefillEngine(model, 16, prefix=prefix).run(prompt, greedy(), owner="w2")
    assert res.cached_tokens == 0 and res.first_token == want[0]
    # An arena that cannot be mapped: computed, not failed.
    prefix2 = PrefixCache(fake, lambda name: (_ for _ in ()).throw(FileNotFoundError(name)),
                          prefix.hasher, prefix.layout)
    fake.blocks[h0] = BlockRef(hash=h0, offset=fake.blocks[h0].offset, nbytes=prefix.layout.block_nbytes)
    tokens, res = run_request(model, prefix2, prompt, greedy(6), rid="z")
    assert tokens == want and res.cached_tokens == 0 and prefix2.stats.failures >= 1


def test_embedded_model_hit_matches_cold(embedded_model, embedded_model_dir):
    model, tokenizer = embedded_model
    fake = FakeCacheService(64 << 20)
    prefix = make_prefix_cache(model, str(embedded_model_dir), 32, fake, fake.buffer)
    assert prefix is not None and prefix.layout.dtype == "float32"
    text = "You are a helpful assistant. Answer briefly and precisely. " * 6
    prompt = tokenizer.encode(text + "What is the capital of France?")
    cold = PrefillEngine(model, 64).run(prompt, greedy())
    counted = Counting(model)
    engine = PrefillEngine(counted, 64, prefix=prefix)
    first = engine.run(prompt, greedy(), owner="e1")
    assert first.cached_tokens == 0 and len(fake.blocks) == len(prompt) // 32
    counted.tokens = 0
    hit = engine.run(prompt, greedy(), owner="e2")
    assert hit.cached_tokens == (len(prompt) - 1) // 32 * 32
    assert counted.tokens == len(prompt) - hit.cached_tokens
    assert hit.first_token == cold.first_token
    # The KV after the hit equals the KV computed cold (to float noise).
    for a, b in zip(cold.cache, hit.cache):
        assert mx.allclose(a.keys[..., : len(prompt), :], b.keys[..., : len(prompt), :], atol=1e-4)


# ----------------------------------------------------- the real cache service --
def _real_client_ready() -> bool:
    return all(hasattr(CacheClient, m) for m in ("lookup", "release", "reserve", "commit"))


def _lookup_in_fresh_process(run_dir: str, model_dir: str, prompt: List[int], q) -> None:
    """A fresh interpreter hashes the prompt itself (its own fingerprint of
    the model folder) and asks the service: hash stability across processes."""
    from cache_service.client import CacheClient
    from environment.settings import Settings
    from workers.kv.block_hash import BlockHasher, block_extra, model_fingerprint

    hasher = BlockHasher(block_extra(model_fingerprint(model_dir), "float32", BS), BS)
    client = CacheClient(Settings(run_dir=run_dir, cache_dir=None))
    reply = client.lookup(hasher.hashes(prompt), owner="fresh")
    q.put(len(reply.blocks))
    client.release(reply.lease)
    client.close()


@pytest.mark.skipif(not _real_client_ready(), reason="CacheClient has no prefix-cache calls yet")
def test_real_cache_service_roundtrip(model, tiny_dir, tmp_path):
    from cache_service import main as cache_main
    from cache_service.arena import ArenaAttachment, new_arena_name, unlink_arena
    from environment.settings import Settings

    ctx = mp.get_context("spawn")
    settings = Settings(run_dir=str(tmp_path), cache_dir=None, arena_name=new_arena_name("tpw"),
                        cache_memory_bytes=64 << 20, block_size=BS, cache_call_timeout_s=5.0)
    ready = ctx.Event()
    proc = ctx.Process(target=cache_main.run, args=(settings, ready), daemon=True)
    proc.start()
    arenas = ArenaAttachment()
    client = CacheClient(settings)
    try:
        assert ready.wait(30)
        prefix = make_prefix_cache(model, str(tiny_dir), BS, client, lambda name: arenas.get(name).buf)
        prompt = prompt_of(41, 10)
        want = reference(model, prompt, 8)
        tokens, res = run_request(model, prefix, prompt, greedy(8), rid="p1")
        assert tokens == want and res.cached_tokens == 0
        # Another process (fresh interpreter: its own hashing) finds the blocks.
        q = ctx.Queue()
        p = ctx.Process(target=_lookup_in_fresh_process, args=(str(tmp_path), str(tiny_dir), prompt, q))
        p.start()
        assert q.get(timeout=30) == 41 // BS == 5
        p.join(10)
        tokens, res = run_request(model, prefix, prompt, greedy(8), rid="p2")
        assert tokens == want and res.cached_tokens == 40 and prefix.stats.failures == 0
    finally:
        client.close()
        arenas.close()
        proc.terminate()
        proc.join(10)
        unlink_arena(settings.arena_name)


@pytest.mark.skipif(not _real_client_ready(), reason="CacheClient has no prefix-cache calls yet")
def test_silent_cache_service_times_out_without_failing(model, tiny_dir, tmp_path):
    """A socket that takes requests and never answers: the real client's
    deadline fires, the request is computed in full."""
    import zmq

    from environment.settings import Settings
    from protos.transport import ipc_address

    settings = Settings(run_dir=str(tmp_path), cache_dir=None, cache_call_timeout_s=0.3)
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(ipc_address(str(tmp_path), "cache"))
    client = CacheClient(settings, ctx=ctx)
    try:
        prefix = make_prefix_cache(model, str(tiny_dir), BS, client, lambda name: None)
        prompt = prompt_of(30, 11)
        tokens, res = run_request(model, prefix, prompt, greedy(6), rid="s")
        assert tokens == reference(model, prompt, 6) and res.cached_tokens == 0
        assert prefix.stats.failures == 1
    finally:
        client.close()
        silent.close(linger=0)
        ctx.term()
