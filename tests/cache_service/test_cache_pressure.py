"""The cache service under memory pressure (cache_service/pressure.py):
a recorded "warn" then "critical" shrink the arena's KV blocks least
recently used first, leave leased blocks alone, give the pages back, and
show it in the stats /metrics reads.

The level comes from a file (Settings.memory_pressure_file): a double for
PSI or macOS readings, which this machine cannot be made to report on cue."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from cache_service.arena import Arena, new_arena_name
from cache_service.service import CacheService
from environment.memory_pressure import PressurePoll, PressureReader
from protos.messages import CacheStats, KVCommit, KVLookup, KVRelease, KVReserve

BLOCK = 64 << 10  # 16 pages: whole pages to give back


def H(*parts) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def service(tmp_path):
    arena = Arena.create(new_arena_name("tpress"), 32 * BLOCK)
    level = tmp_path / "pressure"
    level.write_text("normal")
    clock = Clock()
    svc = CacheService(arena, arena.size, pressure=PressurePoll(PressureReader(str(level)), 2.0, clock))
    svc.level, svc.clock = level, clock
    yield svc
    svc.close()
    arena.close()
    arena.unlink()


def store(svc, name: str, n: int) -> list[bytes]:
    """A conversation's n blocks, written (non-zero bytes) and committed."""
    hashes = [H(name, i) for i in range(n)]
    reply = svc.handle(KVReserve(call_id=1, hashes=hashes, nbytes=BLOCK, owner="w", ttl_s=30.0))
    assert reply.ok and len(reply.blocks) == n
    for ref in reply.blocks:
        svc.arena.ndarray(ref.offset, np.uint8, (BLOCK,))[:] = 7
    assert svc.handle(KVCommit(call_id=2, hashes=hashes, owner="w")).ok
    return hashes


def cached(svc, hashes) -> list[bool]:
    return [svc.index.get(h) is not None for h in hashes]


def press(svc, level: str) -> None:
    svc.level.write_text(level)
    svc.clock.now += 2.0  # the next reading is due
    svc.tick()


def test_warn_then_critical_shrink_lru_first_and_spare_leased_blocks(service):
    svc = service
    old = store(svc, "old", 4)
    leased = store(svc, "leased", 4)
    new = store(svc, "new", 8)
    lookup = svc.handle(KVLookup(call_id=3, hashes=leased, owner="decode", lease_s=60.0))
    assert lookup.ok and len(lookup.blocks) == 4  # in use: the lookup made them the most recent too
    used = svc.handle(KVLookup(call_id=4, hashes=new, owner="x", lease_s=60.0))
    svc.handle(KVRelease(call_id=5, lease=used.lease))  # `new` used, then let go
    held = svc.stats()["memory_bytes"]
    assert held == 16 * BLOCK and svc.stats()["memory_pressure"] == 0

    press(svc, "warn")  # at most half of what they held: 8 of 16 blocks go, the coldest first
    st = svc.stats()
    assert st["memory_pressure"] == 1
    assert st["memory_bytes"] <= held // 2
    assert cached(svc, old) == [False] * 4  # least recently used: first out
    assert all(cached(svc, leased))
    assert st["memory_pressure_freed_bytes_total"] == held - st["memory_bytes"]
    for ref in lookup.blocks:  # what a reader holds is untouched, bytes and all
        assert (svc.arena.ndarray(ref.offset, np.uint8, (BLOCK,)) == 7).all()

    # The ceiling holds while the pressure lasts: new blocks push old ones out.
    ceiling = svc.pressure.ceiling
    store(svc, "during", 4)
    press(svc, "warn")
    assert svc.stats()["memory_bytes"] <= ceiling

    press(svc, "critical")  # everything nobody holds
    st = svc.stats()
    assert st["memory_pressure"] == 2 and st["memory_bytes"] == 4 * BLOCK
    assert all(cached(svc, leased)) and not any(cached(svc, new))

    svc.handle(KVRelease(call_id=6, lease=lookup.lease))
    press(svc, "normal")  # no ceiling any more: the cache grows again
    assert svc.pressure.ceiling is None and svc.stats()["memory_pressure"] == 0
    again = store(svc, "after", 20)
    assert all(cached(svc, again)) and all(cached(svc, leased))


def test_evicted_pages_are_given_back(service):
    """On Linux the freed ranges are punched out of the shared-memory file
    (MADV_REMOVE): they read as zeros, and the file's blocks drop."""
    svc = service
    hashes = store(svc, "c", 16)
    refs = [svc.index.get(h) for h in hashes]
    path = f"/dev/shm/{svc.arena.name}"
    if not os.path.exists(path):
        pytest.skip("no /dev/shm on this system")
    before = os.stat(path).st_blocks
    press(svc, "critical")
    assert not any(cached(svc, hashes))
    assert os.stat(path).st_blocks < before
    assert all((svc.arena.ndarray(r.offset, np.uint8, (BLOCK,)) == 0).all() for r in refs)


def test_a_reading_is_taken_only_every_poll(service):
    svc = service
    store(svc, "c", 4)
    svc.tick()  # the first reading is due at once: normal; the next not before 2 s
    svc.level.write_text("critical")
    svc.clock.now += 1.0
    svc.tick()
    svc.tick()
    assert svc.stats()["memory_bytes"] == 4 * BLOCK
    svc.clock.now += 1.0
    svc.tick()
    assert svc.stats()["memory_bytes"] == 0


def test_no_pressure_reader_no_pressure_stats():
    arena = Arena.create(new_arena_name("tpress"), 4 * BLOCK)
    try:
        svc = CacheService(arena, arena.size)
        svc.tick()
        reply = svc.handle(CacheStats(call_id=1))
        assert reply.ok and "memory_pressure" not in reply.stats
    finally:
        arena.close()
        arena.unlink()
