"""Block keys of a worker group's ranks (workers/kv/block_hash.py shard_extra):
each rank's shard of a block under its own key, a worker alone's keys as
they always were."""

from __future__ import annotations

import itertools

import pytest

from workers.kv.block_hash import BlockHasher, Shard, block_extra, shard_extra
from workers.kv.snapshot_cache import snapshot_key

TOKENS = list(range(100, 118))  # 4 full blocks of 4, and 2 tokens for a tail
EXTRA = block_extra(b"f" * 32, "float32", 4)


def keys_of(hasher: BlockHasher) -> list[bytes]:
    """Every kind of key a prompt gets: its blocks, a tail, a salted chain's, a snapshot's."""
    blocks = hasher.hashes(TOKENS)
    return [*blocks, hasher.tail_key(blocks[-1], TOKENS[16:]), *hasher.hashes(TOKENS, salt="tenant"),
            snapshot_key(blocks[-1])]


def test_a_worker_alone_keeps_its_keys_byte_for_byte():
    """Pinned from before groups had a prefix cache: a disk tier written then
    is still found, and a worker alone pays nothing for groups."""
    hasher = BlockHasher(EXTRA, 4)
    blocks = hasher.hashes(TOKENS)
    assert blocks[0].hex() == "8abcb5b8ca72de6bcf70d69ffde0128cc677a307e18c7ba957ca199ad921fe8d"
    assert blocks[-1].hex() == "5f68df9f1da8cb9f2d2952fc2246301e4cdb5cb0386663376eda21c0c5fecf3d"
    assert hasher.tail_key(blocks[-1], TOKENS[16:]).hex() == (
        "06c9d9a10875c7c70cf0b66b3c29b6b452d9e192792646843854b355a3649b8e")
    assert hasher.hashes(TOKENS, salt="tenant")[-1].hex() == (
        "4beb278c2d660e96ce530edec95d464f4600b8111bed7a82d3fea880d7dc36c5")
    # A "group" of one holds the whole KV: the same keys.
    assert shard_extra(EXTRA, 0, 1) == EXTRA and keys_of(hasher.for_shard(Shard(0, 1))) == keys_of(hasher)


def test_each_rank_of_each_group_has_keys_of_its_own():
    alone = BlockHasher(EXTRA, 4)
    shards = [alone.for_shard(Shard(rank, size, split)) for split in ("tensor", "pipeline")
              for size in (2, 4) for rank in range(size)]
    every = [keys_of(h) for h in [alone, *shards]]
    for a, b in itertools.combinations(every, 2):
        assert not set(a) & set(b)  # no key of one is a key of another: no rank reads another's shard
    # A rank's keys chain and are stable as a worker alone's do.
    again = alone.for_shard(Shard(1, 2))
    assert keys_of(again) == keys_of(alone.for_shard(Shard(1, 2))) and again.block_size == 4
    assert again.hashes(TOKENS, 2) == again.hashes(TOKENS)[:2]


def test_a_rank_outside_its_group_is_refused():
    for rank, size, split in ((2, 2, "tensor"), (-1, 2, "tensor"), (0, 2, "diagonal")):
        with pytest.raises(ValueError):
            shard_extra(EXTRA, rank, size, split)


def test_a_ranks_prefix_cache_is_made_keyed_by_its_shard(model, tiny_dir):
    """make_prefix_cache(shard=...) is how a group's rank gets its cache
    (workers/parts.py): keyed by its share from the start, nothing rewritten
    after; without a shard, a worker alone's keys."""
    from tests.support.cache_fakes import FakeCacheService
    from workers.kv.prefix_cache import make_prefix_cache

    fake = FakeCacheService()
    alone = make_prefix_cache(model, str(tiny_dir), 4, fake, fake.buffer)
    ranks = [make_prefix_cache(model, str(tiny_dir), 4, fake, fake.buffer, shard=Shard(r, 2)) for r in (0, 1)]
    keys = [p.hasher.hashes(list(range(8))) for p in (alone, *ranks)]
    assert len({tuple(k) for k in keys}) == 3
    assert ranks[1].hasher.extra == shard_extra(alone.hasher.extra, 1, 2)
