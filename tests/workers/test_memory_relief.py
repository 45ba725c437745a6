"""A model worker under memory pressure (workers/memory_relief.py) drops its
hot KV tier and MLX's freed buffers, and says so in its heartbeat.

The level comes from a file: a double for PSI or macOS readings. MLX's
cache calls are seams here, so the test sees what would be freed."""

from __future__ import annotations

import mlx.core as mx

from environment.memory_pressure import PressurePoll, PressureReader
from protos.messages import WorkerHello
from workers.kv.hot_blocks import HotBlocks

BLOCK = 2 * 4 * 4 * 8 * 4  # keys: (layers 2, heads 4, 4 tokens, dim 8) float32


class Prefix:
    def __init__(self, hot):
        self.hot = hot


def hot_with(n: int) -> HotBlocks:
    hot = HotBlocks(1 << 20, 2 * BLOCK)
    for i in range(n):
        hot.put(bytes([i]) * 32, mx.zeros((2, 4, 4, 8)), mx.zeros((2, 4, 4, 8)))
    return hot


def test_hot_tier_drop_lets_go_of_every_block_and_says_how_much():
    hot = hot_with(5)
    assert hot.drop() == 5 * 2 * BLOCK
    assert len(hot) == 0 and hot.nbytes == 0 and hot.evictions == 5
    assert hot.drop() == 0
    hot.put(b"x" * 32, mx.zeros((2, 4, 4, 8)), mx.zeros((2, 4, 4, 8)))  # refills afterwards
    assert len(hot) == 1


def test_relief_drops_caches_only_under_pressure(tmp_path):
    from workers.memory_relief import MemoryRelief

    level = tmp_path / "pressure"
    level.write_text("normal")
    now = [0.0]
    cleared = []
    relief = MemoryRelief(PressurePoll(PressureReader(str(level)), 2.0, lambda: now[0]),
                          clear_cache=lambda: cleared.append(True), cache_memory=lambda: 3 << 20)
    hello = WorkerHello(worker_id="w", roles=["prefill"], pid=1, state="ready")
    prefix = Prefix(hot_with(4))

    assert relief.tick(prefix, hello) == 0  # normal: nothing dropped
    assert len(prefix.hot) == 4 and not cleared and hello.memory_pressure == 0

    level.write_text("warn")
    now[0] = 1.0
    assert relief.tick(prefix, hello) == 0  # not due yet
    now[0] = 2.0
    freed = relief.tick(prefix, hello)
    assert freed == 4 * 2 * BLOCK + (3 << 20)
    assert len(prefix.hot) == 0 and cleared == [True]
    assert hello.memory_pressure == 1 and hello.memory_freed_bytes == freed

    level.write_text("critical")
    now[0] = 4.0
    assert relief.tick(None, hello) == 3 << 20  # no prefix cache: MLX's buffers still go
    assert hello.memory_pressure == 2 and hello.memory_freed_bytes == freed + (3 << 20)

    level.write_text("normal")
    now[0] = 6.0
    relief.tick(prefix, hello)
    assert hello.memory_pressure == 0 and hello.memory_freed_bytes == freed + (3 << 20)  # a running total
