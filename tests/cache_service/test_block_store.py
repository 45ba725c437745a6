"""The prefix cache's pieces in one process: the block index (pure
bookkeeping, fake clock), the disk tier (real files in a temp folder) and the
block store joining them to a real shared-memory arena."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time

import numpy as np
import pytest

from cache_service.allocator import ALIGNMENT, Allocator
from cache_service.arena import Arena, new_arena_name
from cache_service.block_file import FORMAT_VERSION, HEADER, MAGIC
from cache_service.block_index import READY, WRITING, BlockIndex
from cache_service.block_store import BlockStore
from cache_service.disk_tier import DiskTier

B = 256  # bytes per block in most tests


def H(*parts) -> bytes:
    """A 32-byte block hash named by `parts` (readable tests, real sizes)."""
    return hashlib.sha256(repr(parts).encode()).digest()


def chain(name: str, n: int) -> list[bytes]:
    return [H(name, i) for i in range(n)]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_index(blocks: int = 8, nbytes: int = B, extra: int = 0):
    clock = Clock()
    alloc = Allocator(blocks * nbytes + extra, clock=clock)
    return BlockIndex(alloc, clock=clock, first_lease_id=1), clock


def put(index, hashes, nbytes=B, owner="w", ttl_s=30.0):
    placed = index.reserve(hashes, nbytes, owner, ttl_s)
    index.commit([e.hash for e in placed])
    return placed


def ready(index, hashes) -> list[bool]:
    return [index.get(h) is not None and index.get(h).state == READY for h in hashes]


def check_consistent(index: BlockIndex):
    """Every entry owns a live allocation of its size; bytes add up; the
    allocator's own invariants hold."""
    a = index.allocator
    live = {x.id: x for x in a.allocations()}
    block_bytes = 0
    for h, e in index._entries.items():
        assert e.hash == h and e.alloc_id in live and live[e.alloc_id].offset == e.offset
        assert live[e.alloc_id].size == e.size >= e.nbytes and e.leases >= 0 and e.pins >= 0
        assert (h in index._lru) == (e.state == READY)
        block_bytes += e.size
    st = index.stats()
    assert st["handoff_bytes"] == a.stats()["used_bytes"] - block_bytes
    assert st["memory_bytes"] == sum(e.nbytes for e in index._entries.values() if e.state == READY)
    spans = sorted((x.offset, x.size) for x in live.values()) + a.free_ranges()
    spans.sort()
    pos = 0
    for offset, size in spans:
        assert offset == pos
        pos += size
    assert pos == a.capacity


# --------------------------------------------------------------- the index --


def test_lookup_returns_longest_ready_prefix_and_leases_it():
    index, _ = make_index()
    a = chain("a", 4)
    put(index, a[:2])
    index.reserve(a[2:3], B, "w", 30)  # reserved, never committed yet
    lease, got = index.lookup(a, "r", 5)
    assert [e.hash for e in got] == a[:2] and lease == 1
    assert all(e.leases == 1 for e in got)
    # Nothing past a miss, even when later blocks are ready.
    put(index, [a[3]])
    lease2, got2 = index.lookup([a[0], H("x"), a[1], a[3]], "r", 5)
    assert [e.hash for e in got2] == [a[0]] and lease2 == 2
    assert index.lookup([H("x")] + a, "r", 5) == (-1, [])
    assert index.lookup([], "r", 5) == (-1, [])
    # The writing block becomes visible only once committed.
    index.commit([a[2]])
    assert [e.hash for e in index.lookup(a, "r", 5)[1]] == a
    st = index.stats()
    assert (st["lookups_total"], st["lookup_hit_blocks_total"], st["lookup_miss_total"]) == (5, 2 + 1 + 0 + 0 + 4, 3)
    assert st["lookup_blocks_total"] == 4 + 4 + 5 + 0 + 4 and st["leases"] == 3
    assert index.release(1) and not index.release(1) and not index.release(999)
    assert index.get(a[0]).leases == 2 and index.get(a[2]).leases == 1
    check_consistent(index)


