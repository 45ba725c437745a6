"""Cache service: allocator unit tests, then real processes over real ipc
sockets and real shared memory (every child started with the spawn method)."""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from cache_service import main as cache_main
from cache_service.allocator import ALIGNMENT, Allocator
from cache_service.arena import Arena, ArenaAttachment, new_arena_name, unlink_arena
from cache_service.client import AsyncCacheClient, CacheClient, CacheUnavailable
from environment.settings import Settings
from protos.codec import encode
from protos.messages import CacheAlloc, CacheAllocReply, CacheReply, CacheStats, KVLookup, KVReserve
from protos.transport import ipc_address, make_socket, recv, send

SPAWN = mp.get_context("spawn")
PREFIX = f"tct{os.getpid()}"  # every arena these tests make starts with this
MiB = 1 << 20


# ------------------------------------------------------------------ fixtures --


@pytest.fixture(scope="module", autouse=True)
def no_leaked_segments():
    yield
    if os.path.isdir("/dev/shm"):  # Linux; macOS has no listable shm namespace
        leaked = [n for n in os.listdir("/dev/shm") if n.startswith(PREFIX)]
        for name in leaked:
            unlink_arena(name)
        assert not leaked, f"shared-memory segments left behind: {leaked}"


@pytest.fixture
def procs():
    """start(target, *args) -> a spawned Process, always reaped at teardown."""
    started = []

    def start(target, *args):
        p = SPAWN.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        if p.is_alive():
            p.terminate()
    for p in started:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


@pytest.fixture
def make_settings():
    """make_settings(**overrides) -> Settings with a fresh arena name; every
    arena named is unlinked at teardown whatever happened."""
    run_dir = tempfile.mkdtemp(prefix="tc-")  # short: ipc paths are limited to ~100 bytes
    names = []

    def make(**overrides):
        name = new_arena_name(PREFIX)
        names.append(name)
        # cache_dir=None: no disk tier unless a test passes its own temp folder
        # (never the user's cache folder, the Settings default).
        fields = dict(run_dir=run_dir, arena_name=name, cache_memory_bytes=4 * MiB, cache_dir=None,
                      cache_call_timeout_s=3.0, log_level="warning")
        fields.update(overrides)
        return Settings(**fields)

    yield make
    for name in names:
        unlink_arena(name)
    shutil.rmtree(run_dir, ignore_errors=True)


def start_service(procs, settings):
    ready = SPAWN.Event()
    p = procs(cache_main.run, settings, ready)
    assert ready.wait(20), "cache service did not start"
    return p


