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

Contract with the caller (workers/worker.py):
  * A request whose first token already finishes it (first token is a stop/EOS
    id, or max_tokens <= generated) never reaches `add`; the caller reports it
    finished (see workers.prefill.engine.first_token_finishes). `add` raises
    ValueError for such requests rather than emit a token past the end.
  * `step()` returns one TokenUpdate per running request that produced a token
    this step; the first token (from prefill) is never repeated. A request
    that joins in a step is forwarded once in that step and yields its first
    decode token in the next one.
  * A finishing update carries the final token (the stop/EOS id itself for
    "stop", like mlx-lm) and finish_reason "stop" or "length".
  * All calls on the worker's MLX thread.

Prefix cache (optional `prefix`, a workers.kv.prefix_cache.PrefixCache): when a
request ends (stop, length, or cancel) its KV goes back to the shared cache,
block by block, so the next turn of the conversation reuses everything up to
its new message. The KV then holds the prompt, the first token and every
generated token including the last one: mlx-lm feeds each token through the
model in the same step that returns it (it computes the next token's logits
ahead), and its `all_tokens` / `GenerationBatch.tokens` list is kept equal to
the tokens in the cache. Those tokens' full blocks are committed (the cache
service skips the ones it has: the prompt's, stored by prefill), and the
tokens after the last full one as a tail block (workers/kv/block_hash.py), so
that the next turn computes only its new message, as in one process.

A commit never leaves the GPU waiting on the host. When a request ends, its
blocks are reserved and laid out as device copies (PrefixCache.prepare_store)
that are computed behind the step in flight; the batch finishes them just
before it queues its next step (`DecodeBatch.barrier`, with the rows a leave
moved), then writes them to the arena and commits them while that step runs
(`DecodeBatch.on_queued` -> `commit_finished`). Only then is the request's last
token returned: a client (an agent) sends its next turn the moment it has
the answer, and that turn must find the answer's blocks. The last token thus
comes one step's queueing later than the others', and no other row waits
for a host copy or a round trip to the cache service. On a GPU (`stores`, a
workers.kv.store_thread.StoreThread) even that host work leaves the MLX thread:
reading the blocks off the device is page-by-page through CUDA's managed
memory (~14 ms a request on an H100), so the store thread copies and commits
them, then sends the last token itself.

Models whose cache is not plain attention KV (sliding window, recurrent) join
the batch the same way: their layers' merge turns RotatingKVCache into a
BatchRotatingKVCache and ArraysCache into a batched ArraysCache. Their prefix
cache is a snapshot cache, and decode commits nothing to it: the state at the
end of an answer sits at no block boundary, and neither a window nor a
recurrent state can be rolled back to one. The next turn still reuses the
previous turn's prompt snapshot (that prompt is a prefix of the next one).

Constrained requests (a grammar in their SamplingParams; `grammars`, a
workers.grammar.Grammars) decode in the same batch as free ones: each gets a
matcher at `add`, and a step of a batch holding any masks those rows'
logits (workers/kernels/generation_batch.py). The grammar's end-of-sequence
ids end such a request (once the grammar is complete they are all it
allows). A token a matcher refuses fails that request alone: it is dropped
from the batch, its token unreported, and `take_failures` hands it to the
role.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.generate import StopSequences, generation_stream
from mlx_lm.utils import maybe_set_recommended_wired_limit

from environment.backend import on_cpu
from protos.messages import DecodeRequest, TokenBatch, TokenUpdate
from workers.decode import ragged_kv
from workers.decode.handoff_check import check_cache
from workers.decode.prefix_sharing import PrefixSharing
from workers.decode.shifted_rope import ShiftedKVCache
from workers.grammar import ConstrainedRows, GrammarError, matcher_after
from workers.kernels import mlx_hooks
from workers.kernels.generation_batch import DecodeBatch, JoiningRows
from workers.loop_clock import part
from workers.models.sharding import is_pipelined
from workers.kv.store_thread import PreparedStore
from workers.sampling import GREEDY_SAMPLER, build_sampling, token_logprob, wants_logprobs

log = logging.getLogger(__name__)


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


