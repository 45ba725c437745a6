"""A handoff by value (workers/kv/handoff.py write_handoff(by_value=True),
KVHandoff.payload): the prompt's KV goes in the message itself, for a decode
worker on another host. Written at the prefill end, sent over a real ZeroMQ
tcp pair with CURVE, taken in at the decode end: the same KV arrays, plain
attention KV and a mix with cache_meta (a sliding window, as Gemma 3's);
no arena slot reserved or freed, nothing held by reference."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
import zmq
from mlx_lm.models.cache import KVCache, RotatingKVCache

from deploy import keys_cmd
from protos import transport
from protos.messages import HeldBlocks, KVHandoff
from tests.support.cache_fakes import FakeCacheService
from tests.support.server import free_port
from workers.kv import handoff
from workers.loop_clock import LoopClock

TOKENS = 11


def _kv(rng, n, dtype, dk=16, dv=8):
    k = mx.array(rng.standard_normal((1, 2, n, dk)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((1, 2, n, dv)).astype(np.float32)).astype(dtype)
    return k, v


def _cache(kind, dtype=mx.float32, seed=0):
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(3):
        c = RotatingKVCache(max_size=8) if kind == "mixed" and i == 1 else KVCache()
        c.update_and_fetch(*_kv(rng, TOKENS, dtype))
        layers.append(c)
    return layers


def _live(c):
    """What a cache holds, as arrays to compare (a rotating one's state too)."""
    if type(c) is KVCache:
        return [c.keys[..., :c.offset, :], c.values[..., :c.offset, :]]
    return list(c.state)  # a rotating one's: keys, values, then its ints (offset, index, ...)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A CURVE tcp pair on localhost: (prefill end's DEALER, decode end's ROUTER)."""
    base = tmp_path_factory.mktemp("keys")
    assert keys_cmd.run(argparse.Namespace(out=str(base), name=["w"], force=False)) == 0
    public, secret, server_public = transport.worker_keys(os.path.join(str(base), "w"))
    r_public, r_secret, _ = transport.router_keys(os.path.join(str(base), "router"))
    ctx = zmq.Context()
    server = transport.make_socket(ctx, zmq.ROUTER)
    server.setsockopt(zmq.CURVE_SECRETKEY, r_secret)
    server.setsockopt(zmq.CURVE_PUBLICKEY, r_public)
    server.setsockopt(zmq.CURVE_SERVER, 1)
    address = f"tcp://127.0.0.1:{free_port()}"
    server.bind(address)
    client = transport.make_socket(ctx, zmq.DEALER, identity="prefill")
    transport.curve_client(client, public, secret, server_public)
    client.connect(address)
    yield client, server
    ctx.destroy(linger=0)


def _over(pair, msg):
    client, server = pair
    transport.send(client, msg)
    assert server.poll(10_000), "nothing arrived"
    peer, got = transport.recv(server, routed=True)
    assert peer == b"prefill" and got is not None
    return got


@pytest.mark.parametrize("kind,dtype", [("plain", mx.float32), ("plain", mx.bfloat16), ("mixed", mx.float16)])
@pytest.mark.parametrize("staged", [False, True])
def test_a_handoff_by_value_crosses_a_socket_and_gives_the_same_kv(pair, kind, dtype, staged):
    cache = _cache(kind, dtype)
    result = SimpleNamespace(cache=cache, num_tokens=TOKENS, rope_offset=TOKENS)
    prefill_side = FakeCacheService()
    later = [] if staged else None
    h = handoff.write_handoff(prefill_side, prefill_side.buffer, "r1", result, staged=later, by_value=True)
    if staged:  # the store thread's copy, as the prefill role hands it over
        copy, _kept = later[0]
        copy()
    assert "alloc" not in prefill_side.calls  # no arena slot
    assert (h.arena, h.allocation, h.blocks, h.local) == ("", -1, HeldBlocks(), False)
    assert h.payload.dtype == np.uint8 and h.payload.nbytes == h.bytes_moved > 0
    assert bool(h.cache_meta) == (kind == "mixed")
    if kind == "plain":  # the prefix store reads the new blocks from the payload (workers/prefill/role.py)
        first, views = handoff.handoff_tail(h, prefill_side.buffer)
        assert first == 0 and np.array_equal(views[0].reshape(-1), np.asarray(
            cache[0].keys[..., :TOKENS, :].view(mx.uint16) if dtype == mx.bfloat16
            else cache[0].keys[..., :TOKENS, :]).reshape(-1))

    got = _over(pair, h)
    assert isinstance(got, KVHandoff) and got.payload is not None and got.layers == h.layers
    decode_side = FakeCacheService(strict_leases=False)
    back = handoff.take_in(got, decode_side, decode_side.buffer, prefix=None, clock=LoopClock("test"))
    assert decode_side.calls == []  # nothing to free, nothing to take
    assert [type(c) for c in back] == [type(c) for c in cache]
    for a, b in zip(cache, back):
        assert a.offset == b.offset and len(_live(a)) == len(_live(b))
        for x, y in zip(_live(a), _live(b)):
            assert (x.dtype == y.dtype and mx.array_equal(x, y)) if isinstance(x, mx.array) else x == y
    handoff.give_back(decode_side, got)  # a cancelled one: nothing to give back
    assert decode_side.calls == []


def test_the_reader_threads_copy_reads_the_payload(pair):
    from concurrent.futures import ThreadPoolExecutor

    cache = _cache("plain")
    prefill_side = FakeCacheService()
    h = handoff.write_handoff(prefill_side, prefill_side.buffer, "r2",
                              SimpleNamespace(cache=cache, num_tokens=TOKENS, rope_offset=TOKENS), by_value=True)
    got = _over(pair, h)
    with ThreadPoolExecutor(1) as reader:
        copies = handoff.start_copy(reader, lambda arena: pytest.fail(f"read arena {arena!r}"), got)
        copies.result(timeout=10)
        back = handoff.take_in(got, FakeCacheService(strict_leases=False), None, None, LoopClock("t"), copies)
    assert all(mx.array_equal(a.keys[..., :TOKENS, :], b.keys) for a, b in zip(cache, back))


def test_a_handoff_by_value_carries_all_its_kv():
    cache = _cache("plain")
    result = SimpleNamespace(cache=cache, num_tokens=TOKENS, rope_offset=TOKENS)
    held = HeldBlocks(hashes=[b"x" * 16], offsets=[0], arena="a", lease=3, tokens=4)
    with pytest.raises(ValueError, match="no held blocks"):
        handoff.write_handoff(FakeCacheService(), None, "r3", result, held=held, by_value=True)
    bad = KVHandoff("r4", TOKENS, TOKENS, payload=np.zeros(64, np.uint8), blocks=held)
    with pytest.raises(ValueError, match="by value must carry all its KV"):
        handoff.take_in(bad, FakeCacheService(strict_leases=False), None, None, LoopClock("t"))


def test_a_payload_shorter_than_its_slices_is_refused_not_read_past(pair):
    """A hostile or cut payload (it comes from another host's worker, through
    the router): slices past its end raise ValueError (the request fails)
    rather than reading memory beyond the frame."""
    cache = _cache("plain")
    side = FakeCacheService()
    h = handoff.write_handoff(side, side.buffer, "r5",
                              SimpleNamespace(cache=cache, num_tokens=TOKENS, rope_offset=TOKENS), by_value=True)
    got = _over(pair, h)
    got.payload = got.payload[: got.payload.size // 2]
    with pytest.raises(ValueError):
        handoff.take_in(got, FakeCacheService(strict_leases=False), None, None, LoopClock("t"))


def test_an_arena_with_no_room_sends_the_kv_by_value_instead_of_failing(pair):
    """A burst of prompts on a small arena (handoffs in flight and leased
    blocks fill it) refused a handoff, and its request failed with a 503
    (a full suite run, tests/e2e/test_e2e_prefix_cache.py's tiny arena):
    write_handoff_anyway sends the whole KV in the message then, the held
    blocks released, and the decode end takes it as any handoff by value."""
    cache = _cache("plain")
    result = SimpleNamespace(cache=cache, num_tokens=TOKENS, rope_offset=TOKENS)
    full = FakeCacheService(nbytes=1024)  # smaller than the KV: every alloc is refused
    held = HeldBlocks(hashes=[b"x" * 16], offsets=[0], arena="fake-arena", lease=7, tokens=4)
    released = []
    with pytest.raises(handoff.CacheUnavailable):
        handoff.write_handoff(full, full.buffer, "r5", result, held=held, release_held=released.append)
    h = handoff.write_handoff_anyway(full, full.buffer, "r5", result, held=held, release_held=released.append)
    assert released == [7, 7]  # the refused reservation gave the held blocks back, each time
    assert h.payload is not None and h.blocks == HeldBlocks() and h.num_tokens == TOKENS
    back = handoff.take_in(_over(pair, h), FakeCacheService(strict_leases=False), None, None, LoopClock("t"))
    assert all(mx.array_equal(a.keys[..., :TOKENS, :], b.keys) for a, b in zip(cache, back))
    roomy = FakeCacheService()
    assert handoff.write_handoff_anyway(roomy, roomy.buffer, "r6", result).payload is None  # room: the arena
