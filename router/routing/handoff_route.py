"""The way a prompt's KV takes from its prefill worker to its decode worker.

Three ways (protos/messages.py KVHandoff):
- kept in the process: a worker that decodes what it prefills (colocated,
  here or on a remote host) keeps the KV (`KVHandoff.local`);
- through the arena: a decode worker of the same `kv_host` reads it from the
  shared memory both see, after the blocks held for it by reference;
- by value: the prefill worker's host has no ready decode worker (a remote
  `tandem worker --role prefill` whose router decodes here, or this host's
  prefill worker while the only decoders are remote), so the router asks for
  the KV in the message itself (`PrefillRequest.kv_by_value`), and the
  handoff, its bytes in one zero-copy frame, goes on to a decode worker on
  any host. Never across hosts by reference: no arena spans hosts.
  A worker group's (split layout) goes through the arena alone, rank by
  rank, to a decode group of the same split (workers/group/handoff_shards.py).

The choice is made when the prompt goes to its prefill worker and the
decode worker is picked when its KV is ready: a decode worker that came up
meanwhile on the prefill worker's host takes a by-value handoff all the
same, and a by-reference one whose host's decoders all went is prefilled
again (router/routing/dispatcher.py).
"""

from __future__ import annotations

import asyncio
from typing import Optional

from cache_service.client import CacheUnavailable
from protos.messages import KVHandoff
from router.metrics import Metrics
from router.routing.worker_table import WorkerState, WorkerTable


class HandoffRoute:
    """Decides a prompt's handoff way and decode worker, counts it in the
    metrics, and gives back what no decode worker will take. `tasks`: the
    dispatcher's set of background tasks (its stop cancels them); `cache`
    (an AsyncCacheClient) is set once the dispatcher starts."""

    def __init__(self, table: WorkerTable, metrics: Metrics, tasks: set):
        self.table = table
        self.metrics = metrics
        self.tasks = tasks
        self.cache = None

    def by_value(self, prefill: WorkerState) -> bool:
        """Whether `prefill` must send a prompt's KV by value: it does not
        decode its own, and no decode worker of its KV's host is ready."""
        if self.table.decodes_own(prefill) or prefill.hello.kv_shard:  # a group's KV: by reference alone
            return False
        return self.table.decoder_near(prefill) is None

    def decode_for(self, prefill_id: str, h: KVHandoff) -> Optional[WorkerState]:
        """The decode worker for a handoff from worker `prefill_id` (None:
        none can take it now), the handoff counted by its way."""
        tokens = self.metrics.handoff_tokens
        if h.local:
            tokens.labels("local").inc(h.num_tokens)
            return self.table.workers.get(prefill_id)
        self.metrics.handoff.observe(h.write_ms / 1000)
        if h.payload is not None:  # its bytes are in the message: any host's decoder can read them
            tokens.labels("sent").inc(h.num_tokens)
            return self.table.decoder_far()
        tokens.labels("copied").inc(h.num_tokens - h.blocks.tokens)
        tokens.labels("referenced").inc(h.blocks.tokens)
        prefill = self.table.workers.get(prefill_id)  # a decoder on the host of its KV, never across hosts
        if prefill is None:  # gone since it wrote: a group's split is unknown now, so it is prefilled again
            return None if h.shards else self.table.least("decode", kv_host="", kv_shard="")
        return self.table.decoder_near(prefill)

    def free(self, handoff: KVHandoff) -> None:
        """A handoff that no decode worker will take: its allocation and its
        blocks' lease go back now rather than when their TTL ends, off the
        receive loop (a slow cache service must not hold it). One kept in
        its process, or sent by value, holds nothing here."""
        if not handoff.local and handoff.payload is None:
            task = asyncio.create_task(self._give_back(handoff))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _give_back(self, handoff: KVHandoff) -> None:
        try:
            for part in [handoff, *handoff.shards]:  # a group's: every rank's part
                if part.allocation >= 0:
                    await self.cache.free(allocations=[part.allocation], arena=part.arena)
            await self.cache.release(handoff.blocks.lease)
        except CacheUnavailable:
            pass  # the reservation's and the lease's TTLs free them
