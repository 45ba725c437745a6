"""Caches that are not plain attention KV: sliding window (Gemma 3's
RotatingKVCache between global KVCache layers) and recurrent (Qwen3-Next's
ArraysCache between attention layers).

- Their state crosses a buffer exactly (workers.kv.handoff.write_cache /
  read_cache, and the snapshot format), whatever the cache kind.
- The split pipeline (prefill -> buffer -> decode batch) gives mlx-lm's own
  greedy tokens.
- Prefix reuse is by snapshot (workers.kv.prefix_cache.SnapshotCache): stored at
  the prompt's last block boundary, reused only on an exact prefix match.

Real MLX on tiny random models; the cache service is FakeCacheService (in memory)
except in the test that spawns the real one.
"""

from __future__ import annotations

import multiprocessing as mp

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (ArraysCache, CacheList, KVCache, RotatingKVCache,
                                 make_prompt_cache)

from cache_service.client import CacheClient
from protos.codec import decode, encode
from protos.messages import DecodeRequest, KVHandoff, PrefillRequest
from tests.support.cache_fakes import FakeCacheService
from tests.support.tiny_models import (VOCAB, Counting, greedy, load_tiny_model, make_tiny_gemma3, make_tiny_llama,
                                       make_tiny_qwen3_next, prompt_of, reference)
from workers.decode.engine import DecodeEngine
from workers.kv.cache_state import cache_nbytes
from workers.kv.handoff import read_cache, write_cache, write_kv
from workers.kv.snapshot import capture_snapshot, read_snapshot, write_snapshot
from workers.prefill.engine import PrefillEngine
from workers.kv.prefix_cache import PrefixCache, make_prefix_cache
from workers.kv.snapshot_cache import SNAPSHOT_REACH_TOKENS, SnapshotCache, snapshot_key

BS = 8
MAKERS = {"gemma3": make_tiny_gemma3, "qwen3_next": make_tiny_qwen3_next}


# ------------------------------------------------------------------ helpers --
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return {name: make(tmp_path_factory.mktemp(name), seed=1) for name, make in MAKERS.items()}


@pytest.fixture(scope="module")
def models(model_dirs):
    return {name: load_tiny_model(d) for name, d in model_dirs.items()}


def live(c):
    """What a cache holds, without a KV buffer's unused capacity."""
    if isinstance(c, CacheList):
        return [live(s) for s in c.caches]
    if type(c) in (KVCache, RotatingKVCache):
        return [*c.keys_and_values(), *list(c.state)[2:]]
    return list(c.state)


def frozen(x):
    """A copy of a state tree: mlx-lm updates some arrays in place."""
    if isinstance(x, mx.array):
        y = x * 1
        mx.eval(y)
        return y
    if isinstance(x, (list, tuple)):
        return [frozen(v) for v in x]
    return x


def assert_same(x, y):
    if isinstance(x, mx.array):
        assert isinstance(y, mx.array) and x.dtype == y.dtype and x.shape == y.shape
        assert mx.array_equal(x, y)
    elif isinstance(x, (list, tuple)):
        assert isinstance(y, (list, tuple)) and len(x) == len(y)
        for a, b in zip(x, y):
            assert_same(a, b)
    else:
        assert x == y


def _kv(rng, n, dtype=mx.float32, heads=2, dk=32, dv=16):
    k = mx.array(rng.standard_normal((1, heads, n, dk)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, heads, n, dv)).astype(np.float32)).astype(dtype)
    return k, v


