"""The prefix-cache block layout in the arena (workers/kv/blocks.py): both
copy paths write the same bytes and read them back exactly."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from tests.support.cache_fakes import FakeCacheService
from tests.support.prefix import filled_kv
from workers.kv.blocks import (
    KVLayout,
    block_nbytes,
    kv_layout,
    probe_kv_layout,
    read_blocks,
    unblockable_reason,
    write_blocks,
)
from workers.kv.prefix_cache import make_prefix_cache

BS = 8  # small blocks: short prompts span several


# ------------------------------------------------------------- block layout --
@pytest.fixture(params=["host", "device"])
def copy_path(request, monkeypatch):
    """Both ways blocks are rearranged: with numpy on the host (MLX's CPU
    backend) and with MLX ops (a GPU); they must write the same bytes."""
    from workers.kv import arena_io

    monkeypatch.setattr(arena_io, "rearrange_on_host", lambda: request.param == "host")
    return request.param


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_blocks_roundtrip_exact(dtype, copy_path):
    cache = filled_kv(dtype, 45, 0)
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

    cache = filled_kv(dtype, 40, 3)
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
    cache = filled_kv(mx.float16, 20, 1, layers=1) + filled_kv(mx.float16, 20, 2, layers=1, heads=4, dk=8, dv=32)
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
    # Such a model gets snapshots instead (tests/workers/kv/test_snapshot_cache.py); one
    # that cannot even be probed (this fake has no forward pass) runs uncached.
    with caplog.at_level(logging.INFO, logger="workers.kv"):
        assert make_prefix_cache(SlidingModel(), ".", BS, FakeCacheService(), None) is None
    assert "prefix caching off" in caplog.text and "layer 1 is RotatingKVCache" in caplog.text