@dataclass
class _Queued:
    request: DecodeRequest
    cache: list
    stop_ids: List[int]
    matcher: object = None  # an llguidance matcher when the request follows a grammar


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
        # Only block caches take a finished conversation (see the module doc).
        self.prefix = prefix if prefix is not None and prefix.reuses_blocks else None
        # Ended requests whose blocks are prepared and not yet written, with
        # the last update to return once they are (None: a cancel).
        self._to_commit: List[Tuple[PreparedStore, Optional[TokenUpdate]]] = []
        self._committed: List[TokenUpdate] = []  # last updates whose blocks are written
        # A StoreThread that writes, commits and sends the last updates (set
        # by the worker on a GPU); it keeps the device copies it reads until
        # the worker's loop frees them (StoreThread.release_done).
        self.stores = None
        self._batch = DecodeBatch.empty(model, GREEDY_SAMPLER)
        self._batch.compute_ahead = not on_cpu()  # see DecodeBatch.compute_ahead
        self._batch.constrained = ConstrainedRows()
        self._failures: List[Tuple[str, Exception]] = []  # (request id, why): dropped, for the role to fail
        self._next_uid = 0
        self._queue: deque[_Queued] = deque()  # admitted later, at a step boundary
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
        return bool(self._live or self._queue or self._to_commit or self._committed)

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

    # ---------------------------------------------------------------- control
    def add(self, request: DecodeRequest, cache: list) -> None:
        """Queue a prefilled request; it joins the batch at the next step()."""
        rid = request.request_id
        if rid in self:
            raise ValueError(f"request {rid!r} is already decoding")
        sp = request.sampling
        # A resumed request's grammar follows its answer so far first (the
        # prompt's last generated - 1 tokens); GrammarError fails it here.
        answer = request.prompt_tokens[len(request.prompt_tokens) - max(int(request.generated) - 1, 0):]
        matcher = matcher_after(self.grammars, sp, answer)
        stop_ids = set(int(t) for t in sp.stop_token_ids) | set(self.eos_token_ids)
        if matcher is not None:
            stop_ids |= set(self.grammars.eos_ids)
        stop_ids = sorted(stop_ids)
        if request.first_token in stop_ids:
            raise ValueError(f"request {rid!r}: first token is a stop token; "
                             "the caller must finish it (never send it to decode)")
        if sp.max_tokens - request.generated <= 0:
            raise ValueError(f"request {rid!r}: max_tokens already reached; "
                             "the caller must finish it (never send it to decode)")
        check_cache(cache, request)
        # M-RoPE prompts (Qwen-VL) leave the next rope position away from the
        # token count: ragged rows, or the padded batch's per-row offsets
        # (ShiftedKVCache), carry it.
        shift = request.handoff.rope_offset - request.handoff.num_tokens
        cache = ragged_kv.rows_of(cache, shift) if self.ragged else ShiftedKVCache.of(cache, shift)
        self._queue.append(_Queued(request, cache, stop_ids, matcher))

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
                self._prepare_commit(live, self._batch.tokens[i], self._batch.extract_cache(i), None)
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
            self.commit_finished()
            return self._take_committed()
        with mx.stream(generation_stream):
            self._batch.on_queued = self.commit_finished
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
                        and self._prepare_commit(live, r.all_tokens, r.prompt_cache, update)):
                    continue  # returned once its blocks are written
            updates.append(update)
        return updates + self._take_committed()

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
        """Drop the rows whose matcher refused their token (their responses
        are then skipped: the token is not the grammar's)."""
        for uid, why in self._batch.constrained.take_failed().items():
            live = self._live.get(uid)
            if live is None:
                continue
            if uid in self._batch.uids:
                self.cancel(live.request_id, save=False)
            else:  # it finished in the same step
                del self._live[uid]
                del self._uid_of[live.request_id]
                self._left(uid, live.request_id)
            self._failures.append((live.request_id, GrammarError(why)))

    def take_failures(self) -> List[Tuple[str, Exception]]:
        """Requests dropped by the last steps, with why: the role fails them."""
        failures, self._failures = self._failures, []
        return failures

    def commit_finished(self) -> int:
        """Write and commit the blocks prepared for requests that ended (their
        copies are computed by now in a decode loop, else waited for here).
        Their last updates are returned by the next step(). Returns the
        blocks written."""
        if not self._to_commit:
            return 0
        pending, self._to_commit = self._to_commit, []
        t0, blocks = time.perf_counter(), 0
        with part(self.clock, "commit"):
            mx.eval([a for prepared, _ in pending for a in prepared.arrays()])
            if self.stores is not None:
                for prepared, update in pending:
                    self._hand_to_stores(prepared, update)
                return 0
            for prepared, update in pending:
                blocks += self.prefix.finish_store(prepared)  # never raises: failures are logged
                if update is not None:
                    self._committed.append(update)
        log.debug("decode prefix commit: %d requests, %d new blocks (%d bytes) in %.2f ms", len(pending),
                  blocks, blocks * self.prefix.layout.block_nbytes, (time.perf_counter() - t0) * 1000)
        return blocks

    def _hand_to_stores(self, prepared: PreparedStore, update: Optional[TokenUpdate]) -> None:
        """commit_finished's host work, to the store thread: the hot tier takes
        the blocks here, the thread reads host views of the device copies."""
        self.prefix.detach(prepared)
        self.stores.submit(prepared, TokenBatch([update]) if update is not None else None, keep=prepared.kept)

    def _prepare_commit(self, live: "_Live", tokens: List[int], cache: list,
                        update: Optional[TokenUpdate]) -> bool:
        """Reserve an ended request's blocks and queue their device copies
        behind the step in flight; the batch finishes them before it queues
        its next step, once nothing reads its buffers (they are written in
        place again). False when there is nothing to commit."""
        request_id = live.request_id
        held = cache[0].offset if cache else 0
        if len(tokens) != held:  # never hash tokens the KV does not hold
            log.warning("request %s: %d tokens for %d cached positions; not committing its KV",
                        request_id, len(tokens), held)
            return False
        with part(self.clock, "prepare commit"):
            prepared = self.prefix.prepare_store(list(tokens), cache, request_id, tail=True,  # never raises
                                                 salt=live.salt)
        if prepared is None:
            return False
        arrays = prepared.arrays()
        if arrays:
            mx.async_eval(arrays)
            self._batch.barrier = self._batch.barrier + arrays
        self._to_commit.append((prepared, update))
        return True

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
        held = [u for _, u in self._to_commit if u is not None] + self._committed
        self._to_commit, self._committed = [], []
        self._batch.barrier = []
        return held

    def _take_committed(self) -> List[TokenUpdate]:
        done, self._committed = self._committed, []
        return done

    def close(self) -> None:
        if self._old_wired_limit is not None:
            mx.synchronize(generation_stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None

    # --------------------------------------------------------------- internal
    def _admit(self) -> None:
        joining: List[_Queued] = []
        while self._queue and len(self._live) + len(joining) < self.max_batch:
            joining.append(self._queue.popleft())
        if not joining:
            return
        uids = list(range(self._next_uid, self._next_uid + len(joining)))
        self._next_uid += len(joining)
        samplers, processors = [], []
        for q in joining:
            # draws_done: prefill already drew `generated` tokens from a seeded
            # stream; continue it rather than replay it.
            sampler, procs = build_sampling(q.request.sampling, draws_done=request_draws(q.request))
            samplers.append(sampler)
            processors.append(procs)
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
        self._batch.extend(JoiningRows(
            self.model, uids,
            mx.array([int(q.request.first_token) for q in joining], dtype=mx.uint32),
            _merge([q.cache for q in joining]),
            # The KV's tokens; the batch appends first_token when it feeds it,
            # and penalties see the same context as in generate_step.
            [[int(t) for t in q.request.prompt_tokens] for q in joining],
            samplers, GREEDY_SAMPLER, processors,
            [StopSequences([[t] for t in q.stop_ids]) for q in joining],
            # +1: the first response is first_token itself (dropped in step).
            [q.request.sampling.max_tokens - q.request.generated + 1 for q in joining],
        ))


def _merge(caches: List[list]) -> list:
    """Per-request caches -> per-layer batch caches (each layer's class merges,
    as mlx-lm's BatchGenerator does)."""
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]


def request_draws(request: DecodeRequest) -> int:
    """Random draws already taken from the request's seeded stream."""
    return max(int(request.generated), 0)
