"""A model worker under memory pressure gives back what it only keeps for speed.

While environment/memory_pressure.py reads warn or critical (for UNLOAD_FIRST_S
already: the router unloads idle models first), at every reading
(every `Settings.memory_poll_s`) the worker drops its hot KV tier (copies of
arena blocks, workers/kv/hot_blocks.py: the arena and the disk tier still have
them) and MLX's cache of freed buffers (`mx.clear_cache`). Both refill as
requests run, so a worker that stays pressed keeps dropping them; nothing a
request in flight holds is touched.

MLX thread only: `relieve_memory` is called after every pass of the
worker's loop (workers/parts.py `WorkerParts.relieve`). MLX's buffer cache
is per process, so is the one `MemoryRelief` here.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import mlx.core as mx

from environment.memory_pressure import UNLOAD_FIRST_S, PressurePoll, PressureReader

log = logging.getLogger(__name__)


class MemoryRelief:
    def __init__(self, poll: PressurePoll, clear_cache: Callable[[], None] = mx.clear_cache,
                 cache_memory: Callable[[], int] = mx.get_cache_memory):
        self.poll = poll
        self._clear_cache = clear_cache
        self._cache_memory = cache_memory
        self.freed_bytes_total = 0  # since start

    def tick(self, prefix, hello) -> int:
        """Read the level when due and, under pressure, drop the caches of
        `prefix` (a workers.kv.prefix_base.PrefixCacheBase, or None) and MLX.
        Reports on `hello` (protos.messages.WorkerHello). Bytes freed."""
        if not self.poll.due():
            return 0
        previous = self.poll.last.level
        reading = self.poll.read()
        hello.memory_pressure = reading.value
        if reading.level != previous:
            log.warning("memory pressure %s -> %s (%s)", previous, reading.level, reading.detail or reading.error)
        if not self.poll.acting():  # normal, or pressed for less than UNLOAD_FIRST_S: idle models go first
            return 0
        hot = prefix.hot.drop() if prefix is not None else 0
        buffers = self._cache_memory()
        self._clear_cache()
        self.freed_bytes_total += hot + buffers
        hello.memory_freed_bytes = self.freed_bytes_total
        if hot + buffers:
            log.warning("memory pressure %s: dropped %.1f MiB of hot KV blocks and %.1f MiB of MLX's freed buffers",
                        reading.level, hot / 2**20, buffers / 2**20)
        return hot + buffers


_relief: Optional[MemoryRelief] = None


def relieve_memory(settings, prefix, hello) -> None:
    """The worker loop's hook (cheap when no reading is due): this process's
    MemoryRelief, made at the first call from `settings`."""
    global _relief
    if _relief is None:
        poll = PressurePoll(PressureReader(settings.memory_pressure_file), settings.memory_poll_s, time.monotonic,
                            grace_s=UNLOAD_FIRST_S)
        _relief = MemoryRelief(poll)
    _relief.tick(prefix, hello)