def cache_of_kind(kind: str, seed: int = 0) -> list:
    """One small filled cache list per kind, grown the way models grow them."""
    rng = np.random.default_rng(seed)

    def rotating(dtype=mx.float32, steps=(5, 1, 1, 1, 1, 1, 1)):
        c = RotatingKVCache(max_size=8)
        for n in steps:  # a chunk, then tokens one by one: wraps the window
            c.update_and_fetch(*_kv(rng, n, dtype))
        return c

    def kv(n=13, dv=16):
        c = KVCache()
        for m in (n - 3, 3):  # buffer of 256: the live part is a view
            c.update_and_fetch(*_kv(rng, m, dv=dv))
        return c

    def arrays():
        c = ArraysCache(2)
        c[0] = mx.array(rng.standard_normal((1, 3, 24)).astype(np.float32))
        c[1] = mx.array(rng.standard_normal((1, 2, 16, 16)).astype(np.float32))
        return c

    if kind == "rotating":
        return [rotating(), rotating(steps=(3, 1))]  # wrapped; not yet full (capacity past offset)
    if kind == "rotating-bf16":
        return [rotating(mx.bfloat16)]
    if kind == "arrays":
        return [arrays(), arrays()]
    if kind == "cachelist":
        return [CacheList(kv(), rotating()), CacheList(arrays(), kv())]
    if kind == "quantized":
        return [kv(dv=32).to_quantized(group_size=32, bits=4)]
    if kind == "mixed":  # Gemma 3 / Qwen3-Next style
        return [rotating(), kv(), arrays(), kv()]
    raise AssertionError(kind)


KINDS = ["rotating", "rotating-bf16", "arrays", "cachelist", "quantized", "mixed"]


# -------------------------------------------------------- state round trips --
@pytest.mark.parametrize("kind", KINDS)
def test_state_roundtrip_through_a_buffer_is_exact(kind):
    cache = cache_of_kind(kind)
    nbytes = cache_nbytes(cache)
    buf = bytearray(nbytes + 128)
    layers, meta = write_cache(buf, 64, cache)
    assert len(meta) == len(layers) == len(cache) and all(s.offset % 64 == 0 for l in layers for s in l)
    # Through the wire: the handoff message keeps its shape, meta rides along.
    h = decode(encode(KVHandoff("r", 13, 13, arena="a", allocation=1, layers=layers, cache_meta=meta)))
    back = read_cache(bytes(buf), h.layers, h.cache_meta)  # a copy: nothing shared
    assert [type(c) for c in back] == [type(c) for c in cache]
    for a, b in zip(cache, back):
        assert_same(live(a), live(b))
    # Exact as a state, and as behaviour: the next token lands alike.
    for a, b in zip(cache, back):
        if type(a) in (KVCache, RotatingKVCache):
            step = _kv(np.random.default_rng(9), 1, a.keys.dtype)
            assert_same(list(a.update_and_fetch(*step)), list(b.update_and_fetch(*step)))
            assert (a.offset, getattr(a, "_idx", 0)) == (b.offset, getattr(b, "_idx", 0))


@pytest.mark.parametrize("kind", KINDS)
def test_snapshot_roundtrip_is_exact(kind):
    cache = cache_of_kind(kind, seed=3)
    snap = capture_snapshot(cache, 13)
    want = [frozen(live(c)) for c in cache]
    for c in cache:  # the snapshot is a copy: later updates of the cache do not reach it
        if type(c) is RotatingKVCache:
            c.update_and_fetch(*_kv(np.random.default_rng(1), 1, c.keys.dtype))
    buf = bytearray(snap.nbytes + 4096)
    write_snapshot(buf, 192, snap)
    back, tokens = read_snapshot(bytes(buf), 192, snap.nbytes)
    assert tokens == 13
    for w, b in zip(want, back):
        assert_same(w, live(b))
    buf[192] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        read_snapshot(buf, 192, snap.nbytes)
    buf[192] ^= 0xFF
    with pytest.raises(ValueError):
        read_snapshot(buf, 192, snap.nbytes - 64)  # truncated entry: a slice falls outside


def test_plain_kv_keeps_the_old_handoff_format():
    rng = np.random.default_rng(0)
    cache = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(*_kv(rng, 11))
        cache.append(c)
    a, b = bytearray(cache_nbytes(cache)), bytearray(cache_nbytes(cache))
    layers, meta = write_cache(a, 0, cache)
    assert meta == [] and layers == write_kv(b, 0, cache) and a == b
    back = read_cache(a, layers, [])
    assert all(type(c) is KVCache and c.offset == 11 for c in back)
    with pytest.raises(TypeError, match="not an mlx_lm cache class"):
        write_cache(bytearray(1 << 16), 0, [cache[0], type("MyCache", (KVCache,), {})()])