def wait_for(predicate, timeout_s=5.0, interval_s=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


# Children (module level so spawn can pickle them by name).


def _pattern(nbytes, seed):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def child_write(arena_name, offset, nbytes, seed):
    arena = Arena.attach(arena_name)
    arena.ndarray(offset, np.uint8, (nbytes,))[:] = _pattern(nbytes, seed)
    arena.close()


def child_check(arena_name, offset, nbytes, seed):
    arena = Arena.attach(arena_name)
    ok = bytes(arena.view(offset, nbytes)) == _pattern(nbytes, seed).tobytes()
    arena.close()
    sys.exit(0 if ok else 3)


BLK = 64 * 1024  # bytes per KV block in the prefix cache tests
STATS_KEYS = {  # what /metrics and health checks read
    "pid", "arena_bytes", "used_bytes", "free_bytes", "allocations", "largest_free", "allocs_total", "frees_total",
    "expired_total", "failed_total", "memory_bytes", "blocks", "disk_bytes", "disk_blocks", "lookups_total",
    "lookup_hit_blocks_total", "lookup_miss_total", "evictions_total", "disk_evictions_total", "disk_hits_total",
    "disk_corrupt_total", "reservations_expired_total", "leases_expired_total", "handoffs", "handoff_bytes"}


def H(*parts) -> bytes:
    """A 32-byte block hash named by `parts`."""
    return hashlib.sha256(repr(parts).encode()).digest()


def chain(name, n):
    return [H(name, i) for i in range(n)]


def child_put_blocks(settings, hashes, seed, out):
    """A worker's put: reserve, write each block's pattern, commit."""
    with CacheClient(settings) as client:
        reply = client.reserve(hashes, BLK, owner="writer")
        arena = Arena.attach(reply.arena)
        for ref in reply.blocks:
            arena.ndarray(ref.offset, np.uint8, (BLK,))[:] = _pattern(BLK, (seed, hashes.index(ref.hash)))
        arena.close()
        out.put((len(reply.blocks), client.commit([r.hash for r in reply.blocks], owner="writer").stats))


def child_lookup_check(settings, hashes, seed, out):
    """A worker's read: lookup, compare every leased block, release."""
    with CacheClient(settings) as client:
        reply = client.lookup(hashes, owner="reader")
        arena = Arena.attach(reply.arena)
        same = [bytes(arena.view(r.offset, r.nbytes)) == _pattern(BLK, (seed, i)).tobytes()
                for i, r in enumerate(reply.blocks)]
        arena.close()
        client.release(reply.lease)
        out.put(([r.hash for r in reply.blocks] == hashes[:len(reply.blocks)], same))


def child_reserve_and_hang(settings, hashes, ttl_s, out):
    reply = CacheClient(settings).reserve(hashes, BLK, owner="doomed", ttl_s=ttl_s)
    out.put([r.offset for r in reply.blocks])
    time.sleep(60)  # killed long before this, never commits


def child_hold(settings, ttl_s, out):
    reply = CacheClient(settings).alloc(MiB, owner="doomed", ttl_s=ttl_s)
    out.put(reply.allocation if reply.ok else reply.error)
    time.sleep(60)  # killed long before this


# ----------------------------------------------------------------- allocator --


def _check_invariants(a: Allocator):
    """No overlap, everything aligned and inside, free list coalesced, bytes add up."""
    spans = [(x.offset, x.size, "used") for x in a.allocations()] + [(o, n, "free") for o, n in a.free_ranges()]
    spans.sort()
    pos = 0
    for offset, size, _ in spans:
        assert offset == pos, "a gap or an overlap between ranges"
        assert offset % ALIGNMENT == 0 and size % ALIGNMENT == 0 and size > 0
        pos += size
    assert pos == a.capacity
    free = a.free_ranges()
    for (o1, n1), (o2, _) in zip(free, free[1:]):
        assert o1 + n1 < o2, "two adjacent free ranges were not coalesced"
    st = a.stats()
    assert st["used_bytes"] + st["free_bytes"] == st["arena_bytes"] == a.capacity
    assert st["used_bytes"] == sum(x.size for x in a.allocations())
    assert st["largest_free"] == max((n for _, n in free), default=0)


def test_allocator_random_sequences_never_overlap():
    for seed in range(5):
        rng = random.Random(seed)
        a = Allocator(256 * 1024 + 40)  # a ragged tail is dropped, not half-used
        assert a.capacity == 256 * 1024
        live = []
        for _ in range(1500):
            if live and rng.random() < 0.45:
                alloc = live.pop(rng.randrange(len(live)))
                assert a.free(alloc.id) is alloc
            else:
                n = rng.choice([1, 63, 64, 65, rng.randint(1, 4096), rng.randint(1, 40000)])
                alloc = a.alloc(n, owner=f"o{rng.randint(0, 5)}", ttl_s=60)
                if alloc is None:
                    assert a.stats()["largest_free"] < -(-n // ALIGNMENT) * ALIGNMENT
                else:
                    assert alloc.nbytes == n and alloc.size >= n
                    live.append(alloc)
            _check_invariants(a)
        for alloc in live:
            a.free(alloc.id)
        assert a.free_ranges() == [(0, a.capacity)], "freeing everything must leave one range"
        st = a.stats()
        assert st["allocations"] == 0 and st["used_bytes"] == 0
        assert st["allocs_total"] == st["frees_total"]


def test_allocator_coalesces_in_any_free_order():
    a = Allocator(64 * 10)
    blocks = [a.alloc(64, "x", 10) for _ in range(10)]
    assert a.alloc(1, "x", 10) is None  # full
    for i in [3, 5, 4, 0, 9, 1, 8, 2, 7, 6]:
        a.free(blocks[i].id)
        _check_invariants(a)
    assert a.free_ranges() == [(0, 640)]


def test_allocator_best_fit_full_and_invalid():
    a = Allocator(1024)
    small, big = a.alloc(64, "a", 10), a.alloc(512, "a", 10)
    rest = a.alloc(448, "a", 10)
    a.free(small.id)
    a.free(big.id)
    assert a.alloc(64, "b", 10).offset == 0  # the 64-byte hole, not the 512 one
    assert a.alloc(1025, "b", 10) is None
    assert a.stats()["failed_total"] == 1
    for bad in [0, -5, 1.5, True, "64"]:
        with pytest.raises(ValueError):
            a.alloc(bad, "b", 10)
    for bad_ttl in [0, -1, float("inf"), float("nan")]:
        with pytest.raises(ValueError):
            a.alloc(64, "b", bad_ttl)
    assert a.free(rest.id) is rest and a.free(rest.id) is None


def test_allocator_expiry_and_owner():
    now = [100.0]
    a = Allocator(4096, clock=lambda: now[0])
    short = a.alloc(100, "r1", ttl_s=1)
    long = a.alloc(100, "r1", ttl_s=10)
    other = a.alloc(100, "r2", ttl_s=5)
    assert a.next_deadline() == 101.0
    a.free(short.id)  # freed before its deadline: expire must not count it
    now[0] = 106.0
    assert [x.id for x in a.expire()] == [other.id]
    assert a.next_deadline() == 110.0
    assert [x.id for x in a.free_owner("r1")] == [long.id]
    assert a.free_owner("r1") == [] and a.free_owner("nobody") == []
    st = a.stats()
    assert (st["allocs_total"], st["frees_total"], st["expired_total"], st["allocations"]) == (3, 2, 1, 0)
    assert a.next_deadline() is None and a.free_ranges() == [(0, 4096)]


# --------------------------------------------------------------------- arena --


def test_arena_views_bounds_and_lifetime():
    name = new_arena_name(PREFIX)
    arena = Arena.create(name, MiB)
    try:
        arr = arena.ndarray(128, np.float32, (4, 8))
        arr[:] = np.arange(32, dtype=np.float32).reshape(4, 8)
        other = Arena.attach(name)
        assert other.size >= MiB
        assert np.array_equal(other.ndarray(128, "float32", [4, 8]), arr)  # same memory, no copy
        other.view(0, 4)[:] = b"abcd"
        assert bytes(arena.buf[:4]) == b"abcd"
        with pytest.raises(ValueError):
            arena.view(arena.size - 2, 4)
        with pytest.raises(ValueError):
            arena.ndarray(-64, np.uint8, (1,))
        with pytest.raises(FileExistsError):
            Arena.create(name, MiB)
        with pytest.raises(ValueError):
            Arena.attach("x" * 31)  # longer than macOS allows
        other.close()  # `arr` still points into the arena: close must not break it
        arena.close()
        arena.close()
        assert arr[3, 7] == 31.0
        with pytest.raises(ValueError):
            arena.buf
        del arr
    finally:
        arena.unlink()
        arena.unlink()  # idempotent
    with pytest.raises(FileNotFoundError):
        Arena.attach(name)
    assert unlink_arena(name) is False


def test_attaching_process_exit_does_not_unlink_or_warn():
    """Python < 3.13's resource tracker unlinks a segment when a process that
    only attached to it exits (and warns about a 'leak'); ours must not."""
    name = new_arena_name(PREFIX)
    arena = Arena.create(name, MiB)
    try:
        code = ("import sys; from cache_service.arena import Arena\n"
                "a = Arena.attach(sys.argv[1]); a.view(0, 2)[:] = b'ok'; a.close()")
        done = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert "leak" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr
        again = Arena.attach(name)  # still there
        assert bytes(again.view(0, 2)) == b"ok"
        again.close()
    finally:
        arena.close()
        arena.unlink()


# ------------------------------------------------------------------- service --


def test_handoff_written_and_read_by_other_processes(procs, make_settings):
    settings = make_settings()
    svc = start_service(procs, settings)
    client = CacheClient(settings)
    nbytes = 3 * MiB + 5
    reply = client.alloc(nbytes, owner="req-1", ttl_s=30)
    assert reply.ok and reply.arena == settings.arena_name and reply.nbytes == nbytes
    assert reply.offset % ALIGNMENT == 0

    writer = procs(child_write, reply.arena, reply.offset, nbytes, 7)
    writer.join(20)
    assert writer.exitcode == 0
    reader = procs(child_check, reply.arena, reply.offset, nbytes, 7)
    reader.join(20)
    assert reader.exitcode == 0, "the third process did not read what the second wrote"

    attached = ArenaAttachment()
    assert attached.get(reply.arena).view(reply.offset, 16) == _pattern(nbytes, 7)[:16].tobytes()
    attached.close()

    st = client.stats()
    assert st["allocations"] == 1 and st["used_bytes"] >= nbytes and st["allocs_total"] == 1
    assert st["pid"] == svc.pid
    freed = client.free([reply.allocation], arena=reply.arena)
    assert freed.ok and freed.stats == {"freed": 1, "unknown": 0}
    st = client.stats()
    assert st["allocations"] == 0 and st["used_bytes"] == 0 and st["frees_total"] == 1
    client.close()


def test_alloc_fails_clearly_when_full_or_invalid(procs, make_settings):
    settings = make_settings(cache_memory_bytes=MiB)
    start_service(procs, settings)
    with CacheClient(settings) as client:
        first = client.alloc(MiB // 2, owner="a")
        assert first.ok
        full = client.alloc(MiB // 2 + 64, owner="b")
        assert not full.ok and full.allocation == -1
        assert "full" in full.error and str(MiB // 2 + 64) in full.error, full.error
        huge = client.alloc(2 * MiB, owner="b")
        assert not huge.ok and "larger than the whole cache arena" in huge.error, huge.error
        for bad in [0, -1]:
            invalid = client.alloc(bad, owner="b")
            assert not invalid.ok and "nbytes" in invalid.error, invalid.error
        assert not client.alloc(64, owner="b", ttl_s=0).ok
        st = client.stats()
        assert st["failed_total"] == 2 and st["allocations"] == 1
        assert st["arena_bytes"] == MiB and st["largest_free"] == MiB // 2


def test_ttl_expiry_frees_reservation_of_killed_holder(procs, make_settings):
    settings = make_settings()
    start_service(procs, settings)
    out = SPAWN.Queue()
    holder = procs(child_hold, settings, 0.5, out)
    alloc_id = out.get(timeout=20)
    assert isinstance(alloc_id, int), alloc_id
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(5)
    with CacheClient(settings) as client:
        assert client.stats()["allocations"] in (0, 1)  # may already have expired
        assert wait_for(lambda: client.stats()["expired_total"] == 1, timeout_s=5)
        st = client.stats()
        assert st["allocations"] == 0 and st["used_bytes"] == 0 and st["frees_total"] == 0
        late = client.free([alloc_id])  # the holder's late free finds nothing
        assert late.ok and late.stats == {"freed": 0, "unknown": 1}
        assert client.alloc(settings.cache_memory_bytes, owner="next").ok  # all space is back


def test_free_by_owner_and_stats(procs, make_settings):
    settings = make_settings()
    start_service(procs, settings)
    with CacheClient(settings) as client:
        mine = [client.alloc(1000, owner="req-a") for _ in range(3)]
        theirs = client.alloc(5000, owner="req-b")
        assert all(r.ok for r in mine) and theirs.ok
        st = client.stats()
        assert st["allocations"] == 4 and st["used_bytes"] == 3 * 1024 + 5056
        reply = client.free(owner="req-a")
        assert reply.ok and reply.stats["freed"] == 3
        st = client.stats()
        assert st["allocations"] == 1 and st["used_bytes"] == 5056 and st["frees_total"] == 3
        assert not client.free().ok  # names nothing
        assert not client.free([theirs.allocation], arena="some-old-arena").ok
        assert client.free([theirs.allocation], owner="req-b").stats == {"freed": 1, "unknown": 0}
        st = client.stats()
        assert st["allocations"] == 0 and st["largest_free"] == st["arena_bytes"]
        assert (st["allocs_total"], st["frees_total"], st["expired_total"]) == (4, 4, 0)


def test_garbage_messages_do_not_kill_the_service(procs, make_settings):
    settings = make_settings()
    p = start_service(procs, settings)
    address = ipc_address(settings.run_dir, "cache")
    ctx = zmq.Context()
    raw = make_socket(ctx, zmq.DEALER)
    raw.connect(address)
    rng = random.Random(1)
    deep = []
    for _ in range(200):
        deep = [deep]
    garbage = [
        [bytes(rng.getrandbits(8) for _ in range(64))],
        [b""],
        [msgpack.packb({"v": 999, "t": "CacheStats", "b": {"call_id": 1}})],  # wrong version
        [msgpack.packb({"v": 1, "t": ["CacheStats"], "b": {}})],  # type name not a string
        [msgpack.packb({"v": 1, "t": "CacheAlloc", "b": {"call_id": 2, "nbytes": "lots", "owner": "x"}})],
        [msgpack.packb({"v": 1, "t": "CacheFree", "b": {"call_id": 3, "allocations": ["x", deep]}})],
        [msgpack.packb({"v": 1, "t": "NoSuchMessage", "b": {}}), b"extra", b"frames"],
        encode(CacheReply(call_id=4, ok=True)),  # a real message, but not a request
        # The prefix cache's calls: a bad field type is dropped by the codec,
        # a bad value costs its own call an error reply.
        [msgpack.packb({"v": 1, "t": "KVLookup", "b": {"call_id": 6, "hashes": [1, "x"], "owner": "o"}})],
        [msgpack.packb({"v": 1, "t": "KVReserve", "b": {"call_id": 60, "hashes": [], "nbytes": "big", "owner": "o"}})],
        [msgpack.packb({"v": 1, "t": "KVReserve", "b": {"call_id": 7, "hashes": [b"h" * 32], "nbytes": -5,
                                                         "owner": "o"}})],
        [msgpack.packb({"v": 1, "t": "KVCommit", "b": {"call_id": 61, "hashes": "not a list"}})],
        [msgpack.packb({"v": 1, "t": "KVRelease", "b": {"call_id": 62, "lease": "x"}})],
        [msgpack.packb({"v": 1, "t": "KVCommit", "b": {"call_id": 8, "hashes": [deep]}})],
        # An array descriptor without "d" (a KeyError that once killed the router's loop).
        [msgpack.packb({"v": 1, "t": "CacheAlloc", "b": {"call_id": 13, "nbytes": {"~a": 0, "s": [1]}, "owner": "o"}}),
         b"x"],
        # Well-typed, hostile values: each costs its own call an error reply.
        encode(CacheAlloc(call_id=9, nbytes=64, owner="o", ttl_s=1e300)),  # would pin the space for ever
        encode(KVLookup(call_id=10, hashes=[b"h" * 32], owner="o", lease_s=float("inf"))),
        encode(KVReserve(call_id=11, hashes=[b"short"], nbytes=64, owner="o")),
        encode(CacheAlloc(call_id=12, nbytes=-1, owner="o")),
    ]
    for frames in garbage:
        raw.send_multipart(frames)
    # Bad field types (3, 6, 60, 61, 62, 8, 13: list elements included) are dropped
    # by the codec; a bad value costs only its own call an error reply.
    send(raw, CacheStats(call_id=5))
    assert raw.poll(5000)
    replies = [recv(raw)]
    while raw.poll(200):
        replies.append(recv(raw))
    assert [r.call_id for r in replies] == [7, 9, 10, 11, 12, 5]
    assert not any(r.ok for r in replies[:5]) and replies[5].ok
    assert "nbytes" in replies[0].error and "ttl_s" in replies[1].error and "lease_s" in replies[2].error, replies
    assert "hash" in replies[3].error and "nbytes" in replies[4].error, replies
    raw.close()
    ctx.term()
    # Bytes that are not ZMTP at all, straight into the socket file.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(address[len("ipc://"):])
        s.sendall(os.urandom(4096))
    time.sleep(0.2)
    assert p.is_alive()
    with CacheClient(settings) as client:
        assert client.stats()["allocations"] == 0
        assert client.alloc(64, owner="after").ok


def test_client_unavailable_when_service_dead_then_recovers(procs, make_settings):
    first = make_settings(cache_call_timeout_s=0.5)
    p = start_service(procs, first)
    client = CacheClient(first)
    held = client.alloc(4096, owner="r")
    assert held.ok
    attached = ArenaAttachment()
    old_arena = attached.get(held.arena)

    p.kill()  # kill -9: no cleanup in the service
    p.join(5)
    for call in (client.stats, lambda: client.alloc(64, owner="r")):
        t0 = time.monotonic()
        with pytest.raises(CacheUnavailable):
            call()
        # Its 0.5 s deadline, not sooner; the ceiling only catches a call that
        # hangs (no deadline), with room for a loaded box.
        assert 0.45 <= time.monotonic() - t0 < 5

    async def async_dead():
        aclient = AsyncCacheClient(first)
        t0 = time.monotonic()
        with pytest.raises(CacheUnavailable):
            await aclient.stats()
        aclient.close()
        return time.monotonic() - t0

    assert 0.45 <= asyncio.run(async_dead()) < 5  # as above
    # The killed service could not unlink its segment: the supervisor does.
    assert unlink_arena(first.arena_name) is True

    second = make_settings(cache_call_timeout_s=3.0)  # same run_dir, fresh arena
    start_service(procs, second)
    reply = client.alloc(4096, owner="r")  # same client object, fresh socket
    assert reply.ok and reply.arena == second.arena_name
    stale = client.free([held.allocation], arena=held.arena)
    assert not stale.ok and "stale arena" in stale.error
    assert client.stats()["allocations"] == 1
    assert attached.get(reply.arena) is not old_arena  # the worker re-attached
    attached.close()
    client.close()


def test_async_client_concurrent_calls(procs, make_settings):
    settings = make_settings()
    start_service(procs, settings)

    async def main():
        client = AsyncCacheClient(settings)
        replies = await asyncio.gather(*[client.alloc(1000, owner=f"r{i % 2}") for i in range(6)],
                                       client.stats())
        assert all(r.ok for r in replies[:6])
        offsets = sorted(r.offset for r in replies[:6])
        assert all(b - a >= 1000 for a, b in zip(offsets, offsets[1:]))
        freed = await asyncio.gather(client.free(owner="r0"), client.free(owner="r1"))
        assert [f.stats["freed"] for f in freed] == [3, 3]
        # A cancelled call leaves its reply behind; the next call must skip it.
        task = asyncio.ensure_future(client.stats())
        await asyncio.sleep(0)
        task.cancel()
        st = await client.stats()
        client.close()
        return st

    st = asyncio.run(main())
    assert st["allocations"] == 0 and st["allocs_total"] == 6 and st["frees_total"] == 6


def test_stale_and_foreign_replies_are_dropped(make_settings):
    """A fake service answers with a stale call id and a wrong type first."""
    settings = make_settings(cache_call_timeout_s=3.0)
    ctx = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER)
    router.bind(ipc_address(settings.run_dir, "cache"))

    def fake_service():
        if not router.poll(5000):
            return
        peer, msg = recv(router, routed=True)
        send(router, CacheReply(call_id=msg.call_id - 1, ok=True, stats={"wrong": 1}), to=peer)
        send(router, CacheAllocReply(call_id=msg.call_id, ok=True), to=peer)
        send(router, CacheReply(call_id=msg.call_id, ok=True, stats={"right": 1}), to=peer)

    thread = threading.Thread(target=fake_service, daemon=True)
    thread.start()
    try:
        with CacheClient(settings) as client:
            assert client.stats() == {"right": 1}
    finally:
        thread.join(5)
        router.close()
        ctx.term()


def test_sigterm_stops_service_and_unlinks_arena(procs, make_settings):
    settings = make_settings()
    p = start_service(procs, settings)
    with CacheClient(settings) as client:
        assert client.alloc(1000, owner="r").ok  # a live reservation does not delay stopping
    Arena.attach(settings.arena_name).close()
    t0 = time.monotonic()
    p.terminate()  # SIGTERM
    p.join(10)
    # Within a loop tick (0.25 s) and the disk flush (<= 1 s) on a quiet box;
    # waiting for the reservation (120 s ttl) or missing the signal is the failure.
    assert p.exitcode == 0 and time.monotonic() - t0 < 5
    with pytest.raises(FileNotFoundError):
        Arena.attach(settings.arena_name)


# -------------------------------------------------------------- prefix cache --


def put_blocks(client, hashes, owner="w", arena=None, seed=None):
    """Reserve and commit from this process; write patterns when given an arena."""
    reply = client.reserve(hashes, BLK, owner=owner)
    assert reply.ok, reply.error
    for ref in reply.blocks:
        if arena is not None:
            arena.get(reply.arena).view(ref.offset, BLK)[:] = _pattern(BLK, (seed, hashes.index(ref.hash)))
    client.commit([r.hash for r in reply.blocks], owner=owner)
    return reply.blocks


def looked_up(client, hashes, lease_s=30.0):
    """Hashes a lookup returns (its lease released at once)."""
    reply = client.lookup(hashes, owner="probe", lease_s=lease_s)
    assert reply.ok, reply.error
    client.release(reply.lease)
    return [r.hash for r in reply.blocks]


def test_release_and_a_free_without_wait_are_sent_not_waited_for(procs, make_settings):
    """A worker's MLX thread releases a lease and frees a handoff per decode
    request without a round trip: the call only sends. The service takes the
    socket's requests in order, so the next call already sees them done, and
    their replies are dropped there; with the service gone they cost no
    deadline."""
    settings = make_settings(cache_call_timeout_s=0.5)
    p = start_service(procs, settings)
    client = CacheClient(settings)
    put = client.reserve(chain("r", 2), BLK, owner="w")
    client.commit([r.hash for r in put.blocks], owner="w")
    lease = client.lookup(chain("r", 2), owner="reader").lease
    handoff = client.alloc(4096, owner="req")
    assert lease >= 0 and handoff.ok and client.stats()["leases"] == 1
    assert client.release(lease) is None
    assert client.free([handoff.allocation], arena=handoff.arena, wait=False) is None
    st = client.stats()  # the very next call: both done, their replies dropped
    assert (st["leases"], st["handoffs"], st["frees_total"]) == (0, 0, 1)
    # A client that only posts (a decode worker's frees) keeps no backlog of
    # replies: each post drops the replies already in. Waiting for each reply
    # to arrive (the queue was empty, so poll sees that one) before the next
    # post makes the count exact: the last reply alone stays; without the
    # drop, all 50 would.
    for i in range(50):
        client.free([10_000 + i], arena=handoff.arena, wait=False)
        assert client._sock.poll(5000), "no reply to a post"
    pending = 0
    while client._sock.poll(200):  # nothing more is owed: this ends at once after the last
        client._sock.recv_multipart()
        pending += 1
    assert pending == 1, f"{pending} stale replies kept"
    p.kill()
    p.join(5)
    t0 = time.monotonic()
    client.release(lease)
    client.free([handoff.allocation], arena=handoff.arena, wait=False)
    # Neither waited: one waiting call alone would take its 0.5 s deadline, then raise.
    assert time.monotonic() - t0 < 0.45
    with pytest.raises(CacheUnavailable):
        client.stats()
    client.close()


def test_prefix_lookup_reserve_commit_across_processes(procs, make_settings):
    settings = make_settings(cache_memory_bytes=16 * BLK)
    start_service(procs, settings)
    client = CacheClient(settings)
    out = SPAWN.Queue()
    a = chain("a", 4)
    writer = procs(child_put_blocks, settings, a[:3], 7, out)
    assert out.get(timeout=20) == (3, {"committed": 3, "unknown": 0})
    writer.join(10)
    # Reserved but not committed: never returned, and not reserved twice.
    mine = client.reserve(a, BLK, owner="me")
    assert mine.ok and mine.arena == settings.arena_name and [r.hash for r in mine.blocks] == [a[3]]
    assert mine.blocks[0].nbytes == BLK and mine.blocks[0].offset % ALIGNMENT == 0
    assert client.reserve(a, BLK, owner="other").blocks == []
    reader = procs(child_lookup_check, settings, a, 7, out)
    assert out.get(timeout=20) == (True, [True, True, True]), "another process read other bytes"
    reader.join(10)
    assert looked_up(client, [a[0], H("miss"), a[1], a[2]]) == [a[0]]  # nothing past a miss
    assert looked_up(client, [H("miss")] + a) == []
    assert client.lookup([H("miss")], owner="r").lease == -1
    client.release(-1)  # nothing to release: no call
    assert client.commit([a[3]], owner="not-me").stats == {"committed": 0, "unknown": 1}
    assert client.commit([a[3]], owner="me").stats == {"committed": 1, "unknown": 0}
    assert looked_up(client, a) == a

    # A writer killed before committing: its reservation expires, the block is
    # never served, and the space is reused.
    doomed = H("doomed")
    hung = procs(child_reserve_and_hang, settings, [doomed], 0.5, out)
    (offset,) = out.get(timeout=20)
    os.kill(hung.pid, signal.SIGKILL)
    hung.join(5)
    assert looked_up(client, [doomed]) == []
    assert wait_for(lambda: client.stats()["reservations_expired_total"] == 1, timeout_s=5)
    assert client.commit([doomed]).stats == {"committed": 0, "unknown": 1}  # too late
    assert looked_up(client, [doomed]) == []
    again = client.reserve([doomed], BLK, owner="next")
    assert [r.offset for r in again.blocks] == [offset]
    st = client.stats()
    assert (st["blocks"], st["memory_bytes"], st["writing_blocks"], st["leases"]) == (4, 4 * BLK, 1, 0)
    assert (st["lookups_total"], st["lookup_hit_blocks_total"], st["lookup_miss_total"]) == (7, 3 + 1 + 4, 6)
    assert st["evictions_total"] == 0 and st["leases_expired_total"] == 0 and st["disk_blocks"] == 0
    assert STATS_KEYS <= set(st), STATS_KEYS - set(st)
    for bad in (lambda: client.lookup([b"short"], owner="x"), lambda: client.reserve(a, 0, owner="x"),
                lambda: client.reserve(a, 17 * BLK, owner="x")):
        assert not bad().ok
    client.close()


def test_a_tail_lookup_leases_the_first_cached_candidate(procs, make_settings):
    """KVLookup(first=True), a tail block's candidates longest first: the
    first cached one alone is leased (past misses), no lookup is counted
    (the chain's was), and a miss on all leases nothing."""
    settings = make_settings(cache_memory_bytes=16 * BLK)
    start_service(procs, settings)
    client = CacheClient(settings)
    a = chain("t", 3)
    put_blocks(client, a)
    reply = client.lookup([H("miss"), a[2], a[0]], owner="r", first=True)
    assert reply.ok and [r.hash for r in reply.blocks] == [a[2]] and reply.lease >= 0
    st = client.stats()
    assert (st["leases"], st["lookup_tail_hits_total"], st["lookups_total"]) == (1, 1, 0)
    client.release(reply.lease)
    assert client.lookup([H("miss"), H("miss again")], owner="r", first=True).lease == -1
    assert client.stats()["leases"] == 0
    client.close()


def test_eviction_spares_leased_blocks_and_handoffs(procs, make_settings):
    settings = make_settings(cache_memory_bytes=6 * BLK)
    start_service(procs, settings)
    client = CacheClient(settings)
    handoff = client.alloc(BLK, owner="req-1")
    assert handoff.ok
    old = [H("old", i) for i in range(4)]
    for h in old:
        put_blocks(client, [h])
    held = client.lookup([old[0]], owner="slow-reader", lease_s=30)
    # Never released; long enough to outlast the evictions below on a loaded box.
    lapsing = client.lookup([old[1]], owner="dead-reader", lease_s=2.0)
    assert len(held.blocks) == len(lapsing.blocks) == 1
    new = [H("new", i) for i in range(5)]
    put_blocks(client, new[:1])  # the last free slot
    put_blocks(client, new[1:3])  # evicts old[2], old[3]: LRU, unleased
    st = client.stats()
    assert st["evictions_total"] == 2 and st["blocks"] == 5
    put_blocks(client, new[3:4])  # old[0], old[1] are leased: new[0] goes
    assert wait_for(lambda: client.stats()["leases_expired_total"] == 1, timeout_s=10)
    put_blocks(client, new[4:5])  # old[1]'s lease lapsed: now it can go
    assert [looked_up(client, [h]) != [] for h in old] == [True, False, False, False]
    assert [looked_up(client, [h]) != [] for h in new] == [False, True, True, True, True]
    # A handoff that needs more than is evictable fails without evicting anything.
    before = client.stats()["evictions_total"]
    assert not client.alloc(6 * BLK, owner="req-2").ok
    assert client.stats()["evictions_total"] == before == 4
    # One that fits after evicting does; the first handoff was never touched.
    big = client.alloc(2 * BLK, owner="req-2")
    assert big.ok and client.stats()["handoffs"] == 2
    assert client.free([handoff.allocation], arena=handoff.arena).stats == {"freed": 1, "unknown": 0}
    client.release(held.lease)
    st = client.stats()
    assert st["evictions_total"] == 6 and st["leases"] == 0 and st["handoff_bytes"] == 2 * BLK
    assert st["used_bytes"] == st["handoff_bytes"] + st["memory_bytes"] == (2 + st["blocks"]) * BLK
    client.close()


def test_restart_keeps_warm_prefixes_on_disk_and_drops_corrupt_files(procs, make_settings, tmp_path):
    cache_dir = str(tmp_path / "kv")
    file_bytes = BLK + 52  # header: magic, version, length, sha256
    first = make_settings(cache_dir=cache_dir, cache_memory_bytes=8 * BLK)
    p = start_service(procs, first)
    arenas = ArenaAttachment()
    a = chain("a", 4)
    with CacheClient(first) as client:
        put_blocks(client, a, arena=arenas, seed=1)
        put_blocks(client, [H("flipped")], arena=arenas, seed=2)
        put_blocks(client, [H("truncated")], arena=arenas, seed=3)
        assert wait_for(lambda: client.stats()["disk_blocks"] == 6, timeout_s=5)
        assert client.stats()["disk_bytes"] == 6 * file_bytes
    arenas.close()
    p.terminate()  # SIGTERM, as launchd or the supervisor stops it
    p.join(5)
    assert p.exitcode == 0

    def path_of(h):
        return os.path.join(cache_dir, h.hex()[:2], h.hex() + ".kvb")

    with open(path_of(H("flipped")), "r+b") as f:
        f.seek(52 + 1000)
        byte = f.read(1)
        f.seek(52 + 1000)
        f.write(bytes([byte[0] ^ 0x40]))
    with open(path_of(H("truncated")), "r+b") as f:
        f.truncate(52 + BLK // 2)

    # A new service on the same folder, with a fresh arena, and room on disk
    # for five files only.
    second = make_settings(cache_dir=cache_dir, cache_memory_bytes=8 * BLK, cache_disk_bytes=5 * file_bytes)
    assert second.arena_name != first.arena_name
    start_service(procs, second)
    client = CacheClient(second)
    st = client.stats()
    # The oldest file went at start-up: the chain's tail (written first, so
    # that the head, which every longer prompt needs, outlives it).
    assert st["disk_blocks"] == 5 and st["blocks"] == 0
    assert st["disk_evictions_total"] == 1 and not os.path.exists(path_of(a[3]))
    arenas = ArenaAttachment()
    reply = client.lookup(a, owner="r")
    assert [r.hash for r in reply.blocks] == a[:3] and reply.arena == second.arena_name
    for i, ref in enumerate(reply.blocks):
        assert bytes(arenas.get(reply.arena).view(ref.offset, ref.nbytes)) == _pattern(BLK, (1, i)).tobytes()
    client.release(reply.lease)
    assert looked_up(client, [H("flipped")]) == [] and looked_up(client, [H("truncated")]) == []
    assert not os.path.exists(path_of(H("flipped"))) and not os.path.exists(path_of(H("truncated")))
    st = client.stats()
    assert (st["disk_hits_total"], st["disk_corrupt_total"], st["disk_blocks"]) == (3, 2, 3)
    assert st["blocks"] == 3 and st["lookup_hit_blocks_total"] == 3
    # Writing past the limit evicts the least recently used file: of a[0..2],
    # just used, the tail a[2] is the least recent.
    put_blocks(client, [H("n", i) for i in range(3)], arena=arenas, seed=4)
    assert wait_for(lambda: client.stats()["disk_writes_total"] == 3, timeout_s=5)
    st = client.stats()
    assert st["disk_blocks"] == 5 and st["disk_evictions_total"] == 2 and st["disk_bytes"] == 5 * file_bytes
    assert not os.path.exists(path_of(a[2])) and all(os.path.exists(path_of(h)) for h in a[:2])
    arenas.close()
    client.close()