def test_reserve_skips_present_hashes_and_returns_a_prefix_when_full():
    index, _ = make_index(blocks=4)
    a = chain("a", 6)
    put(index, a[:1])
    first = index.reserve(a[:3], B, "w", 30)
    assert [e.hash for e in first] == a[1:3] and all(e.state == WRITING for e in first)
    assert index.reserve(a[:3], B, "w2", 30) == []  # ready or being written: left out
    # One slot left, nothing evictable (a[0] is the chain's own head, the rest writing).
    more = index.reserve(a, B, "w", 30)
    assert [e.hash for e in more] == [a[3]]
    assert index.get(a[4]) is None and index.stats()["evictions_total"] == 0
    # Another chain's reserve may evict a[0]: the only ready block, unleased.
    assert [e.hash for e in index.reserve([H("b"), H("c")], B, "w", 30)] == [H("b")]
    assert index.get(a[0]) is None and index.stats()["evictions_total"] == 1
    st = index.stats()
    assert st["writing_blocks"] == 4 and st["blocks"] == 0 and st["reserved_blocks_total"] == 5
    check_consistent(index)


def test_commit_needs_a_live_reservation_and_the_right_owner():
    index, clock = make_index(blocks=2)
    a, b, c = H("a"), H("b"), H("c")
    index.reserve([a], B, "alice", ttl_s=1)
    index.reserve([b], B, "bob", ttl_s=10)
    assert index.commit([b], owner="alice") == []  # not alice's reservation
    clock.now += 2
    expired = index.expire()
    assert [e.hash for e in expired.reservations] == [a] and not expired.handoffs
    assert index.commit([a]) == []  # the writer was too slow: never served
    assert index.lookup([a], "r", 5) == (-1, [])
    assert [e.hash for e in index.commit([b, c], owner="bob")] == [b]
    assert index.commit([b]) == []  # already ready
    # The expired reservation's space is reused.
    again = index.reserve([c], B, "carol", 10)
    assert len(again) == 1 and index.stats()["reservations_expired_total"] == 1
    check_consistent(index)


def test_eviction_is_lru_and_spares_leased_writing_and_handoffs():
    index, clock = make_index(blocks=6)
    handoff = index.alloc_handoff(B, "req", 60)
    blocks = [H("blk", i) for i in range(4)]
    for h in blocks:  # separate calls: no chain links between them
        put(index, [h])
    lease, _ = index.lookup([blocks[0]], "reader", lease_s=5)  # leased, and now the most recent
    index.lookup([blocks[1]], "reader", lease_s=1)  # leased briefly; its lease will lapse
    writing = index.reserve([H("w")], B, "w", 60)[0]  # the last free slot
    assert index.allocator.free_ranges() == []
    # LRU order now: 2, 3, 0 (leased), 1 (leased)
    put(index, [H("new", 0)])
    assert ready(index, blocks) == [True, True, False, True]
    put(index, [H("new", 1)])
    assert ready(index, blocks) == [True, True, False, False]
    # Only leased blocks, a writing block and the handoff remain besides the new
    # ones: the new ones go LRU-first, the rest stay.
    put(index, [H("new", 2)])
    assert index.get(H("new", 0)) is None and index.get(H("new", 1)).state == READY
    clock.now += 2
    assert len(index.expire().leases) == 1  # blocks[1]'s lease lapsed: evictable again
    put(index, [H("new", 3)])
    put(index, [H("new", 4)])
    assert ready(index, blocks) == [True, False, False, False]  # blocks[0] is still leased
    assert index.get(writing.hash).state == WRITING and index.allocator.get(handoff.id) is handoff
    index.release(lease)
    put(index, [H("new", 5)])
    put(index, [H("new", 6)])
    assert ready(index, blocks) == [False] * 4
    st = index.stats()
    assert st["evictions_total"] == 7 and st["leases_expired_total"] == 1 and st["handoffs"] == 1
    check_consistent(index)


def test_commit_keeps_ancestors_more_recent_than_their_children():
    index, _ = make_index(blocks=5)
    a = chain("a", 3)
    put(index, a[:1])
    put(index, [H("other")])
    put(index, a)  # a[1], a[2] new; a[0] is their cached ancestor
    assert index.lru_order() == [H("other"), a[2], a[1], a[0]]
    index.lookup(a[:2], "r", 5)  # a lookup also leaves the head the most recent
    assert index.lru_order()[-2:] == [a[1], a[0]]