def test_model_state_continues_exactly(models):
    """A real model's cache after a chunked prefill, moved through a buffer,
    gives the very same logits for the next tokens as the original."""
    for name, model in models.items():
        prompt = prompt_of(29, 5)
        cache = make_prompt_cache(model)
        for i in range(0, 28, 16):
            model(mx.array([prompt[i:min(i + 16, 28)]]), cache=cache)
        mx.eval([c.state for c in cache])
        buf = bytearray(cache_nbytes(cache))
        layers, meta = write_cache(buf, 0, cache)
        moved = read_cache(buf, layers, meta)
        nxt = mx.array([prompt[28:] + [7, 9]])
        for t in range(nxt.shape[1]):
            la = model(nxt[:, t:t + 1], cache=cache)
            lb = model(nxt[:, t:t + 1], cache=moved)
            assert mx.array_equal(la, lb), (name, t)


# ------------------------------------------------------ split prefill/decode --
def _split_run(model, jobs, chunk=16, prefix=None, join_at=None):
    """Prefill each prompt, move its cache through a buffer + the handoff
    message, decode them all in one batch (job `rid` joins after
    join_at[rid] decode steps, default 0). Returns {rid: tokens}."""
    join_at = join_at or {}
    engine = DecodeEngine(model, max_batch=4, prefix=prefix)
    out, pending, steps = {}, list(jobs), 0
    while pending or engine.has_work:
        for rid, prompt, sp in [j for j in pending if join_at.get(j[0], 0) <= steps]:
            pending.remove((rid, prompt, sp))
            res = PrefillEngine(model, chunk_size=chunk, prefix=prefix).run(prompt, sp, owner=rid)
            buf = bytearray(cache_nbytes(res.cache))
            layers, meta = write_cache(buf, 0, res.cache)
            h = decode(encode(KVHandoff(rid, res.num_tokens, res.rope_offset, arena="x", allocation=0,
                                        layers=layers, cache_meta=meta)))
            engine.add(DecodeRequest(rid, prompt, res.first_token, h, sp), read_cache(buf, h.layers, h.cache_meta))
            out[rid] = [res.first_token]
        for u in engine.step():
            out[u.request_id].append(u.token)
        steps += 1
    return out


@pytest.mark.parametrize("name", list(MAKERS))
def test_split_handoff_and_batched_decode_match_mlx_lm(models, name):
    """Longer than the 8-token window; lengths differ so the batch pads; b
    leaves early (the batch shrinks), c joins a running batch (it grows)."""
    model = models[name]
    jobs = [("a", prompt_of(37, 11), greedy(14)), ("b", prompt_of(23, 12), greedy(5)),
            ("c", prompt_of(30, 13), greedy(8))]
    out = _split_run(model, jobs, join_at={"c": 3})
    for rid, prompt, sp in jobs:
        assert out[rid] == reference(model, prompt, sp.max_tokens), (name, rid)


# ----------------------------------------------------------------- snapshots --
def _prefill(model, prefix, prompt, rid):
    return PrefillEngine(model, chunk_size=16, prefix=prefix).run(prompt, greedy(10), owner=rid)


def test_make_prefix_cache_picks_the_kind(models, model_dirs, tmp_path):
    fake = FakeCacheService()
    for name in MAKERS:
        sc = make_prefix_cache(models[name], str(model_dirs[name]), BS, fake, fake.buffer)
        assert isinstance(sc, SnapshotCache) and sc.kind == "snapshot"
        assert DecodeEngine(models[name], prefix=sc).prefix is None  # decode commits nothing
    llama = make_tiny_llama(tmp_path / "llama")
    assert isinstance(make_prefix_cache(load_tiny_model(llama), str(llama), BS, fake, fake.buffer), PrefixCache)


