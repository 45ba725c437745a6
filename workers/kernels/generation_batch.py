"""mlx-lm's GenerationBatch as the decode engine runs it (workers/decode/engine.py).

Both classes override GenerationBatch's private `_step` (and `JoiningRows`
sets its `_next_logprobs`): that reach into mlx-lm's internals is why they
live here, with the other hooks, rather than beside the engine.

A row's token budget (protos/budget.py) is kept in mlx-lm's own counters,
read and spent here alone: `max_tokens[i]` is its `allowed` and
`_num_tokens[i]` (the tokens the batch returned for it) its `produced`, so
GenerationBatch.next's end of a row (`_num_tokens >= max_tokens`, "length")
is the budget's `exhausted`. `DecodeBatch.budget(i)` reads it;
`JoiningRows` sets it as a request joins.

A batch with constrained rows (workers/grammar.py) steps through
`_MaskedForward`: GenerationBatch._step builds a step's forward pass from
the previous step's tokens before they are known on the host, and samples
from `self.model(...)`'s logits. The wrapper queues the forward pass and
waits for those tokens (in whichever order keeps the device busy: see
_MaskedForward), lets the matchers consume them and fill their masks while
the forward pass runs, and hands the masked logits back to _step
(processors, sampler and the next step as before). A batch without
constrained rows runs mlx-lm's _step untouched.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import GenerationBatch

from protos.budget import TokenBudget
from workers.grammar import ConstrainedRows, apply_masks
from workers.kernels.slot_batch_cache import SlotBatchKVCache, share_row_state, swap_remove_order
from workers.kernels.verify_step import Verified, verify_step
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
    constrained: Optional[ConstrainedRows] = None  # the rows' matchers (set by the engine)
    tokens_first = False  # a constrained step's order (_MaskedForward)
    # Queue each step's forward pass ahead (mlx-lm's way: the device computes
    # step N + 1 while the host returns step N's tokens). On MLX's CPU backend
    # `async_eval` of a whole forward pass blocks until it is nearly done (the
    # scheduler's cap on tasks in flight), so there is no overlap to win, and
    # every token came back one pass after it was computed: a newcomer's
    # second token two passes after its first. Off there (the engine sets it).
    compute_ahead = True
    mask_width = 0  # the logits' width, known after the first constrained step

    def _step(self):
        if self.barrier:
            with part(self.clock, "barrier"):
                mx.eval(self.barrier)  # the step in flight and the copies behind it
            self.barrier = []
        with part(self.clock, "queue+tokens"):
            if self.constrained and self.constrained.rows(self.uids):
                out = self._masked_step()
            elif self.compute_ahead:
                out = super()._step()
            else:
                with _generate_module_without_async_eval():
                    out = super()._step()
        if self.on_queued is not None:
            self.on_queued()
        return out

    def budget(self, i: int) -> TokenBudget:
        """Row i's token budget, counting the tokens the batch returned
        (its next input, sampled, is not one yet)."""
        return TokenBudget(self.max_tokens[i], self._num_tokens[i])

    def spend(self, i: int) -> TokenBudget:
        """Row i returned one more token (a speculative step's, which counts
        as GenerationBatch.next does): its budget after it."""
        self._num_tokens[i] += 1
        return self.budget(i)

    def next_inputs(self) -> List[int]:
        """The tokens the next step feeds (sampled by the step before), on
        the host: a speculative step drafts from them. Waits for that step."""
        with part(self.clock, "barrier"):
            mx.eval(self.barrier, self._next_tokens)
        self.barrier = []
        return self._next_tokens.tolist()

    def speculate(self, inputs: List[int], drafts: List[List[int]]) -> Verified:
        """A speculative step (workers/kernels/verify_step.py) after next_inputs()."""
        with part(self.clock, "speculate"):
            out = verify_step(self, inputs, drafts)
        if self.on_queued is not None:
            self.on_queued()
        return out

    def _masked_step(self):
        model = self.model
        self.model = _MaskedForward(model, self)
        try:
            return super()._step()
        finally:
            self.model = model

    def filter(self, keep: List[int]):
        for c in self.prompt_cache:
            if isinstance(c, SlotBatchKVCache):
                c.defer_moves = True
        super().filter(swap_remove_order(keep, len(self.uids)))
        if self.constrained is not None:
            self.constrained.keep(self.uids)
        for c in self.prompt_cache:
            if getattr(c, "moved", None):
                self.barrier = self.barrier + c.moved
                c.moved = []
        share_row_state(self.prompt_cache)

    def extend(self, batch):
        super().extend(batch)
        share_row_state(self.prompt_cache)


class _LazyEvalOnly:
    """What mlx-lm's generate module sees as `mx` (mlx.core, or mlx_hooks'
    stand-in with the CPU's fast logsumexp), with `async_eval` a no-op: a
    step's forward pass is then computed when its tokens are read (the next
    step), not queued ahead."""

    def __init__(self, core):
        self._core = core

    def __getattr__(self, name):
        return getattr(self._core, name)

    @staticmethod
    def async_eval(*arrays):
        return None


@contextmanager
def _generate_module_without_async_eval():
    module = sys.modules[GenerationBatch.__module__]
    core = module.mx
    module.mx = _LazyEvalOnly(core)
    try:
        yield
    finally:
        module.mx = core


# A step whose previous tokens were on the host within this long after its
# forward pass was queued did not keep the device busy: the host is the
# bottleneck (a small model on a GPU).
HOST_BOUND_WAIT_S = 1e-3
# A step's masks take well under a millisecond a row; past this the helper
# thread is stuck, and the step fails (its requests end with an error) rather
# than hang the worker.
MASKS_DEADLINE_S = 30.0


class _MaskedForward:
    """The model as a constrained batch's _step calls it: the forward pass
    of `inputs` (the step's tokens, [batch, 1]), masked for each row's grammar.

    Two orders, chosen from the last step. Device-bound (the CPU backend, a
    large model): queue the forward pass, then wait for the tokens and step
    the matchers while it runs. Host-bound (the tokens are there as soon as
    asked; queueing the pass is the host's longest work): take the tokens
    first, and let the helper thread step the matchers while this thread
    queues the pass. Waiting first costs the device that wait, so it is
    kept only while the wait is shorter than the matchers' work."""

    def __init__(self, model, batch: "DecodeBatch"):
        self.model = model
        self.batch = batch

    def __call__(self, inputs: mx.array, cache=None):
        batch = self.batch
        rows, clock = batch.constrained, batch.clock
        if batch.tokens_first and batch.mask_width:
            waited, tokens = _tokens(inputs, clock)
            pending = rows.start_masks(batch.uids, tokens, batch.mask_width)
            logits = self.model(inputs, cache=cache)
            mx.async_eval(logits)
            with part(clock, "grammar masks"):
                bitmask = pending.result(timeout=MASKS_DEADLINE_S)
            batch.tokens_first = waited < rows.fill_s
        else:
            logits = self.model(inputs, cache=cache)
            mx.async_eval(logits)  # computed while the host steps the matchers
            waited, tokens = _tokens(inputs, clock)
            with part(clock, "grammar masks"):
                bitmask = rows.masks(batch.uids, tokens, logits.shape[-1])
            batch.tokens_first = waited < HOST_BOUND_WAIT_S
        batch.mask_width = logits.shape[-1]
        return logits if bitmask is None else apply_masks(logits, bitmask)


def _tokens(inputs: mx.array, clock) -> Tuple[float, List[int]]:
    """(seconds waited, the step's input tokens on the host): the step
    before ends here, as GenerationBatch._step would wait for it."""
    t0 = time.perf_counter()
    with part(clock, "grammar wait"):
        tokens = inputs.reshape(-1).tolist()
    return time.perf_counter() - t0, tokens


class JoiningRows(GenerationBatch):
    """Newcomers to a running GenerationBatch, built without a step of their
    own: their first input (first_token) is fed in the batch's next step,
    which returns it as their first response (step() drops it, prefill
    reported it) and samples their first decode token.

    `budgets`: the requests' (DecodeRequest.budget, first_token counted).
    The batch counts that first response again, so each row starts from the
    budget before first_token."""

    def __init__(self, model, uids, inputs, prompt_cache, tokens, samplers, fallback_sampler,
                 logits_processors, stop_sequences, budgets: List[TokenBudget]):
        super().__init__(model, uids, inputs, prompt_cache, tokens, samplers, fallback_sampler,
                         logits_processors, stop_sequences, [b.allowed for b in budgets])
        self._num_tokens = [b.produced - 1 for b in budgets]

    def _step(self):  # only GenerationBatch.__init__ calls it on this object
        # The response's logprobs for first_token, never reported.
        self._next_logprobs = [NO_LOGPROBS] * len(self.uids)


NO_LOGPROBS = mx.zeros((1,))