def test_making_room_for_a_chain_tail_never_evicts_its_cached_head():
    index, _ = make_index(blocks=3)
    a = chain("a", 5)
    put(index, a[:3])
    assert index.reserve(a, B, "w", 30) == []  # only the head could go; it stays
    assert ready(index, a[:3]) == [True] * 3
    put(index, [H("stranger")])  # someone else's put does evict the LRU block
    assert ready(index, a[:3]) == [True, True, False]


def test_handoff_evicts_the_coldest_contiguous_range():
    # 8 slots; handoffs pin slots 2 and 5, so a 2-slot handoff can only go to
    # [0,1], [3,4] or [6,7]. Plain LRU would evict slots 0, 3, 6 first and
    # still have no room.
    index, _ = make_index(blocks=8)
    slots = []
    for i in range(8):
        if i in (2, 5):
            slots.append(index.alloc_handoff(B, f"pin{i}", 60))
        else:
            slots.append(put(index, [H("s", i)])[0])
    assert [s.offset for s in slots] == [i * B for i in range(8)]
    for i in (3, 6, 0, 4, 7, 1):  # LRU order; the coldest pair [3,4] opens only at the 4th LRU eviction
        index.release(index.lookup([H("s", i)], "r", 5)[0])
    big = index.alloc_handoff(2 * B, "big", 60)
    assert big is not None and big.offset == 3 * B
    assert ready(index, [H("s", i) for i in (0, 1, 3, 4, 6, 7)]) == [True, True, False, False, True, True]
    assert index.stats()["evictions_total"] == 2
    # Leasing [0,1] and [6,7] leaves no contiguous room: nothing is evicted in vain.
    index.lookup([H("s", 0)], "r", 5)
    index.lookup([H("s", 7)], "r", 5)
    assert index.alloc_handoff(2 * B, "big2", 60) is None
    assert index.stats()["evictions_total"] == 2 and index.allocator.stats()["failed_total"] == 1
    assert index.alloc_handoff(9 * B, "huge", 60) is None
    check_consistent(index)


def test_handoff_window_counts_free_space_and_prefers_fewer_evictions():
    index, _ = make_index(blocks=6)
    s = [put(index, [H("s", i)])[0] for i in range(6)]
    for i in (1, 3, 4, 5):  # LRU order: s0, s2, s1, s3, s4, s5
        index.release(index.lookup([H("s", i)], "r", 5)[0])
    index._evict(s[0])  # slot 0 free
    # [0,1] and [1,2] both have s1 as their newest block; [0,1] evicts less.
    assert index.alloc_handoff(2 * B, "h", 60).offset == 0
    assert ready(index, [x.hash for x in s[1:]]) == [False, True, True, True, True]
    assert index.stats()["evictions_total"] == 2  # s0 by hand, then s1 only
    # A 2-slot handoff now: the range holding the globally coldest block, s2.
    assert index.alloc_handoff(2 * B, "h2", 60).offset == 2 * B
    assert ready(index, [x.hash for x in s[2:]]) == [False, False, True, True]
    check_consistent(index)


def test_reserve_takes_each_hash_once():
    index, _ = make_index()
    placed = index.reserve([H("x"), H("y"), H("x")], B, "w", 30)
    assert [e.hash for e in placed] == [H("x"), H("y")] and placed[1].parent == H("x")


def test_handoff_ids_and_owner_never_free_blocks():
    index, _ = make_index()
    blk = put(index, [H("b")])[0]
    h = index.alloc_handoff(100, "kv-block", 60)
    assert index.free_handoff(blk.alloc_id) is None
    assert [x.id for x in index.free_handoffs_of("kv-block")] == [h.id]
    assert index.free_handoffs_of("w") == [] and index.get(blk.hash).state == READY
    check_consistent(index)