@pytest.mark.parametrize("name", list(MAKERS))
def test_snapshot_hits_only_on_exact_prefixes(models, model_dirs, name):
    model, fake = models[name], FakeCacheService()
    counted = Counting(model)
    prefix = make_prefix_cache(counted, str(model_dirs[name]), BS, fake, fake.buffer)
    a = prompt_of(45, 20)  # snapshot point (45-1)//8*8 = 40
    want = reference(model, a, 10)

    # Cold: all 45 computed; one snapshot (of 40 tokens) stored as one entry.
    counted.tokens = 0
    res = _prefill(counted, prefix, a, "a1")
    assert res.cached_tokens == 0 and counted.tokens == 45 and res.first_token == want[0]
    key40 = snapshot_key(prefix.hasher.hashes(a, 5)[-1])
    assert list(fake.blocks) == [key40]
    # Same prompt: resumes at 40, computes the last 5; same tokens to the end.
    counted.tokens = 0
    res = _prefill(counted, prefix, a, "a2")
    assert res.cached_tokens == 40 and counted.tokens == 5 and res.first_token == want[0]
    assert _split_run(model, [("a3", a, greedy(10))], prefix=prefix)["a3"] == want
    assert prefix.stats.hit_snapshots == 2 and not fake.leases
    # A longer prompt that extends it: walks 64, 56, 48 (misses), hits 40.
    b = a + prompt_of(20, 21)
    counted.tokens, lookups = 0, prefix.stats.lookups
    res = _prefill(counted, prefix, b, "b")
    assert res.cached_tokens == 40 and counted.tokens == 25 and prefix.stats.lookups - lookups == 4
    assert res.first_token == reference(model, b, 1)[0]
    assert len(fake.blocks) == 2  # b's own snapshot at 64
    # A prompt that differs inside the snapshot's range: no hit.
    c = list(a)
    c[10] = (c[10] + 1) % VOCAB
    counted.tokens = 0
    res = _prefill(counted, prefix, c, "c")
    assert res.cached_tokens == 0 and counted.tokens == 45
    assert res.first_token == reference(model, c, 1)[0]
    # A prompt ending right after the boundary (41 tokens) hits at 40: one token runs.
    counted.tokens = 0
    res = _prefill(counted, prefix, a[:41], "d")
    assert res.cached_tokens == 40 and counted.tokens == 1
    assert res.first_token == reference(model, a[:41], 1)[0]
    # 40 tokens: the boundary at 40 is the last token's own; snapshot at 32 (none yet).
    res = _prefill(counted, prefix, a[:40], "e")
    assert res.cached_tokens == 0
    assert prefix.stats.failures == 0


def test_next_turn_reuses_the_previous_prompt_snapshot(models, model_dirs):
    model, fake = models["gemma3"], FakeCacheService()
    counted = Counting(model)
    prefix = make_prefix_cache(counted, str(model_dirs["gemma3"]), BS, fake, fake.buffer)
    turn1 = prompt_of(30, 30)  # snapshot at 24
    answer = _split_run(counted, [("t1", turn1, greedy(20))], prefix=prefix)["t1"]
    assert answer == reference(model, turn1, 20) and len(fake.blocks) == 1  # decode stored nothing
    turn2 = turn1 + answer + prompt_of(6, 31)  # 56 tokens: candidates 48, 40, 32, 24
    counted.tokens = 0
    res = _prefill(counted, prefix, turn2, "t2")
    assert res.cached_tokens == 24 and counted.tokens == 56 - 24
    assert res.first_token == reference(model, turn2, 1)[0]
    # The walk reaches back a fixed number of tokens, whatever the block size;
    # with 2 lookups, 48 and 40 are asked, 24 never is.
    assert prefix.max_lookups * BS == SNAPSHOT_REACH_TOKENS
    prefix.max_lookups = 2
    turn3 = turn1 + prompt_of(26, 32)
    lookups = prefix.stats.lookups
    res = _prefill(counted, prefix, turn3, "t3")
    assert res.cached_tokens == 0 and prefix.stats.lookups - lookups == 2


