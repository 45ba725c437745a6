"""A worker's store thread: new blocks go into the prefix cache off the MLX
thread.

After a prefill the worker copies the prompt's KV tail into the arena (the
handoff) and stores the prompt's new full blocks from that host copy: a
rearranging copy into reserved blocks and a commit (on an H100 swarm ~13 of a
prefill's ~75 ms). That copy must end before the handoff is sent (a decode
worker frees the tail once it has read it), but nothing else waits on it: the
first token is already out, and the MLX thread's hot tier holds the new blocks,
so the worker's next prompt finds them even before the commit lands. So the
MLX thread reserves and hands the write, the commit and then the handoff to
this thread, and starts the next prompt.

A GPU decode worker does the same with a finished conversation's blocks
(workers/decode/engine.py): reading them off the device through CUDA's managed
memory (~14 ms a request on an H100 swarm) and the commit, after which the
thread sends the request's last token. So does a colocated prefill (the KV
stays in the process, so there is no host copy of a tail): its new blocks'
device copies are evaluated on the MLX thread and read here (~29 ms a
prompt of the MLX thread's on an H100 swarm before), and nothing is sent.
Both go through PrefixCache.detach: the hot tier takes the blocks on the
MLX thread, which keeps the arrays the host views read (`keep`).

The copy of a handoff's tail into the arena (arena_io.stage_arrays'
`copy`) comes here too, when given: the host reading the KV off a GPU page by
page is most of a handoff's cost (~5 of 7 ms a prompt on an H100 swarm). It
runs first in its job: the store reads the tail from the arena, and the
handoff must not leave before the tail is there.

Jobs run one at a time in order, so messages leave in the order their jobs
were submitted. Every job ends by sending its message, whether the store
worked or not (a store is an optimisation), except when its tail copy
failed: then its `failed` message goes instead (the handoff would name KV
that is not there). Closing runs what is queued, within a deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)


@dataclass
class PreparedStore:
    """A block store between PrefixCache.prepare_store and finish_store, or
    a store thread's write_store."""

    owner: str
    hashes: List[bytes]  # every full block of the tokens
    started: float  # perf_counter at prepare (the log's store time)
    arena: str = ""
    todo: list = field(default_factory=list)  # [(block index, reserved ref)] to write, in index order
    first: int = 0  # the block index `hot` counts from
    blocks_first: int = 0  # the block index `blocks` counts from
    blocks: list = field(default_factory=list)  # blocks.blocks_for_write's, or host copies
    hot: list = field(default_factory=list)  # [(hash, (keys, values))] for the hot tier
    kept: list = field(default_factory=list)  # MLX arrays `blocks` (host views) read, once detached
    tail: Optional[tuple] = None  # (reserved ref, blocks_for_write's arrays) of a tail block to write

    def arrays(self) -> list:
        """What to evaluate before finish_store."""
        return ([a for a in self.blocks + self.tail_arrays() if isinstance(a, mx.array)]
                + [kv for _, block in self.hot for kv in block])

    def tail_arrays(self) -> list:
        return list(self.tail[1]) if self.tail is not None else []

    def host_only(self) -> bool:
        """The blocks to write are host copies: writing them needs no MLX."""
        return all(isinstance(a, np.ndarray) for a in self.blocks + self.tail_arrays())


class StoreThread:
    """Runs `copy()`, `prefix.write_store(prepared, client)` then
    `send(message)` for each submitted job, on a thread of its own with its
    own cache client."""

    def __init__(self, prefix, client, send: Callable[[object], None]):
        self.prefix = prefix
        self.client = client  # a CacheClient used by this thread only
        self.send = send  # thread-safe (workers.socket_loop.Outbox)
        self._jobs: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._submitted = 0
        self.finished = 0  # jobs done: submit's tickets up to this one
        # (ticket, MLX arrays a job reads through host views): held by the
        # submitting (MLX) thread until the job is done, dropped there.
        self.kept: deque = deque()
        self._thread = threading.Thread(target=self._run, name="prefix-store", daemon=True)
        self._thread.start()

    def submit(self, prepared, message=None, copy=None, failed=None, keep=()) -> None:
        """Queue a job (`prepared`: the store, None for none; `message`: sent
        once the blocks are committed, or not at all when None; `copy`: run
        first, and if it raises, `failed` is sent instead and nothing is
        stored). `keep`: the MLX arrays the job reads through host views,
        kept alive here until it is done (see release_done)."""
        self._submitted += 1
        if keep:
            self.kept.append((self._submitted, keep))
        self._jobs.put((prepared, message, copy, failed))

    def release_done(self) -> None:
        """Drop the arrays of finished jobs. Call it on the thread that
        submits (the MLX thread), so that MLX frees them there."""
        while self.kept and self.kept[0][0] <= self.finished:
            self.kept.popleft()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            prepared, message, copy, failed = job
            del job
            if copy is not None:
                try:
                    copy()
                except Exception:  # noqa: BLE001 - the request fails, the thread goes on
                    log.exception("handoff copy failed")
                    prepared, message = None, failed
                del copy
            try:
                if prepared is not None:
                    self.prefix.write_store(prepared, client=self.client)
            except Exception:  # noqa: BLE001 - a store is an optimisation; the message goes all the same
                log.exception("prefix store for %s failed", getattr(prepared, "owner", "?"))
            del prepared  # before `finished` moves: the submitter may then free what it read
            try:
                if message is not None:
                    self.send(message)
            except Exception:  # noqa: BLE001 - the router's deadline fails the request
                log.exception("%s could not be sent", type(message).__name__)
            self.finished += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish the queued jobs (their handoffs go out), then stop. Call it
        while the socket loop still runs; calling it again does nothing."""
        if not self._thread.is_alive():
            return
        self._jobs.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("prefix store thread still busy after %.1f s; leaving it", timeout_s)
            return  # its client is still in use there
        self.client.close()