def test_invalid_arguments_are_refused():
    index, _ = make_index()
    good = [H("g")]
    for bad in [None, b"x" * 32, [b"short"], ["str" * 11], [H("a"), 5], [b"x" * 65]]:
        with pytest.raises(ValueError):
            index.lookup(bad, "r", 5)
        with pytest.raises(ValueError):
            index.reserve(bad, B, "w", 5)
        with pytest.raises(ValueError):
            index.commit(bad)
    for bad_s in [0, -1, float("inf"), float("nan"), True, "5"]:
        with pytest.raises(ValueError):
            index.lookup(good, "r", bad_s)
        with pytest.raises(ValueError):
            index.reserve(good, B, "w", bad_s)
        with pytest.raises(ValueError):
            index.alloc_handoff(B, "w", bad_s)
    for bad_n in [0, -1, 1.5, True, "64"]:
        with pytest.raises(ValueError):
            index.reserve(good, bad_n, "w", 5)
        with pytest.raises(ValueError):
            index.alloc_handoff(bad_n, "w", 5)
    with pytest.raises(ValueError, match="larger than the whole cache arena"):
        index.reserve(good, 1 << 20, "w", 5)
    assert len(index) == 0 and index.stats()["lookups_total"] == 0


def test_random_operations_keep_every_promise():
    """Thousands of random calls: leased, writing and handoff space is never
    taken; lookups only ever return ready prefixes; bytes always add up."""
    for seed in range(3):
        rng = random.Random(seed)
        index, clock = make_index(blocks=24, extra=3 * ALIGNMENT)
        chains = [chain(f"c{i}", 6) for i in range(8)]
        leases: dict[int, list] = {}
        handoffs = []
        for step in range(1500):
            op = rng.random()
            c = rng.choice(chains)
            if op < 0.3:
                lease, got = index.lookup(c, "r", rng.choice([0.5, 5]))
                assert [e.hash for e in got] == c[:len(got)]
                assert all(e.state == READY for e in got)
                if lease >= 0:
                    leases[lease] = got
            elif op < 0.55:
                placed = index.reserve(c, rng.choice([B, B, 2 * B + 8]), "w", rng.choice([0.5, 30]))
                assert all(c.index(e.hash) >= 0 and e.state == WRITING for e in placed)
                if rng.random() < 0.8:
                    index.commit([e.hash for e in placed])
            elif op < 0.65 and leases:
                index.release(rng.choice(list(leases)))
            elif op < 0.72:
                got = index.alloc_handoff(rng.choice([100, B, 3 * B, 5 * B]), "req", 5)
                if got is not None:
                    handoffs.append(got)
            elif op < 0.78 and handoffs:
                index.free_handoff(handoffs.pop(rng.randrange(len(handoffs))).id)
            else:
                clock.now += rng.choice([0.1, 0.6])
                gone = index.expire()
                for lease in gone.leases:
                    leases.pop(lease.id, None)
                for alloc in gone.handoffs:
                    handoffs.remove(alloc)
            # What is held must still be there, untouched.
            live_leases = set(index._leases)
            for lease_id, got in list(leases.items()):
                if lease_id not in live_leases:
                    del leases[lease_id]
                    continue
                for e in got:
                    assert index.get(e.hash) is e and e.state == READY and e.leases > 0
            for h in handoffs:
                assert index.allocator.get(h.id) is h
            if step % 50 == 0:
                check_consistent(index)
        st = index.stats()
        assert st["evictions_total"] > 0 and st["lookup_hit_blocks_total"] > 0
        check_consistent(index)


# ------------------------------------------------------------ the disk tier --


def _block(seed: int, nbytes: int = B) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def _read(disk: DiskTier, h: bytes):
    size = disk.payload_size(h)
    if size is None:
        return None
    dest = bytearray(size)
    return bytes(dest) if disk.read_into(h, memoryview(dest)) else None