def test_broken_snapshot_is_computed_not_failed(models, model_dirs):
    model, fake = models["qwen3_next"], FakeCacheService()
    prefix = make_prefix_cache(model, str(model_dirs["qwen3_next"]), BS, fake, fake.buffer)
    prompt = prompt_of(27, 40)
    first = _prefill(model, prefix, prompt, "p1").first_token
    (ref,) = fake.blocks.values()
    fake.buf[ref.offset] ^= 0xFF  # bad magic
    res = _prefill(model, prefix, prompt, "p2")
    assert res.cached_tokens == 0 and res.first_token == first
    assert prefix.stats.failures == 1 and not fake.leases


# ----------------------------------------------------- the real cache service --
def _roles(settings, client, arenas, decode_engine):
    """The roles of two worker processes that hand KV over, a prefill and a
    decode (no sockets, no model load)."""
    from workers.decode.role import DecodeRole
    from workers.loop_clock import LoopClock
    from workers.prefill.role import PrefillRole

    arena_buf = lambda name: arenas.get(name).buf  # noqa: E731
    prefill = PrefillRole(settings, None, worker_id="p", prefix=None, cache=client, arena_buf=arena_buf,
                          outbox=None, clock=LoopClock("worker p"), hello=None, local_kv={})
    decode = DecodeRole(decode_engine, worker_id="d", prefix=None, cache=client, arena_buf=arena_buf, outbox=None,
                        clock=LoopClock("worker d"), local_kv={})
    return prefill, decode


def test_real_cache_service_snapshot_and_handoff(models, model_dirs, tmp_path):
    from cache_service import main as cache_main
    from cache_service.arena import ArenaAttachment, new_arena_name, unlink_arena
    from environment.settings import Settings

    model = models["gemma3"]
    ctx = mp.get_context("spawn")
    settings = Settings(run_dir=str(tmp_path), cache_dir=None, arena_name=new_arena_name("tsc"),
                        cache_memory_bytes=32 << 20, block_size=BS, cache_call_timeout_s=5.0)
    ready = ctx.Event()
    proc = ctx.Process(target=cache_main.run, args=(settings, ready), daemon=True)
    proc.start()
    arenas = ArenaAttachment()
    client = CacheClient(settings)
    try:
        assert ready.wait(30)
        counted = Counting(model)
        prefix = make_prefix_cache(counted, str(model_dirs["gemma3"]), BS, client, lambda n: arenas.get(n).buf)
        prompt = prompt_of(50, 50)  # snapshot at 48
        want = reference(model, prompt, 8)
        assert _prefill(counted, prefix, prompt, "s1").cached_tokens == 0
        assert prefix.stats.stored_snapshots == 1 and client.stats()["blocks"] == 1  # one entry
        counted.tokens = 0
        res = _prefill(counted, prefix, prompt, "s2")
        assert res.cached_tokens == 48 and counted.tokens == 2 and prefix.stats.failures == 0
        # The hit's cache goes to decode the way workers hand it over: the
        # prefill worker's hand_off (a real arena reservation), the message
        # on the wire, the decode worker's start_decode (reads, frees).
        prefill_w, decode_w = _roles(settings, client, arenas, DecodeEngine(model, max_batch=2))
        h = prefill_w.hand_off(PrefillRequest("s2", prompt, greedy(8), decode_worker="d"), res)
        assert h.cache_meta and not h.local and client.stats()["handoffs"] == 1
        decode_w.start_decode(decode(encode(DecodeRequest("s2", prompt, res.first_token, h, greedy(8)))))
        assert client.stats()["handoffs"] == 0  # freed once read
        tokens = [res.first_token]
        while decode_w.engine.has_work:
            tokens += [u.token for u in decode_w.engine.step()]
        assert tokens == want
    finally:
        client.close()
        arenas.close()
        proc.terminate()
        proc.join(10)
        unlink_arena(settings.arena_name)
