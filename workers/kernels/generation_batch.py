"""mlx-lm's GenerationBatch as the decode engine runs it (workers/decode/engine.py).

Both classes override GenerationBatch's private `_step` (and `_Joining`
sets its `_next_logprobs`): that reach into mlx-lm's internals is why they
live here, with the other hooks, rather than beside the engine.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from workers.kernels.slot_batch_cache import SlotBatchKVCache, share_row_state, swap_remove_order
from workers.loop_clock import part


class DecodeBatch(GenerationBatch):
    """mlx-lm's GenerationBatch, made to keep the GPU busy between steps.

    Rows leave by swap-remove: the last rows take the slots of the rows that
    left, so a padded batch's KV (workers/kernels/slot_batch_cache.py SlotBatchKVCache)
    moves only those rows. The moved rows' copies, and the copies of ended
    requests' blocks, are computed behind the step in flight and waited for
    only just before the next step is queued (`barrier`): waiting earlier
    left the GPU idle while the host did everything else between two steps.
    `on_queued` runs host work (the commits) right after a step is queued,
    while the GPU computes it."""

    barrier: List[mx.array] = []
    on_queued: Optional[Callable[[], object]] = None
    clock = None  # the worker's LoopClock: parts of a step, timed

    def _step(self):
        if self.barrier:
            with part(self.clock, "barrier"):
                mx.eval(self.barrier)  # the step in flight and the copies behind it
            self.barrier = []
        with part(self.clock, "queue+tokens"):
            out = super()._step()
        if self.on_queued is not None:
            self.on_queued()
        return out

    def filter(self, keep: List[int]):
        for c in self.prompt_cache:
            if isinstance(c, SlotBatchKVCache):
                c.defer_moves = True
        super().filter(swap_remove_order(keep, len(self.uids)))
        for c in self.prompt_cache:
            if getattr(c, "moved", None):
                self.barrier = self.barrier + c.moved
                c.moved = []
        share_row_state(self.prompt_cache)

    def extend(self, batch):
        super().extend(batch)
        share_row_state(self.prompt_cache)


class JoiningRows(GenerationBatch):
    """Newcomers to a running GenerationBatch, built without a step of their
    own: their first input (first_token) is fed in the batch's next step,
    which returns it as their first response (step() drops it, prefill
    reported it) and samples their first decode token. Counting that
    response is why their max_tokens carry one more."""

    def _step(self):  # only GenerationBatch.__init__ calls it on this object
        # The response's logprobs for first_token, never reported.
        self._next_logprobs = [NO_LOGPROBS] * len(self.uids)


NO_LOGPROBS = mx.zeros((1,))
