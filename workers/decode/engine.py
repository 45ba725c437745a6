"""Continuous-batching decode on MLX, a thin wrapper over mlx_lm's GenerationBatch.

A prefilled request arrives as (DecodeRequest, per-layer KV cache holding the
whole prompt) and joins the running batch at a step boundary with first_token
as its next input: the batch feeds first_token at the cache's position and
samples from there, exactly what mlx_lm.generate does after its prompt phase.
mlx-lm's GenerationBatch does the rest: per-request samplers and logits
processors, stop tokens and max_tokens, the next step computed ahead, and
finished rows dropped at once.

Joining is ours (`JoiningRows`), not BatchGenerator's: BatchGenerator takes a
new row through its prompt phase, which deep-copies the newcomers' KV
(PromptProcessingBatch.split) and runs a forward pass of the newcomers alone
before they are merged into the batch. Here newcomers are merged as they are
and their first token is fed in the running batch's next step, with everyone
else's: one forward pass per step, whoever joins.

Contract with the caller (workers/decode/role.py):
  * A request whose first token already finishes it (a stop/EOS id, or its
    token budget exhausted by it) never reaches `add`, which raises
    ValueError for one (workers/decode/joining.py: what `add` checks, and
    how a request joins).
  * `step()` returns one TokenUpdate per running request that produced a token
    this step; the first token (from prefill) is never repeated. A request
    that joins in a step is forwarded once in that step and yields its first
    decode token in the next one.
  * A finishing update carries the final token (the stop/EOS id itself for
    "stop", like mlx-lm) and finish_reason "stop" or "length".
  * All calls on the worker's MLX thread.

Prefix cache (optional `prefix`, a workers.kv.prefix_cache.PrefixCache): when a
request ends (stop, length, or cancel) its KV goes back to the shared cache,
committed behind the step in flight, and its last token is returned once its
blocks are written (workers/decode/commits.py).

Models whose cache is not plain attention KV (sliding window, recurrent) join
the batch the same way: their layers' merge turns RotatingKVCache into a
BatchRotatingKVCache and ArraysCache into a batched ArraysCache. Their prefix
cache is a snapshot cache, to which decode commits nothing.

Constrained requests (a grammar in their SamplingParams; `grammars`, a
workers.grammar.Grammars) decode in the same batch as free ones: each gets a
matcher at `add`, and a step of a batch holding any masks those rows'
logits (workers/kernels/generation_batch.py). The grammar's end-of-sequence
ids end such a request (once the grammar is complete they are all it
allows). A token a matcher refuses fails that request alone: it is dropped
from the batch, its token unreported, and `take_failures` hands it to the
role. So does a row's sampler or logits processor that raises inside a step
(workers/sampling.py RowFaults); sampling a worker cannot take fails the
request at `add`, before it joins.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.utils import maybe_set_recommended_wired_limit

from environment.backend import on_cpu
from protos.messages import DecodeRequest, TokenUpdate
from workers.decode.commits import EndedCommits
from workers.decode.joining import Joining, joining_rows
from workers.decode.prefix_sharing import PrefixSharing
from workers.grammar import ConstrainedRows, GrammarError, logits_width
from workers.kernels import mlx_hooks
from workers.kernels.generation_batch import DecodeBatch
from workers.loop_clock import part
from workers.models.sharding import is_pipelined
from workers.sampling import GREEDY_SAMPLER, RowFaults, token_logprob, wants_logprobs

@dataclass
class _Live:
    request_id: str
    uid: int
    logprobs: bool
    top_logprobs: int
    # The KV's tokens are known exactly (prompt_tokens == the handed-off KV),
    # so its blocks may be committed to the prefix cache.
    cacheable: bool = False
    salt: str = ""  # its cache salt: its blocks are committed under it
    # Joined and not stepped yet: the batch's next response for it is its
    # first token, which prefill already reported.
    fresh: bool = True


class DecodeEngine:
    """Decode up to `max_batch` requests together, one token each per step()."""

    def __init__(self, model, max_batch: int = 32, eos_token_ids: Iterable[int] = (), prefix=None,
                 ragged: bool | None = None, grammars=None, speculation=None):
        self.model = model
        # workers.decode.speculation.Speculation, or None: every step an ordinary one.
        self.speculation = speculation
        self._last_ordinary = 0  # rows of the step before when it was ordinary (0: it was not)
        self.grammars = grammars  # workers.grammar.Grammars, or None: no grammar can be followed
        self.max_batch = max_batch
        # On the CPU backend rows keep their own KV (workers/decode/ragged_kv.py):
        # joining and leaving the batch copy nothing, and a shared prompt
        # prefix is read once per step; memory bandwidth is what a CPU decode
        # step waits on. On a GPU the per-row attention's many small kernels
        # cost more than the copies they save (measured on an H100:
        # BENCHMARKS.md), so there, and for models whose attention cannot
        # take it, the batch is mlx-lm's padded BatchKVCache.
        # Not in a pipeline (workers/models/sharding.py is_pipelined): its send hangs on a cache.keys.
        self.ragged = (mlx_hooks.install(model) and not is_pipelined(model)
                       and (on_cpu() if ragged is None else ragged))
        # Rows whose prompts start alike (a swarm's system prompt) share that
        # prefix's KV: read once per step, held once.
        self.sharing = PrefixSharing() if self.ragged else None
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        # Only block caches take a finished conversation (workers/decode/commits.py).
        self.prefix = prefix if prefix is not None and prefix.reuses_blocks else None
        self._batch = DecodeBatch.empty(model, GREEDY_SAMPLER)
        self._batch.compute_ahead = not on_cpu()  # see DecodeBatch.compute_ahead
        self._batch.constrained = ConstrainedRows()
        self._faults = RowFaults()  # a row's sampler or processors that raised in a step: that row fails alone
        self.vocab = logits_width(model)  # the logits' width: a request's logit_bias ids within it
        self._commits = EndedCommits(self.prefix, self._batch)
        self._failures: List[Tuple[str, Exception]] = []  # (request id, why): dropped, for the role to fail
        self._next_uid = 0
        self._queue: deque[Joining] = deque()  # admitted later, at a step boundary
        self._live: Dict[int, _Live] = {}  # batch uid -> request
        self._uid_of: Dict[str, int] = {}  # request_id -> uid
        # As mlx-lm's BatchGenerator does: keep the model wired (Metal only).
        self._old_wired_limit = maybe_set_recommended_wired_limit()

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> int:
        """Requests inside the batch."""
        return len(self._live)

    @property
    def waiting(self) -> int:
        """Requests added but waiting for a free batch slot."""
        return len(self._queue)

    @property
    def has_work(self) -> bool:
        """Requests to step, or ended requests' KV still to commit (or their
        last tokens still to return)."""
        return bool(self._live or self._queue or self._commits.busy)

    @property
    def kv_bytes(self) -> int:
        """Bytes of KV held for live and waiting requests (allocated buffers)."""
        queued = sum(c.nbytes for q in self._queue for c in q.cache)
        return sum(c.nbytes for c in self._batch.prompt_cache) + queued

    def request_ids(self) -> List[str]:
        """Ids of every request held (running, then waiting); a copy, safe to
        iterate while cancelling."""
        return [l.request_id for l in self._live.values()] + [
            q.request.request_id for q in self._queue
        ]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._uid_of or any(
            q.request.request_id == request_id for q in self._queue
        )

    @property
    def stores(self):
        """A StoreThread that writes ended requests' blocks and sends their
        last updates (set by the worker on a GPU), or None."""
        return self._commits.stores

    @stores.setter
    def stores(self, stores) -> None:
        self._commits.stores = stores

    # ---------------------------------------------------------------- control
    def add(self, request: DecodeRequest, cache: list) -> None:
        """Queue a prefilled request; it joins the batch at the next step()."""
        rid = request.request_id
        if rid in self:
            raise ValueError(f"request {rid!r} is already decoding")
        self._queue.append(Joining.of(request, cache, self.grammars, self.eos_token_ids, self.ragged, self.vocab,
                                      self._faults))

    def cancel(self, request_id: str, save: bool = True) -> bool:
        """Drop a request now (queued or running); frees its KV. False if unknown.
        With `save` (and a prefix cache) its KV is queued for commit_finished;
        pass save=False when the batch is suspect (after a failed step)."""
        uid = self._uid_of.pop(request_id, None)
        if uid is not None:
            live = self._live.pop(uid)
            self._left(uid, request_id)
            i = self._batch.uids.index(uid)
            if save and live.cacheable and self.prefix is not None:
                # Prepared before the filter drops its rows (nothing waits:
                # the copies are computed before the next step is queued).
                self._commits.prepare(request_id, live.salt, self._batch.tokens[i],
                                      self._batch.extract_cache(i), None)
            self._batch.filter([j for j in range(len(self._batch.uids)) if j != i])
            return True
        for q in self._queue:
            if q.request.request_id == request_id:
                self._queue.remove(q)
                return True
        return False

    def step(self) -> List[TokenUpdate]:
        """Admit waiting requests, then run one decode step for the batch.
        Returns this step's tokens, then the last tokens of requests whose
        blocks were committed meanwhile (see the module doc)."""
        with part(self.clock, "admit"):
            self._admit()
        if not self._live:
            self._commits.commit()
            return self._commits.take()
        with mx.stream(generation_stream):
            self._batch.on_queued = self._commits.commit
            try:
                responses = self._speculative_step()
                if responses is None:
                    responses = self._ordinary_step()
                # A batch of newcomers alone steps again, so that a step yields
                # their first decode tokens (as a step always did).
                if responses and all(self._live[r.uid].fresh for r in responses):
                    for r in responses:
                        self._live[r.uid].fresh = False
                    responses = self._batch.next()
            finally:
                self._batch.on_queued = None
        self._drop_failed()
        updates = []
        for r in responses:
            live = self._live.get(r.uid)
            if live is None:  # cancelled between steps; nothing to report
                continue
            if live.fresh:  # its first token: prefill reported it
                live.fresh = False
                continue
            lp = None
            if live.logprobs:
                lp = token_logprob(r.logprobs, r.token, live.top_logprobs)
            update = TokenUpdate(live.request_id, int(r.token), lp, r.finish_reason)
            if r.finish_reason is not None:
                del self._live[r.uid]
                del self._uid_of[live.request_id]
                self._left(r.uid, live.request_id)
                if (self.prefix is not None and live.cacheable and r.prompt_cache
                        and self._commits.prepare(live.request_id, live.salt, r.all_tokens, r.prompt_cache, update)):
                    continue  # returned once its blocks are written
            updates.append(update)
        return updates + self._commits.take()

    def _ordinary_step(self):
        """An ordinary step; timed for the speculation's costs when the step
        before was one too (pipelined, as ordinary steps run)."""
        rows, t0 = len(self._batch.uids), time.perf_counter()
        responses = self._batch.next()
        if self.speculation is not None:
            if self._last_ordinary == rows:
                self.speculation.costs.ordinary(rows, time.perf_counter() - t0)
            self._last_ordinary = rows
        return responses

    def _speculative_step(self):
        """A speculative step's responses (several per row), or None when
        this step is an ordinary one (workers/decode/speculation.py)."""
        if self.speculation is None:
            return None
        fresh = any(live.fresh for live in self._live.values())
        with part(self.clock, "draft"):
            plan = self.speculation.plan(self._batch, fresh)
        if plan is None or not any(plan[1]):
            return None
        uids = list(self._batch.uids)
        t0 = time.perf_counter()
        verified = self._batch.speculate(*plan)
        self.speculation.costs.speculative(len(uids), 1 + max(verified.drafted), time.perf_counter() - t0)
        self.speculation.record(uids, verified)
        self._last_ordinary = 0
        return verified.responses

    def _left(self, uid: int, request_id: str) -> None:
        """A request left the batch: what followed it goes too."""
        if self.sharing is not None:
            self.sharing.leave(request_id)
        if self.speculation is not None:
            self.speculation.leave(uid, request_id)

    def _drop_failed(self) -> None:
        """Drop the rows whose matcher refused their token, or whose sampler
        or processors raised (their responses are then skipped: the token is
        not the grammar's, or not the row's own)."""
        failed = [(uid, GrammarError(why)) for uid, why in self._batch.constrained.take_failed().items()]
        failed += [(self._uid_of.get(rid), exc) for rid, exc in self._faults.take().items()]
        for uid, exc in failed:
            live = self._live.get(uid)
            if live is None:
                continue
            if uid in self._batch.uids:
                self.cancel(live.request_id, save=False)
            else:  # it finished in the same step
                del self._live[uid]
                del self._uid_of[live.request_id]
                self._left(uid, live.request_id)
            self._failures.append((live.request_id, exc))

    def take_failures(self) -> List[Tuple[str, Exception]]:
        """Requests dropped by the last steps, with why: the role fails them."""
        failures, self._failures = self._failures, []
        return failures

    def commit_finished(self) -> int:
        """Write and commit the blocks prepared for requests that ended
        (workers/decode/commits.py); their last updates are returned by the
        next step(). Returns the blocks written."""
        return self._commits.commit()

    @property
    def clock(self):
        return self._batch.clock

    @clock.setter
    def clock(self, clock) -> None:
        """A LoopClock to time the parts of a step in (the worker's)."""
        self._batch.clock = clock

    def abandon_commits(self) -> List[TokenUpdate]:
        """The last updates held for commits, now, their commits dropped
        (after a failed step: the batch is suspect)."""
        return self._commits.abandon()

    def close(self) -> None:
        if self._old_wired_limit is not None:
            mx.synchronize(generation_stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None

    # --------------------------------------------------------------- internal
    def _admit(self) -> None:
        joining: List[Joining] = []
        while self._queue and len(self._live) + len(joining) < self.max_batch:
            joining.append(self._queue.popleft())
        if not joining:
            return
        uids = list(range(self._next_uid, self._next_uid + len(joining)))
        self._next_uid += len(joining)
        for uid, q in zip(uids, joining):
            req, sp = q.request, q.request.sampling
            if q.matcher is not None:
                self._batch.constrained.add(uid, q.matcher)
            # Blocks are keyed by tokens here; a prompt with images needs its
            # images' hashes in the keys too, so its KV is not committed (yet).
            cacheable = len(req.prompt_tokens) == req.handoff.num_tokens and not req.media
            # Rows share prompt KV only within the shared (unsalted) cache.
            if (self.sharing is not None and cacheable and not req.cache_salt
                    and req.handoff.rope_offset == req.handoff.num_tokens):
                self.sharing.admit(req.request_id, req.prompt_tokens, q.cache)
            self._live[uid] = _Live(req.request_id, uid, wants_logprobs(sp),
                                    int(sp.top_logprobs), cacheable, salt=req.cache_salt)
            self._uid_of[req.request_id] = uid
        self._batch.extend(joining_rows(self.model, uids, joining))