@pytest.fixture
def disks(tmp_path):
    """disks(capacity) -> a DiskTier on tmp_path/kv; all closed at the end."""
    made = []

    def make(capacity=1 << 20, **kw):
        d = DiskTier(str(tmp_path / "kv"), capacity, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close(0.5)


def test_disk_round_trip_format_and_rescan(disks):
    disk = disks()
    blocks = {H("d", i): _block(i, B * (i + 1)) for i in range(3)}  # sizes differ: several models
    for h, data in blocks.items():
        assert disk.write(h, data)
    raw = open(disk.path(H("d", 0)), "rb").read()
    magic, version, length, digest = HEADER.unpack(raw[:HEADER.size])
    assert (magic, version, length) == (MAGIC, FORMAT_VERSION, B)
    assert digest == hashlib.sha256(blocks[H("d", 0)]).digest() and raw[HEADER.size:] == blocks[H("d", 0)]
    assert os.path.basename(os.path.dirname(disk.path(H("d", 0)))) == H("d", 0).hex()[:2]
    for h, data in blocks.items():
        assert _read(disk, h) == data
    st = disk.stats()
    assert st["disk_blocks"] == 3 and st["disk_bytes"] == 3 * HEADER.size + 6 * B and st["disk_hits_total"] == 3
    assert _read(disk, H("absent")) is None and disk.stats()["disk_corrupt_total"] == 0
    disk.close()
    again = disks()  # a restarted service
    assert again.stats()["disk_blocks"] == 3 and again.stats()["disk_bytes"] == st["disk_bytes"]
    assert _read(again, H("d", 2)) == blocks[H("d", 2)]


def _corruptions():
    good = HEADER.pack(MAGIC, FORMAT_VERSION, B, hashlib.sha256(_block(1)).digest()) + _block(1)
    flipped = bytearray(good)
    flipped[HEADER.size + 100] ^= 0x01
    return {
        "flipped payload byte": bytes(flipped),
        "truncated payload": good[:-10],
        "truncated header": good[:20],
        "bad magic": b"NOTAKVB\x00" + good[8:],
        "unknown version": good[:8] + (FORMAT_VERSION + 1).to_bytes(4, "little") + good[12:],
        "header length disagrees": HEADER.pack(MAGIC, FORMAT_VERSION, B - 64, hashlib.sha256(_block(1)).digest())
                                   + _block(1),
        "trailing bytes": good + b"x",
        "empty": b"",
    }


@pytest.mark.parametrize("kind", list(_corruptions()))
def test_disk_corrupt_files_are_deleted_counted_and_missed(disks, kind):
    h = H("corrupt")
    disk = disks()
    disk.write(h, _block(1))
    with open(disk.path(h), "wb") as f:
        f.write(_corruptions()[kind])
    disk = disks()  # rescan: the index sees the file as it is now
    assert _read(disk, h) is None
    assert not os.path.exists(disk.path(h))
    st = disk.stats()
    assert st["disk_corrupt_total"] == 1 and st["disk_blocks"] == 0 and st["disk_bytes"] == 0
    assert st["disk_hits_total"] == 0


def test_disk_file_changed_after_start_is_caught_on_read(disks):
    disk = disks()
    h = H("late")
    disk.write(h, _block(2))
    with open(disk.path(h), "r+b") as f:  # truncated behind the index's back
        f.truncate(HEADER.size + B // 2)
    dest = memoryview(bytearray(B))
    assert not disk.read_into(h, dest) and disk.stats()["disk_corrupt_total"] == 1
    assert not os.path.exists(disk.path(h))
    # Deleted behind its back (another service evicted it): a plain miss.
    disk.write(h, _block(2))
    os.unlink(disk.path(h))
    assert not disk.read_into(h, dest)
    st = disk.stats()
    assert st["disk_corrupt_total"] == 1 and st["disk_blocks"] == 0


def test_disk_limit_evicts_least_recently_used_files(disks, tmp_path):
    file_bytes = HEADER.size + B
    disk = disks(capacity=3 * file_bytes)
    hs = [H("lru", i) for i in range(5)]
    for h in hs[:3]:
        disk.write(h, _block(0))
    assert _read(disk, hs[0]) is not None  # used: now the most recent
    assert disk.wait_idle(5)  # touches are queued with the writes
    disk.write(hs[3], _block(3))
    assert [h in disk for h in hs] == [True, False, True, True, False]
    disk.write(hs[4], _block(4))
    assert [h in disk for h in hs] == [True, False, False, True, True]
    assert not os.path.exists(disk.path(hs[1])) and not os.path.exists(disk.path(hs[2]))
    assert disk.stats()["disk_evictions_total"] == 2 and disk.stats()["disk_bytes"] == 3 * file_bytes
    assert not disk.write(H("huge"), bytes(4 * file_bytes))  # never fits: not written
    # Recency survives a restart through the files' mtimes; a lower limit trims the oldest.
    for age, h in enumerate([hs[3], hs[0], hs[4]]):
        os.utime(disk.path(h), (1000 + age, 1000 + age))
    disk.close()
    small = disks(capacity=2 * file_bytes)
    assert [h in small for h in (hs[3], hs[0], hs[4])] == [False, True, True]
    assert small.stats()["disk_evictions_total"] == 1 and not os.path.exists(small.path(hs[3]))


def test_disk_startup_skips_foreign_files_and_clears_stale_temp_files(disks, tmp_path):
    disk = disks()
    disk.write(H("keep"), _block(5))
    folder = os.path.dirname(disk.path(H("keep")))
    stale, fresh = os.path.join(folder, "x.kvb.1.2.tmp"), os.path.join(folder, "y.kvb.1.2.tmp")
    for path in (stale, fresh, os.path.join(folder, "notes.txt"), str(tmp_path / "kv" / "README")):
        open(path, "wb").write(b"junk")
    os.utime(stale, (time.time() - 3600,) * 2)
    disk.close()
    again = disks()
    assert again.stats()["disk_blocks"] == 1
    assert not os.path.exists(stale) and os.path.exists(fresh)  # a younger one may be another writer's


def test_disk_writer_queue_drops_when_full_and_flushes_on_close(disks):
    disk = disks(queue_bytes=2 * B)
    data = [bytearray(_block(i)) for i in range(40)]
    accepted = [disk.submit(H("q", i), memoryview(d)) for i, d in enumerate(data)]
    assert accepted[0] and not all(accepted)  # the writer cannot keep up with 40 at once
    assert disk.wait_idle(10)
    dropped = accepted.count(False)
    assert disk.stats()["disk_writes_dropped_total"] == dropped
    assert sorted(disk.finished()) == sorted(H("q", i) for i, ok in enumerate(accepted) if ok)
    assert disk.stats()["disk_blocks"] == 40 - dropped
    late = disks(queue_bytes=8 * B)
    for i in range(5):
        assert late.submit(H("late", i), memoryview(bytearray(_block(i))))
    late.close(5)  # flushes what was queued
    assert not late.submit(H("after"), memoryview(bytearray(B)))
    assert disks().stats()["disk_blocks"] == 40 - dropped + 5


# ----------------------------------------------------------- the block store --


@pytest.fixture
def arena():
    a = Arena.create(new_arena_name("tbs"), 8 * B)
    yield a
    a.close()
    a.unlink()


def _store(arena, disk=None):
    clock = Clock()
    index = BlockIndex(Allocator(arena.size, clock=clock), clock=clock)
    return BlockStore(arena, index, disk), clock


def _fill(store, hashes, seed=0):
    placed = store.reserve(hashes, B, "w", 30)
    for i, e in enumerate(placed):
        store.arena.view(e.offset, B)[:] = _block(seed + i)
    return store.commit([e.hash for e in placed])


def test_store_writes_through_pinned_and_promotes_from_disk(arena, disks):
    disk = disks()
    store, _ = _store(arena, disk)
    a = chain("a", 3)
    done = _fill(store, a, seed=10)
    assert [e.pins for e in done] == [1, 1, 1]  # pinned until copied
    assert disk.wait_idle(5)
    store.collect_disk_writes()
    assert [e.pins for e in done] == [0, 0, 0] and disk.stats()["disk_blocks"] == 3
    # Push the chain out of memory with other blocks.
    _fill(store, chain("other", 8), seed=50)
    assert all(store.index.get(h) is None for h in a)
    assert disk.wait_idle(5)  # until then the new blocks are pinned: nothing to evict for promotion
    lease, got = store.lookup(a, "r", 5)
    assert [e.hash for e in got] == a and lease >= 0
    for i, e in enumerate(got):
        assert bytes(store.arena.view(e.offset, B)) == _block(10 + i)
    st = store.stats()
    assert st["disk_hits_total"] == 3 and st["lookup_hit_blocks_total"] == 3 and st["disk_writes_total"] == 3 + 8
    disk.wait_idle(5)
    assert store.stats()["disk_writes_total"] == 3 + 8  # promoted blocks are not written again


def test_store_keeps_a_chains_head_when_the_disk_queue_is_short(arena, disks):
    """A commit of more blocks than the writer's queue takes (a long prompt in
    small blocks) writes the ones nearest the head: a restarted service can
    serve that part of the prompt. (Writing the tail first, as the order of
    recency has it, once dropped the head: nothing served after a restart.)"""
    disk = disks(queue_bytes=3 * B)
    store, _ = _store(arena, disk)
    disk._stop.set()  # a writer that cannot keep up: nothing leaves the queue yet
    disk._writer.join(2)
    a = chain("a", 6)
    done = _fill(store, a, seed=20)
    assert len(done) == 6 and disk.room_bytes() == 0
    assert [e.pins for e in done] == [1, 1, 1, 0, 0, 0]
    assert store.stats()["disk_writes_dropped_total"] == 3
    disk._stop.clear()
    disk._writer = threading.Thread(target=disk._write_loop, daemon=True)
    disk._writer.start()
    assert disk.wait_idle(5)
    again = disks(queue_bytes=3 * B)  # a restart: the index rebuilt from the files
    bare, _ = _store(arena, again)
    _fill(bare, chain("other", 8), seed=50)  # the arena holds none of `a` now
    assert all(bare.index.get(h) is None for h in a)
    assert again.wait_idle(5)
    lease, got = bare.lookup(a, "r", 5)
    assert [e.hash for e in got] == a[:3]
    assert [bytes(bare.arena.view(e.offset, B)) for e in got] == [_block(20 + i) for i in range(3)]


def test_saver_defers_disk_writes_until_allowed_then_writes_what_is_still_in_memory(arena, disks):
    """The power policy's saver: committed blocks are not written (the SSD
    and a core rest on battery); once writes are allowed again those still in
    memory are written; one evicted meanwhile is gone from both tiers."""
    disk = disks()
    store, _ = _store(arena, disk)
    store.defer_writes = True
    a = _fill(store, chain("a", 3), seed=30)
    assert [e.pins for e in a] == [0, 0, 0]  # nothing queued, nothing pinned: all evictable
    assert disk.wait_idle(5) and disk.stats()["disk_blocks"] == 0
    assert store.stats()["disk_writes_deferred"] == 3
    assert store.flush_deferred() == 0  # still deferred
    _fill(store, chain("b", 6), seed=40)  # 9 blocks for an 8-block arena: a's oldest goes
    store.defer_writes = False
    assert store.flush_deferred() == 8
    assert disk.wait_idle(5)
    store.collect_disk_writes()
    assert disk.stats()["disk_blocks"] == 8 and store.stats()["disk_writes_deferred"] == 0
    on_disk = [_read(disk, h) for h in chain("a", 3)]
    assert on_disk.count(None) == 1  # the one evicted while deferred
    assert all(got == _block(30 + i) for i, got in enumerate(on_disk) if got is not None)


def test_store_corrupt_disk_block_is_a_miss_and_frees_its_slot(arena, disks):
    disk = disks()
    store, _ = _store(arena, disk)
    a = chain("a", 3)
    for i, h in enumerate(a):
        disk.write(h, _block(i))
    with open(disk.path(a[1]), "r+b") as f:
        f.seek(HEADER.size + 7)
        f.write(b"\xff\x00")
    lease, got = store.lookup(a, "r", 5)
    assert [e.hash for e in got] == a[:1]  # stops at the corrupt block: never served
    st = store.stats()
    assert st["disk_corrupt_total"] == 1 and st["blocks"] == 1 and st["writing_blocks"] == 0
    assert st["lookup_miss_total"] == 1 and not os.path.exists(disk.path(a[1]))


def test_store_without_room_or_disk_tier_just_misses(arena, disks):
    disk = disks()
    store, _ = _store(arena, disk)
    disk.write(H("ondisk"), _block(1))
    held = store.index.alloc_handoff(8 * B, "req", 60)  # the whole arena
    assert held is not None
    assert store.lookup([H("ondisk")], "r", 5) == (-1, [])
    assert H("ondisk") in disk and store.stats()["disk_hits_total"] == 0
    bare, _ = _store(arena)
    assert bare.lookup([H("ondisk")], "r", 5) == (-1, [])
    assert bare.stats()["disk_blocks"] == 0
