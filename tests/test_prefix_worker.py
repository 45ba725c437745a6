"""The worker half of the shared prefix cache: block hashes, the block layout,
prefill reusing cached blocks, decode committing a finished conversation.

Engines run real MLX on a tiny random llama (and once on the embedded model).
The cache service is `FakeCacheService` (in memory, tests/support/cache_fakes.py) unless a
test says otherwise; the real service is used where its client has the calls.
Greedy output with cache hits must equal mlx-lm's own generation (no cache).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from typing import List

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from cache_service.client import CacheClient
from protos.messages import BlockRef, DecodeRequest, KVHandoff, SamplingParams
from tests.support.cache_fakes import FakeCacheService
from tests.support.tiny_models import Counting, greedy, prompt_of, reference
from workers.kv.block_hash import SEED, BlockHasher, block_extra, model_fingerprint
from workers.decode.engine import DecodeEngine
from workers.kv.blocks import KVLayout, block_nbytes, kv_layout, probe_kv_layout, read_blocks, unblockable_reason, write_blocks
from workers.kv.prefix_cache import PrefixCache, make_prefix_cache
from workers.prefill.engine import PrefillEngine

BS = 8  # small blocks: short prompts span several
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ helpers --
def prefix_for(model, model_dir, client, block_size=BS) -> PrefixCache:
    prefix = make_prefix_cache(model, str(model_dir), block_size, client, client.buffer)
    assert prefix is not None
    return prefix


def run_request(model, prefix, prompt, sp, rid="r", chunk=16):
    """Prefill (reusing/storing blocks) then decode to the end with the same
    prefix cache. Returns (all tokens, prefill result)."""
    res = PrefillEngine(model, chunk_size=chunk, prefix=prefix).run(prompt, sp, owner=rid)
    decode = DecodeEngine(model, max_batch=4, prefix=prefix)
    decode.add(DecodeRequest(rid, prompt, res.first_token, KVHandoff(rid, res.num_tokens, res.rope_offset), sp),
               res.cache)
    tokens = [res.first_token]
    while decode.has_work:
        tokens += [u.token for u in decode.step()]
        decode.commit_finished()
    return tokens, res


# ------------------------------------------------------------- block hashes --
def test_block_hashes_chain():
    hasher = BlockHasher(block_extra(b"f" * 32, "float32", 4), 4)
    toks = list(range(100, 118))  # 4 full blocks + 2 tokens
    hs = hasher.hashes(toks)
    assert len(hs) == 4 and all(len(h) == 32 for h in hs) and len(set(hs)) == 4
    assert hasher.hashes(toks[:16]) == hs  # the partial block never gets a key
    assert hasher.hashes(toks, 2) == hs[:2]
    other = toks[:5] + [999] + toks[6:]  # one token changed in block 1
    ho = hasher.hashes(other)
    assert ho[0] == hs[0] and all(a != b for a, b in zip(ho[1:], hs[1:]))  # chained
    # Every extra key matters: weights, dtype, block size.
    for extra in (block_extra(b"g" * 32, "float32", 4), block_extra(b"f" * 32, "float16", 4),
                  block_extra(b"f" * 32, "float32", 4, adapter="lora")):
        assert BlockHasher(extra, 4).hashes(toks)[0] != hs[0]
    assert BlockHasher(block_extra(b"f" * 32, "float32", 2), 4).hashes(toks)[0] != hs[0]
    # Per-block extra (image hashes later): changes that block and all after.
    hi = hasher.hashes(toks, per_block=lambda i: b"img" if i == 2 else b"")
    assert hi[:2] == hs[:2] and hi[2] != hs[2] and hi[3] != hs[3]
    with pytest.raises(ValueError):
        hasher.hashes([-1] * 4)
    assert SEED != hs[0]


def test_tail_keys_name_their_prefix_and_their_length():
    """A tail block (the tokens after a conversation's last full block) is
    keyed by its parent block, its exact tokens and the model's extra: never
    a full block's key; its candidates come longest first, within a block
    and the given end."""
    hasher = BlockHasher(block_extra(b"f" * 32, "float32", 4), 4)
    toks = list(range(100, 111))  # 2 full blocks + 3
    hs = hasher.hashes(toks)
    t = hasher.tail_key(hs[-1], toks[8:11])
    assert len(t) == 32 and t not in hs and t not in hasher.hashes(toks[:8] + toks[8:11] + [5])
    assert t != hasher.tail_key(hs[-1], toks[8:10]) and t != hasher.tail_key(hs[0], toks[8:11])
    assert t != BlockHasher(block_extra(b"g" * 32, "float32", 4), 4).tail_key(hs[-1], toks[8:11])
    assert hasher.tail_keys(toks, hs[-1], 8, 11) == [(k, hasher.tail_key(hs[-1], toks[8:8 + k])) for k in (3, 2, 1)]
    assert [k for k, _ in hasher.tail_keys(toks, hs[-1], 8, 10)] == [2, 1]
    assert hasher.tail_keys(toks, hs[-1], 8, 8) == []
    assert [k for k, _ in hasher.tail_keys(list(range(40)), hs[0], 4, 40)] == [3, 2, 1]  # less than a block
    for bad in (toks[:4], []):
        with pytest.raises(ValueError):
            hasher.tail_key(hs[-1], bad)


def test_block_hashes_reuse_a_shared_leading_run_and_stay_exact(monkeypatch):
    """A prompt is hashed for its lookup, its handoff's lease and its store,
    and a swarm's prompts share a system prompt: the hasher reuses the keys
    of the leading run it computed last and hashes only the rest. Every
    answer equals a fresh hasher's, whatever came before it."""
    import random

    import workers.kv.block_hash as bh

    extra = block_extra(b"f" * 32, "float32", 4)
    fresh = lambda toks, n=None, per_block=None: BlockHasher(extra, 4).hashes(toks, n, per_block)  # noqa: E731
    hasher = BlockHasher(extra, 4)
    system = list(range(100, 164))  # 16 blocks every prompt starts with
    img = lambda i: b"img" if i == 3 else b""  # noqa: E731
    rng = random.Random(0)
    calls = [(system + [rng.randrange(1000) for _ in range(rng.randrange(0, 30))], rng.choice([None, 5, 40]),
              rng.choice([None, None, img])) for _ in range(40)]
    calls += [(system[:30], None, None), (list(range(500, 540)), None, None), (system, None, None)]
    real_sha = bh.hashlib.sha256
    counted = []

    def counting_sha(*a):
        counted.append(1)
        return real_sha(*a)

    for toks, n, per_block in calls:
        monkeypatch.setattr(bh.hashlib, "sha256", real_sha)
        want = fresh(toks, n, per_block)
        monkeypatch.setattr(bh.hashlib, "sha256", counting_sha)
        assert hasher.hashes(toks, n, per_block) == want
    counted.clear()
    prompt = system + list(range(900, 923))  # 21 full blocks + 3 tokens
    hasher.hashes(prompt, 20)  # its lookup: (n-1)//bs blocks
    hasher.hashes(prompt)  # its lease: all full blocks
    hasher.hashes(prompt)  # its store
    assert len(counted) == 5  # the 16 system blocks were hashed already; then blocks 16-20, once
    counted.clear()
    swarm = [system + [2000 + 40 * a + i for i in range(12 + a)] for a in range(10)]
    for toks in swarm:
        hasher.hashes(toks)
    assert len(counted) == sum(len(t) // 4 - 16 for t in swarm)  # the system prompt's blocks: never again


def test_block_hashes_same_in_another_process(tiny_dir):
    """No per-process salt: a fresh interpreter (other PYTHONHASHSEED) and a
    restart compute the very same keys and fingerprint."""
    toks = prompt_of(70, 1)
    fp = model_fingerprint(tiny_dir)
    mine = [h.hex() for h in BlockHasher(block_extra(fp, "float32", 16), 16).hashes(toks)]
    code = ("import json,sys; from workers.kv.block_hash import *; "
            "a=json.loads(sys.argv[1]); fp=model_fingerprint(a['dir']); "
            "print(json.dumps([h.hex() for h in BlockHasher(block_extra(fp,'float32',16),16).hashes(a['toks'])]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    env.pop("LD_PRELOAD", None)
    out = subprocess.run([sys.executable, "-c", code, json.dumps({"dir": str(tiny_dir), "toks": toks})],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == mine and len(mine) == 4


def test_model_fingerprint(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"x": 1}')
    (a / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    fp = model_fingerprint(a)
    assert len(fp) == 32 and model_fingerprint(a) == fp
    b = tmp_path / "b"  # same files, another folder name (GGUF folders are named by its hash)
    b.mkdir()
    for f in a.iterdir():
        (b / f.name).write_bytes(f.read_bytes())
    assert model_fingerprint(b) != fp
    data = bytearray((a / "model.safetensors").read_bytes())
    data[-10] = 1  # a change in the last MiB
    (a / "model.safetensors").write_bytes(bytes(data))
    fp2 = model_fingerprint(a)
    assert fp2 != fp
    (a / "config.json").write_text('{"x": 2}')
    assert model_fingerprint(a) != fp2


# ------------------------------------------------------------- block layout --
def _filled(dtype, tokens, seed, layers=3, heads=2, dk=16, dv=8):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        for n in (tokens - 5, 5):  # grown through update_and_fetch: strided live part
            k = mx.array(rng.standard_normal((1, heads, n, dk)).astype(np.float32)).astype(dtype)
            v = mx.array(rng.standard_normal((1, heads, n, dv)).astype(np.float32)).astype(dtype)
            c.update_and_fetch(k, v)
        out.append(c)
    return out


@pytest.fixture(params=["host", "device"])
def copy_path(request, monkeypatch):
    """Both ways blocks are rearranged: with numpy on the host (MLX's CPU
    backend) and with MLX ops (a GPU); they must write the same bytes."""
    from workers.kv import arena_io

    monkeypatch.setattr(arena_io, "rearrange_on_host", lambda: request.param == "host")
    return request.param


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_blocks_roundtrip_exact(dtype, copy_path):
    cache = _filled(dtype, 45, 0)
    layout = kv_layout(cache, BS)
    item = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}[dtype]
    assert block_nbytes(layout) == 3 * 2 * (16 + 8) * BS * item
    assert layout.dtype == str(dtype).split(".")[-1]
    nb = block_nbytes(layout)
    buf = bytearray(20 * nb)
    # Blocks 0..4 land out of order and apart, as an arena hands them out.
    offsets = [7 * nb, 1 * nb, 12 * nb, 3 * nb, 9 * nb]
    assert write_blocks(buf, offsets[:2], cache, 0, layout) == 2 * nb
    write_blocks(buf, offsets[2:], cache, 2, layout)
    back = read_blocks(buf, offsets[:4], layout)  # the first 4 blocks
    buf[:] = bytes(len(buf))  # the rebuilt cache owns its memory
    for a, b in zip(cache, back):
        assert b.offset == 4 * BS and b.keys.dtype == dtype
        assert mx.array_equal(a.keys[..., :32, :], b.keys)
        assert mx.array_equal(a.values[..., :32, :], b.values)
    with pytest.raises(ValueError, match="tokens"):
        write_blocks(bytearray(10 * nb), [0, nb, 2 * nb, 3 * nb, 4 * nb, 5 * nb], cache, 0, layout)  # 48 > 45
    with pytest.raises(ValueError, match="outside"):
        read_blocks(bytearray(nb), [1], layout)
    with pytest.raises(ValueError, match="layout"):
        write_blocks(buf, [0], cache, 0, KVLayout(layout.layers, "float32" if item == 2 else "float16", BS))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_both_copy_paths_write_the_same_bytes_and_read_them_back(dtype, monkeypatch):
    from workers.kv import arena_io, blocks

    cache = _filled(dtype, 40, 3)
    layout = kv_layout(cache, BS)
    nb = block_nbytes(layout)
    written = {}
    for host in (True, False):
        monkeypatch.setattr(arena_io, "rearrange_on_host", lambda host=host: host)
        buf = bytearray(6 * nb)
        write_blocks(buf, [4 * nb, 0, 2 * nb], cache, 1, layout)  # blocks 1..3, scattered
        written[host] = bytes(buf)
    assert written[True] == written[False]
    for host in (True, False):
        monkeypatch.setattr(arena_io, "rearrange_on_host", lambda host=host: host)
        keys, values = blocks.read_blocks_stacked(bytearray(written[not host]), [4 * nb, 0, 2 * nb], layout)
        assert keys.shape == (3, 2, 3 * BS, 16) and values.shape == (3, 2, 3 * BS, 8)
        for i, c in enumerate(cache):
            assert mx.array_equal(keys[i:i + 1], c.keys[..., BS:4 * BS, :])
            assert mx.array_equal(values[i:i + 1], c.values[..., BS:4 * BS, :])


def test_blocks_roundtrip_layers_of_different_shapes(copy_path):
    cache = _filled(mx.float16, 20, 1, layers=1) + _filled(mx.float16, 20, 2, layers=1, heads=4, dk=8, dv=32)
    layout = kv_layout(cache, BS)
    assert len(set(layout.layers)) == 2
    nb = block_nbytes(layout)
    buf = bytearray(3 * nb)
    write_blocks(buf, [2 * nb, 0], cache, 0, layout)
    back = read_blocks(buf, [2 * nb, 0], layout)
    for a, b in zip(cache, back):
        assert b.offset == 16 and b.keys.shape == a.keys[..., :16, :].shape
        assert mx.array_equal(a.keys[..., :16, :], b.keys) and mx.array_equal(a.values[..., :16, :], b.values)


def test_caches_that_cannot_be_blocked(caplog):
    assert unblockable_reason([KVCache(), KVCache()]) is None
    assert "sliding window" in unblockable_reason([KVCache(), RotatingKVCache(max_size=8)])
    assert "recurrent" in unblockable_reason([ArraysCache(2)])

    class SlidingModel:  # what make_prompt_cache sees of a sliding-window model
        def make_cache(self):
            return [KVCache(), RotatingKVCache(max_size=64)]

    with pytest.raises(TypeError, match="RotatingKVCache"):
        probe_kv_layout(SlidingModel(), BS)
    # Such a model gets snapshots instead (tests/test_snapshot_cache.py); one
    # that cannot even be probed (this fake has no forward pass) runs uncached.
    with caplog.at_level(logging.INFO, logger="workers.kv"):
        assert make_prefix_cache(SlidingModel(), ".", BS, FakeCacheService(), None) is None
    assert "prefix caching off" in caplog.text and "layer 1 is RotatingKVCache" in caplog.text


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
    from workers.kv import arena_io, blocks, handoff
    import workers.kv.prefix_cache as pc
    from workers.kv.hot_blocks import tail_of

    monkeypatch.setattr(arena_io, "rearrange_on_host", lambda: False)  # the GPU path, where it matters
    device_copies = []
    monkeypatch.setattr(pc, "blocks_for_write", lambda *a: device_copies.append(a) or blocks.blocks_for_write(*a))
    cache = _filled(dtype, 45, 5)  # 5 full blocks
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
    cache = _filled(mx.float32, 45, 6)  # 5 full blocks
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

    from workers.kv import arena_io
    from protos.messages import TokenBatch
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
    from deploy.settings import Settings
    from workers.kv.block_hash import BlockHasher, block_extra, model_fingerprint

    hasher = BlockHasher(block_extra(model_fingerprint(model_dir), "float32", BS), BS)
    client = CacheClient(Settings(run_dir=run_dir, cache_dir=None))
    reply = client.lookup(hasher.hashes(prompt), owner="fresh")
    q.put(len(reply.blocks))
    client.release(reply.lease)
    client.close()


@pytest.mark.skipif(not _real_client_ready(), reason="CacheClient has no prefix-cache calls yet")
def test_real_cache_service_roundtrip(model, tiny_dir, tmp_path):
    from cache_service import service
    from cache_service.arena import ArenaAttachment, new_arena_name, unlink_arena
    from deploy.settings import Settings

    ctx = mp.get_context("spawn")
    settings = Settings(run_dir=str(tmp_path), cache_dir=None, arena_name=new_arena_name("tpw"),
                        cache_memory_bytes=64 << 20, block_size=BS, cache_call_timeout_s=5.0)
    ready = ctx.Event()
    proc = ctx.Process(target=service.run, args=(settings, ready), daemon=True)
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

    from deploy.settings import Settings
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


@pytest.fixture(params=["ours", "mlx-lm's"])
def attention(request, monkeypatch):
    """This backend's attention of ours (workers/kernels/mlx_hooks.py), or mlx-lm's
    own with its mask (what a Mac's GPU runs)."""
    from workers.kernels import mlx_hooks

    if request.param != "ours":
        monkeypatch.setenv("TANDEM_MLX_EXP", "1")
        monkeypatch.setenv("TANDEM_CUDNN_PREFILL", "1")
        monkeypatch.setenv("TANDEM_MLX_DECODE_ATTENTION", "1")
    mlx_hooks._set_backend()
    yield request.param
    monkeypatch.undo()
    mlx_hooks._set_backend()


def test_a_batch_of_prompts_over_cached_prefixes_matches_mlx_lm(model, tiny_dir, attention):
    """A burst of prompts prefilled in one pass (workers/prefill/batch.py):
    cached prefixes of different lengths, new tails of different lengths
    (one of none but its last token, one with no cached prefix at all), each
    row's first token and whole greedy generation equal mlx-lm's alone, and
    the passes run over the batch's padded new tokens only; with our
    attention and with mlx-lm's."""
    from workers.prefill.batch import batchable, fits, run_batch

    fake = FakeCacheService()
    counted = Counting(model)
    prefix = prefix_for(counted, tiny_dir, fake)
    system = prompt_of(40, 7)
    engine = PrefillEngine(counted, chunk_size=128, prefix=prefix)
    engine.run(system + prompt_of(8, 8), greedy(), owner="warm")  # 6 blocks stored
    prompts = [system + prompt_of(n, 10 + n) for n in (1, 5, 13, 20)]
    prompts.append(system + prompt_of(8, 8) + [5])  # all but its last token cached
    prompts.append(prompt_of(11, 99))  # nothing cached
    expect = [reference(model, p, 10) for p in prompts]

    jobs = [engine.start(p, greedy(10), owner=f"r{i}") for i, p in enumerate(prompts)]
    for j in jobs:
        j.load()
        assert batchable(j)
    assert [j.cached_tokens for j in jobs] == [40, 40, 40, 40, 48, 0]
    for i in range(1, len(jobs)):
        assert fits(jobs[:i], jobs[i])
    counted.tokens = 0
    results = run_batch(jobs)
    longest = max(len(p) - j.cached_tokens - 1 for p, j in zip(prompts, jobs))
    assert counted.tokens == len(jobs) * longest + len(jobs)  # one padded pass, then one token a row
    assert [r.first_token for r in results] == [e[0] for e in expect]
    assert [r.cached_tokens for r in results] == [40, 40, 40, 40, 48, 0]
    # Each row's cache is the prompt's whole KV: decoding from it gives mlx-lm's answer.
    for i, (p, res) in enumerate(zip(prompts, results)):
        assert res.num_tokens == len(p) and all(c.offset == len(p) for c in res.cache)
        decode = DecodeEngine(model, max_batch=4)
        decode.add(DecodeRequest(f"r{i}", p, res.first_token, KVHandoff(f"r{i}", len(p), len(p)), greedy(10)),
                   res.cache)
        tokens = [res.first_token]
        while decode.has_work:
            tokens += [u.token for u in decode.step()]
        assert tokens == expect[i], i
    # Their new blocks store as a lone prompt's do, and serve the next one.
    stored = sum(j.save_prefix() for j in jobs)
    assert stored > 0 and prefix.stats.failures == 0
    tokens, res = run_request(model, prefix, prompts[3], greedy(10), rid="again")
    assert res.cached_tokens == 56 and tokens == expect[3]


def test_what_a_batch_of_prompts_takes(model, tiny_dir):
    """Only text prompts with their new tokens within one chunk, padded
    together, join a batch."""
    from workers.prefill.batch import batchable, fits

    engine = PrefillEngine(model, chunk_size=32)
    short, longer, too_long = (engine.start(prompt_of(n, n), greedy()) for n in (9, 16, 33))
    for j in (short, longer, too_long):
        j.load()
    assert batchable(short) and batchable(longer) and not batchable(too_long)  # 33 new tokens > 32
    assert fits([short], longer)  # 2 rows x 16 <= 32
    assert not fits([short, longer], engine.start(prompt_of(9, 1), greedy()))  # 3 x 16 > 32
    short.step()
    assert not batchable(short)  # already computed
    # What the worker weighs a batch's handoffs by.
    assert engine.token_nbytes() * 9 == sum(c.keys[..., :9, :].nbytes + c.values[..., :9, :].nbytes
                                            for c in short.cache)


def test_a_batchs_rows_sample_with_their_own_requests_settings(model, tiny_dir):
    """Each row of a batch samples its first token as it would alone: its
    logprobs, its seeded sampler, its penalties over its own prompt."""
    from workers.prefill.batch import run_batch

    engine = PrefillEngine(model, chunk_size=128)
    base = prompt_of(24, 5)
    prompts = [base + prompt_of(n, 40 + n) for n in (3, 9, 6)]
    settings = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=3),
                SamplingParams(max_tokens=4, temperature=0.9, top_p=0.9, seed=7),
                SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.5,
                               logit_bias={int(t): -100.0 for t in prompts[2][-3:]})]
    alone = [engine.run(p, sp) for p, sp in zip(prompts, settings)]
    jobs = []
    for p, sp in zip(prompts, settings):  # the first 20 tokens cached, as a prefix cache would load them
        head = PrefillEngine(model, chunk_size=128).run(base[:20], greedy()).cache
        job = engine.start(p, sp)
        job.load(cached=(head, 20))
        jobs.append(job)
    batched = run_batch(jobs)
    for a, b in zip(alone, batched):
        assert b.first_token == a.first_token
    lp_a, lp_b = alone[0].logprob, batched[0].logprob
    assert lp_b.token == lp_a.token and lp_b.logprob == pytest.approx(lp_a.logprob, abs=1e-4)
    assert [t for t, _ in lp_b.top] == [t for t, _ in lp_a.top]
    assert batched[1].logprob is None and batched[2].first_token not in prompts[2][-3:]


class _Outbox:
    def __init__(self):
        self.sent = []

    def send(self, msg, wait_s=None):
        self.sent.append(msg)


def _prefill_worker(engine, fake, settings, colocated=False, stores=None):
    """A prefill worker's prefill role (workers/prefill/role.py PrefillRole)
    over `engine` and the fake cache service, with no sockets: what it sends
    is recorded."""
    from protos.messages import CacheAllocReply, WorkerHello
    from workers.loop_clock import LoopClock
    from workers.prefill.role import PrefillRole

    allocations = iter(range(1000))
    fake.alloc = lambda nbytes, owner, ttl_s: CacheAllocReply(0, True, allocation=next(allocations),
                                                              offset=1 << 24, nbytes=nbytes, arena=fake.arena)
    return PrefillRole(settings, engine, worker_id="prefill-0", prefix=engine.prefix, cache=fake,
                       arena_buf=fake.buffer, outbox=_Outbox(), clock=LoopClock("test"),
                       hello=WorkerHello("prefill-0", ["prefill"], 1, "ready"), local_kv={}, colocated=colocated,
                       stores=stores)


def test_a_colocated_prompts_blocks_are_stored_by_the_store_thread(model, tiny_dir):
    """With --colocate the prompt's KV stays in the process (no handoff
    tail in host memory): its new blocks are laid out and evaluated on the
    MLX thread, which keeps those arrays, and copied into the arena and
    committed by the store thread, which sends nothing for them."""
    from deploy.settings import Settings
    from protos.messages import PrefillDone, PrefillRequest
    from workers.kv.store_thread import StoreThread

    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    engine = PrefillEngine(model, chunk_size=64, prefix=prefix)
    thread_sends = []
    fake.close = lambda: None  # the thread's client, closed with it
    stores = StoreThread(prefix, fake, thread_sends.append)
    # colocated: this worker decodes what it prefills
    w = _prefill_worker(engine, fake, Settings(prefill_batch=1), colocated=True, stores=stores)
    writes = []
    real_write = prefix.write_store
    prefix.write_store = lambda prepared, client=None: writes.append(threading.current_thread().name) or \
        real_write(prepared, client)
    prompt = prompt_of(45, 77)
    w.queue.append(PrefillRequest("c", prompt, greedy(4), "prefill-0"))
    w.prefill_chunk()
    w.stores.close()
    (done,) = w.outbox.sent
    assert isinstance(done, PrefillDone) and done.handoff.local and done.first_token == reference(model, prompt, 1)[0]
    assert "c" in w.local_kv and thread_sends == []
    assert writes == ["prefix-store"] and len(fake.blocks) == 45 // BS and not fake.reserved
    assert w.stores.kept  # the device copies the thread read, still the MLX thread's
    w.stores.release_done()
    assert not w.stores.kept


def test_the_prefill_worker_batches_within_an_eighth_of_the_arena_in_handoffs(model, tiny_dir):
    """PrefillRole.prefill_batch (workers/prefill/role.py) over the fake cache service:
    queued prompts join the current one while their handoffs (what the
    service lacks, their blocks held first) fit an eighth of the arena; the
    first that does not fit runs next with its hold, and counts then; a
    cancel gives its hold back. Every first token and handoff is sent."""
    from deploy.settings import Settings
    from protos.messages import PrefillDone, PrefillRequest

    fake = FakeCacheService()
    prefix = prefix_for(model, tiny_dir, fake)
    engine = PrefillEngine(model, chunk_size=64, prefix=prefix)
    system = prompt_of(40, 21)
    engine.run(system + prompt_of(9, 22), greedy(), owner="warm")  # the system prompt's 5 blocks, stored
    prompts = [system + prompt_of(10, 30 + i) for i in range(5)]  # 40 cached + 10 new: 10 tokens handed off
    expect = [reference(model, p, 1)[0] for p in prompts]
    handoff = 10 * engine.token_nbytes()

    w = _prefill_worker(engine, fake, Settings(prefill_batch=8, prefill_chunk=64,
                                               cache_memory_bytes=8 * (2 * handoff + handoff // 2)))
    for i, p in enumerate(prompts):
        w.queue.append(PrefillRequest(f"r{i}", p, greedy(4), ""))

    def done():
        return {m.request_id: m.first_token for m in w.outbox.sent if isinstance(m, PrefillDone)}

    w.prefill_chunk()  # r0 and r1 (two handoffs fit 2.5); r2 does not, and holds its blocks
    assert done() == {"r0": expect[0], "r1": expect[1]} and w.hello.batched_prompts == 2
    assert w.current[0].request_id == "r2" and set(w.held) == {"r2"} and len(w.queue) == 2
    w.prefill_chunk()  # r2, counted though already held, and r3; r4 does not fit
    assert set(done()) == {"r0", "r1", "r2", "r3"} and w.hello.batched_prompts == 4
    assert w.current[0].request_id == "r4" and set(w.held) == {"r4"}
    assert [done()[f"r{i}"] for i in range(4)] == expect[:4]
    handoffs = [m for m in w.outbox.sent if isinstance(m, KVHandoff)]
    assert len(handoffs) == 4 and all(h.blocks.tokens == 40 and h.num_tokens == 50 for h in handoffs)
    leases = len(fake.leases)  # the four handoffs' and r4's
    w.cancel("r4")
    assert len(fake.leases) == leases - 1 and w.held == {} and w.current is None
