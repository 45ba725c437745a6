"""An ended request's KV into the prefix cache, committed behind the step in flight.

When a request ends (stop, length, or cancel) its KV goes back to the shared
cache, block by block, so the next turn of the conversation reuses everything
up to its new message. The KV then holds the prompt, the first token and
every generated token including the last one: mlx-lm feeds each token through
the model in the same step that returns it (it computes the next token's
logits ahead), and its `all_tokens` / `GenerationBatch.tokens` list is kept
equal to the tokens in the cache. Those tokens' full blocks are committed (the
cache service skips the ones it has: the prompt's, stored by prefill), and the
tokens after the last full one as a tail block (workers/kv/block_hash.py), so
that the next turn computes only its new message, as in one process.

A commit never leaves the GPU waiting on the host. When a request ends, its
blocks are reserved and laid out as device copies (PrefixCache.prepare_store)
that are computed behind the step in flight; the batch finishes them just
before it queues its next step (`DecodeBatch.barrier`, with the rows a leave
moved), then writes them to the arena and commits them while that step runs
(`DecodeBatch.on_queued` -> `commit`). Only then is the request's last token
returned: a client (an agent) sends its next turn the moment it has the
answer, and that turn must find the answer's blocks. The last token thus
comes one step's queueing later than the others', and no other row waits for
a host copy or a round trip to the cache service. On a GPU (`stores`, a
workers.kv.store_thread.StoreThread) even that host work leaves the MLX
thread: reading the blocks off the device is page by page through CUDA's
managed memory (~14 ms a request on an H100), so the store thread copies and
commits them, then sends the last token itself.

Only block caches take a finished conversation: a snapshot cache's state at
the end of an answer sits at no block boundary, and neither a window nor a
recurrent state can be rolled back to one (the next turn still reuses the
previous turn's prompt snapshot).
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import mlx.core as mx

from protos.messages import TokenBatch, TokenUpdate
from workers.kv.store_thread import PreparedStore
from workers.loop_clock import part

log = logging.getLogger(__name__)


class EndedCommits:
    """The decode batch's ended requests whose blocks are on their way to
    `prefix` (a workers.kv.prefix_cache.PrefixCache), and the last updates
    held until they are written."""

    def __init__(self, prefix, batch):
        self.prefix = prefix
        self.batch = batch  # the engine's DecodeBatch: its barrier, its clock
        # Ended requests whose blocks are prepared and not yet written, with
        # the last update to return once they are (None: a cancel).
        self._pending: List[Tuple[PreparedStore, Optional[TokenUpdate]]] = []
        self._written: List[TokenUpdate] = []  # last updates whose blocks are written
        # A StoreThread that writes, commits and sends the last updates (set
        # by the worker on a GPU); it keeps the device copies it reads until
        # the worker's loop frees them (StoreThread.release_done).
        self.stores = None

    @property
    def busy(self) -> bool:
        """Blocks still to commit, or last updates still to return."""
        return bool(self._pending or self._written)

    def prepare(self, request_id: str, salt: str, tokens: List[int], cache: list,
                update: Optional[TokenUpdate]) -> bool:
        """Reserve an ended request's blocks and queue their device copies
        behind the step in flight; the batch finishes them before it queues
        its next step, once nothing reads its buffers (they are written in
        place again). False when there is nothing to commit."""
        held = cache[0].offset if cache else 0
        if len(tokens) != held:  # never hash tokens the KV does not hold
            log.warning("request %s: %d tokens for %d cached positions; not committing its KV",
                        request_id, len(tokens), held)
            return False
        with part(self.batch.clock, "prepare commit"):
            prepared = self.prefix.prepare_store(list(tokens), cache, request_id, tail=True,  # never raises
                                                 salt=salt)
        if prepared is None:
            return False
        arrays = prepared.arrays()
        if arrays:
            mx.async_eval(arrays)
            self.batch.barrier = self.batch.barrier + arrays
        self._pending.append((prepared, update))
        return True

    def commit(self) -> int:
        """Write and commit the prepared blocks (their copies are computed by
        now in a decode loop, else waited for here). Their last updates come
        out of `take`. Returns the blocks written."""
        if not self._pending:
            return 0
        pending, self._pending = self._pending, []
        t0, blocks = time.perf_counter(), 0
        with part(self.batch.clock, "commit"):
            mx.eval([a for prepared, _ in pending for a in prepared.arrays()])
            if self.stores is not None:
                for prepared, update in pending:
                    self._hand_to_stores(prepared, update)
                return 0
            for prepared, update in pending:
                blocks += self.prefix.finish_store(prepared)  # never raises: failures are logged
                if update is not None:
                    self._written.append(update)
        log.debug("decode prefix commit: %d requests, %d new blocks (%d bytes) in %.2f ms", len(pending),
                  blocks, blocks * self.prefix.layout.block_nbytes, (time.perf_counter() - t0) * 1000)
        return blocks

    def _hand_to_stores(self, prepared: PreparedStore, update: Optional[TokenUpdate]) -> None:
        """commit's host work, to the store thread: the hot tier takes the
        blocks here, the thread reads host views of the device copies."""
        self.prefix.detach(prepared)
        self.stores.submit(prepared, TokenBatch([update]) if update is not None else None, keep=prepared.kept)

    def take(self) -> List[TokenUpdate]:
        """The last updates whose blocks are written, once each."""
        done, self._written = self._written, []
        return done

    def abandon(self) -> List[TokenUpdate]:
        """The last updates held, now, their commits dropped (after a failed
        step: the batch is suspect)."""
        held = [u for _, u in self._pending if u is not None] + self._written
        self._pending, self._written = [], []
        self.batch.barrier = []
        return held
