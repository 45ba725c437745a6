"""A decode worker's handoff reads on a thread (workers/decode/role.py
read_handoff / take_reads, workers/kv/handoff.py copy_kv): the copies out
of the arena are exact; decode requests start in arrival order, each once
its copy is done; a request cancelled while its copy is pending never
starts, and what its handoff held in the cache service is given back. Real
threads, real MLX arrays over a real buffer; the decode role runs without a
worker's sockets and model (the decode engine and the cache client are recorders).
Workers use the reader only on MLX's CUDA backend; here it runs on the CPU
backend, where creating arrays on a second thread is safe too (on Metal it
is not: these tests skip there)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from environment.backend import on_cpu, on_cuda
from protos.messages import DecodeRequest, HeldBlocks, KVHandoff, SamplingParams
from tests.support.cache_fakes import FakeCacheService
from workers.decode.role import DecodeRole
from workers.kv import handoff
from workers.kv.handoff import copy_kv, kv_from_copies, kv_nbytes, read_kv, write_kv
from workers.loop_clock import LoopClock

pytestmark = pytest.mark.skipif(not (on_cpu() or on_cuda()), reason="MLX from a second thread crashes Metal")


def _cache(dtype, tokens=7, layers=3, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        k = mx.array(rng.standard_normal((1, 2, tokens, 16)).astype(np.float32)).astype(dtype)
        v = mx.array(rng.standard_normal((1, 2, tokens, 8)).astype(np.float32)).astype(dtype)
        c.update_and_fetch(k, v)
        out.append(c)
    return out


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_copies_made_on_another_thread_rebuild_the_same_kv(dtype):
    cache = _cache(dtype)
    buf = bytearray(kv_nbytes(cache) + 64)
    layers = write_kv(buf, 0, cache)
    with ThreadPoolExecutor(1) as pool:
        copies = pool.submit(copy_kv, buf, layers).result(timeout=10)
    buf[:] = bytes(len(buf))  # the copies own their memory
    for got, want in zip(kv_from_copies(copies, layers), cache):
        assert got.offset == 7 and got.keys.dtype == dtype
        assert mx.array_equal(got.keys[..., :7, :], want.keys[..., :7, :])
        assert mx.array_equal(got.values[..., :7, :], want.values[..., :7, :])
    buf2 = bytearray(len(buf))
    write_kv(buf2, 0, cache)
    assert all(mx.array_equal(a.keys, b.keys[..., :7, :]) for a, b in zip(read_kv(buf2, layers), cache))


class _Cache(FakeCacheService):
    """The decode side's cache service: a handoff's lease was taken by the
    prefill worker's lookup, not through this client."""

    def __init__(self):
        super().__init__(strict_leases=False)


class _Decode:
    has_work = False

    def __init__(self):
        self.added, self.cancelled = [], []

    def add(self, req, cache):
        self.added.append((req.request_id, cache))

    def cancel(self, request_id, save=True):
        self.cancelled.append(request_id)


class _Gate:
    """copy_kv that waits for the test to open it (a slow copy)."""

    def __init__(self):
        self.open = threading.Event()

    def __call__(self, buf, layers):
        assert self.open.wait(10)
        return copy_kv(buf, layers)


def _worker(buf, monkeypatch, gate):
    monkeypatch.setattr(handoff, "copy_kv", gate)
    return DecodeRole(_Decode(), worker_id="decode-0", prefix=None, cache=_Cache(), arena_buf=lambda name: buf,
                      outbox=None, clock=LoopClock("test"), local_kv={}, reader=ThreadPoolExecutor(1))


def _request(rid, layers, allocation, lease=-1):
    h = KVHandoff(rid, 7, 7, arena="a", allocation=allocation, layers=layers,
                  blocks=HeldBlocks([b"x"] if lease >= 0 else [], lease=lease))
    return DecodeRequest(rid, list(range(7)), 1, h, SamplingParams(max_tokens=8))


def test_requests_start_in_order_once_copied_and_a_cancel_while_copying_gives_back_the_handoff(monkeypatch):
    cache = _cache(mx.bfloat16)
    buf = bytearray(kv_nbytes(cache) + 64)
    layers = write_kv(buf, 0, cache)
    gate = _Gate()
    w = _worker(buf, monkeypatch, gate)
    try:
        w.handle(_request("a", layers, allocation=1))
        w.handle(_request("b", layers, allocation=2, lease=9))
        w.handle(_request("c", [], allocation=-1))  # nothing to copy: still waits its turn
        w.take_reads(wait=False)
        assert w.engine.added == [] and len(w.reading) == 3 and w.has_work()
        w.cancel("b")  # its copy still pending
        assert [r.request_id for r, _ in w.reading] == ["a", "c"]
        assert w.cache.freed == [2] and w.cache.released == [9]
        gate.open.set()
        w.take_reads(wait=True)
        assert [rid for rid, _ in w.engine.added] == ["a", "c"]
        assert w.cache.freed == [2, 1]  # a's arena slot, once its KV was copied
        got = w.engine.added[0][1]
        assert all(mx.array_equal(g.keys[..., :7, :], c.keys[..., :7, :]) for g, c in zip(got, cache))
        assert not w.reading
    finally:
        gate.open.set()
        w.reader.shutdown(wait=True)
