"""The prefill role: prompts in, first tokens out, their KV handed off.

Prompts queue (`handle`); the Worker loop calls `step()` between other
units of MLX work, and each call runs one chunk of one prompt
(workers/prefill/engine.py, or workers/prefill/vlm.py with images), or one
pass over several short prompts together (workers/prefill/batch.py). Which
prompt is workers/prefill/turns.py's: several may be started at once, each
with its own cache, and the one with the fewest tokens left runs its next
chunk (an earlier prompt that later ones have taken more than a share of
its own time from runs first), so a short prompt waits for about one chunk
of a long one, not for all of it. A
finished prompt's first token goes out at once (PrefillDone); then its KV
is handed off through the arena (workers/kv/handoff.py write_handoff, after
the blocks the prefix cache holds for it, which go by reference), or in
the message itself when its decode worker is on another host
(PrefillRequest.kv_by_value), or, when this process decodes it too
(--colocate), kept in `local_kv`; and its new
blocks are stored, by the store thread when there is one
(workers/kv/store_thread.py).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from protos.messages import HeldBlocks, KVHandoff, PrefillDone, PrefillRequest, RequestFailed
from workers.group import handoff_shards
from workers.kv import handoff as kv_handoff
from workers.kv.cache_state import is_plain_kv
from workers.loop_clock import part, tally_line
from workers.prefill.batch import batchable, fits, run_batch
from workers.prefill.engine import PrefillJob, first_token_finishes
from workers.prefill.turns import Turn, Turns
from workers.prefill.vlm import VLMPrefillJob
from workers.role import Role, Unit

log = logging.getLogger(__name__)


class PrefillRole(Role):
    """A worker's prefill: `engine` (a PrefillEngine) over the prompts it is
    sent, with `prefix` (a prefix cache, or None), `cache` (a CacheClient:
    handoff reservations), `arena_buf` (arena name -> its buffer), `hello`
    (the heartbeat: batched prompts are counted there), `local_kv` (request
    id -> KV, shared with this process's DecodeRole when `colocated`),
    `stores` (a StoreThread, or None), `vision` (a VisionRole, for
    prompts with images) and `group` (a worker group's, or None)."""

    def __init__(self, settings, engine, *, worker_id: str, prefix, cache, arena_buf: Callable[[str], object],
                 outbox, clock, hello, local_kv: dict, colocated: bool = False, stores=None, vision=None,
                 fail=None, group=None):
        super().__init__(worker_id, outbox, clock, fail)
        self.group = group  # a worker group's mx.distributed.Group: every rank hands off its own part
        self.batch_limit = settings.prefill_batch  # prompts per pass; the power policy may lower it
        self.settings = settings
        self.engine = engine
        self.prefix = prefix
        self.cache = cache
        self.arena_buf = arena_buf
        self.hello = hello
        self.local_kv = local_kv  # colocated handoffs: the KV never leaves the process
        self.colocated = colocated
        self.stores = stores
        self.vision = vision
        self.turns = Turns(engine.chunk_size if engine is not None else settings.prefill_chunk)
        self.held: dict[str, Optional[HeldBlocks]] = {}  # request id -> its held blocks, before a batched pass
        # A group's followers take rank 0's step times (turns.py): every rank picks alike.
        self.chunk_unit = Unit("prefill", self.timed_step, shared=lambda: self.turns)

    # ------------------------------------------------------------ the loop --
    def handle(self, msg: PrefillRequest) -> None:
        self.turns.add(msg)

    @property
    def queue(self):
        """The prompts not started yet, in arrival order."""
        return self.turns.queue

    @property
    def current(self) -> Optional[tuple]:
        """(request, job) of the prompt started first and not finished, or None."""
        turn = self.turns.first_started()
        return (turn.req, turn.job) if turn is not None else None

    def has_work(self) -> bool:
        return bool(self.turns)

    @property
    def running(self) -> int:
        return len(self.turns.started)

    @property
    def waiting(self) -> int:
        return len(self.turns.queue)

    def units(self, busy_elsewhere):
        if self.has_work():
            yield self.chunk_unit

    def unit_kinds(self) -> list[Unit]:
        return [self.chunk_unit]

    def limit(self, limits) -> str:
        self.batch_limit = max(1, min(limits.prefill_batch, self.settings.prefill_batch))
        self.engine.ane_all = bool(limits.prefill_on_ane)
        return f"prefill batch {self.batch_limit}"

    def set_clock(self, clock) -> None:
        self.clock = self.engine.clock = clock

    def timed_step(self, wait: bool = False) -> None:
        with self.clock.phase("prefill"):
            self.step()

    def step(self) -> None:
        """The oldest queued prompt started when there is room, then one
        chunk of the prompt whose turn it is (or one batched pass); a failure
        fails that prompt."""
        since = self.turns.clock()  # a start's time is the step's (charged once the step is picked)
        req = self.turns.next_to_start()
        if req is not None:
            self.guarded(req.request_id, self.start_turn, req)
            if not self.turns:  # it failed, and nothing else waits
                return
        self.prefill_chunk(since=since)

    def cancel(self, request_id: str, save: bool = True) -> None:
        self.turns.drop(request_id)  # its job, and the KV it holds so far, with it
        self.local_kv.pop(request_id, None)
        self.unhold(request_id)

    # ------------------------------------------------------------- prompts --
    def prefill_chunk(self, turn=None, since: Optional[float] = None) -> None:
        """One chunk of `turn` (a Turn, or a queued request to start; None:
        whose turn it is, timed for the turns from `since` (None: now) and
        failing that prompt alone)."""
        if turn is None:
            turn = self.turns.pick()
            with self.turns.timed(turn, since):
                self.guarded(turn.request_id, self.prefill_chunk, turn)
            return
        if not isinstance(turn, Turn):
            turn = self.start_turn(turn)
        if self.batch_limit > 1 and self.prefill_batch(turn):
            return
        req, job = turn.req, turn.job
        result = job.step()
        if result is None:
            return
        self.turns.drop(req.request_id)
        self.finish_prefill(req, job, result)

    def start_turn(self, req: PrefillRequest) -> Turn:
        """`req` started: its job made, a text prompt's cached prefix loaded
        (so its turn counts only the tokens left)."""
        turn = self.turns.start(req, self.start_prefill(req))
        if type(turn.job) is PrefillJob:
            turn.job.load()
        return turn

    def start_prefill(self, req: PrefillRequest):
        if not req.images:
            return self.engine.start(req.prompt_tokens, req.sampling, owner=req.request_id, budget=req.budget,
                                     salt=req.cache_salt)
        if self.vision is None:
            raise ValueError("this model does not take images")
        job = VLMPrefillJob(self.vision.engine, req.prompt_tokens, req.images, req.sampling,
                            chunk_size=self.settings.prefill_chunk, owner=req.request_id, prefix=self.prefix,
                            embeddings=self.vision.embeddings, grammars=self.engine.grammars,
                            budget=req.budget, salt=req.cache_salt)
        job.clock = self.clock
        return job

    def prefill_batch(self, turn: Turn) -> bool:
        """Prefill `turn`'s prompt together with the others that fit one pass
        (workers/prefill/batch.py: a swarm's burst of short suffixes): started
        ones with nothing computed yet, then queued ones in arrival order;
        False when it cannot lead a batch (or nothing else waits). The first
        queued prompt that does not fit stays started, its prefix loaded."""
        req, job = turn.req, turn.job
        if type(job) is not PrefillJob or not self.queue and len(self.turns.started) < 2:
            return False
        job.load()
        if not batchable(job):
            return False
        rows = [(req, job)]
        # A batch's handoffs all sit in the arena until decode takes them (one
        # prompt's used to be gone before the next was made): together they
        # take at most an eighth of it.
        room = self.settings.cache_memory_bytes // 8 - self.handoff_bytes(req, job)
        for other in list(self.turns.started.values()):
            if len(rows) >= self.batch_limit:
                break
            if other is turn or not batchable(other.job) or not fits([j for _, j in rows], other.job):
                continue
            nbytes = self.handoff_bytes(other.req, other.job)
            if nbytes <= room:
                room -= nbytes
                rows.append((other.req, other.job))
        while self.queue and len(rows) < self.batch_limit and not self.queue[0].images \
                and self.turns.may_start(self.queue[0]):
            nxt = self.queue[0]
            try:
                other = self.start_turn(nxt).job
                joins = batchable(other) and fits([j for _, j in rows], other)
                nbytes = self.handoff_bytes(nxt, other) if joins else 0
            except Exception as exc:  # noqa: BLE001 - that request fails, not the batch
                self.fail(nxt.request_id, exc)
                continue
            if not joins or nbytes > room:
                break  # it waits, started, for its own turn
            room -= nbytes
            rows.append((nxt, other))
        for r, _ in rows:
            self.turns.drop(r.request_id)
        if len(rows) == 1:  # alone after all: batchable, so one step
            self.guarded(req.request_id, lambda: self.finish_prefill(req, job, job.step()))
            return True
        self.run_rows(rows)
        return True

    def run_rows(self, rows: list) -> None:
        """One pass over a batch's (request, job) rows, each then finished."""
        try:
            results = run_batch([j for _, j in rows])
        except Exception as exc:  # noqa: BLE001 - a broken pass fails its rows, not the worker
            for r, _ in rows:
                self.fail(r.request_id, exc)
            return
        self.clock.count("batched prompts", len(rows))
        self.hello.batched_prompts += len(rows)
        for (r, j), result in zip(rows, results):
            if isinstance(result, Exception):  # its grammar refused its first token: that row alone
                self.fail(r.request_id, result)
                continue
            self.guarded(r.request_id, self.finish_prefill, r, j, result)

    def handoff_bytes(self, req: PrefillRequest, job) -> int:
        """The KV a batch's row will put in the arena (0 colocated or by
        value), its blocks held for it now (`held`): what the cache service lacks."""
        if self.keeps_kv(req) or req.kv_by_value:
            return 0
        if req.request_id not in self.held:  # a prompt that did not fit the last batch holds its blocks still
            self.held[req.request_id] = self.hold_blocks(req, job, job.cache, job.total)
        hold = self.held[req.request_id]
        by_ref = hold.tokens if hold is not None else 0
        return (job.total - by_ref) * self.engine.token_nbytes()

    def unhold(self, request_id: str) -> None:
        hold = self.held.pop(request_id, None)
        if hold is not None:
            self.prefix.release(hold.lease)

    def keeps_kv(self, req: PrefillRequest) -> bool:
        """Whether this worker decodes what it prefills for `req` (colocated)."""
        return req.decode_worker == self.worker_id and self.colocated

    # ------------------------------------------------------------ the end --
    def finish_prefill(self, req: PrefillRequest, job, result) -> None:
        """A prompt is prefilled: its first token out, then its KV handed
        off (or kept, colocated) and its new blocks stored."""
        first = result.first_token
        finish = first_token_finishes(first, job.sampling, budget=job.budget)  # a resumed request: what it has left
        local = finish is not None or self.keeps_kv(req)
        if local:
            self.unhold(req.request_id)  # a batch's row that ended at its first token
        handoff = None  # None: the KVHandoff follows PrefillDone
        if local:  # nothing to hand over, or the KV stays in this process
            handoff = KVHandoff(req.request_id, result.num_tokens, result.rope_offset, local=True)
            if finish is None:
                self.local_kv[req.request_id] = result.cache
        self.outbox.send(PrefillDone(req.request_id, first, handoff, result.logprob, finish,
                                     result.prefill_ms, cached_tokens=result.cached_tokens,
                                     images_encoded=getattr(job, "encoded", 0),
                                     images_cached=getattr(job, "skipped", 0),
                                     encode_s=getattr(job, "encode_s", 0.0)))
        # The first token is on its way; the KV copy to the arena follows
        # (with a store thread, the copy itself is that thread's: `staged`;
        # a group's is done before its ranks gather their parts).
        staged = [] if self.stores is not None and self.group is None else None
        if not local:
            if req.request_id in self.held:  # a batch's row: leased before its pass
                hold = self.held.pop(req.request_id)
            else:
                with part(self.clock, "hold blocks", job.parts):
                    hold = self.hold_blocks(req, job, result.cache, result.num_tokens)
            with part(self.clock, "hand off", job.parts):
                handoff = self.hand_off(req, result, hold, staged)
        self.store_and_send(req, job, None if local else handoff, staged)
        log.debug("prefill %s: %d tokens, %d cached, %.1f ms to the first token (%s)", req.request_id,
                  result.num_tokens, result.cached_tokens, result.prefill_ms, tally_line(job.parts))

    def store_and_send(self, req: PrefillRequest, job, handoff: Optional[KVHandoff], staged: Optional[list]) -> None:
        """The prompt's new blocks, then its handoff (None: colocated, nothing
        to send).

        The blocks come from the handoff's tail, in host memory (a host copy,
        not another transfer from the device), before the handoff is sent,
        after which a decode worker may free the tail and another prefill
        worker reuse it. The tail's copy, the blocks' copy and the commit,
        and then the handoff, are the store thread's when there is one; so
        is a colocated prompt's blocks' copy (from device copies: on an H100
        swarm ~29 ms a prompt on the MLX thread)."""
        later = []
        with part(self.clock, "store", job.parts):
            self.after_reply("prefix store", lambda: job.save_prefix(
                host=None if handoff is None else self.handoff_tail(handoff),
                later=later.append if self.stores else None))
        prepared = later[0] if later else None
        kept = prepared.kept if prepared is not None else []
        if staged:
            copy, held = staged[0]
            self.stores.submit(prepared, handoff, copy=copy, keep=list(held) + kept, failed=RequestFailed(
                req.request_id, "the KV handoff could not be written to shared memory", 500))
        elif prepared is not None:
            self.stores.submit(prepared, handoff, keep=kept)
        elif handoff is not None:
            self.outbox.send(handoff)

    def after_reply(self, what: str, fn) -> None:
        """Work done after the client's answer is on its way: a failure is
        logged, never reported (the request already succeeded)."""
        try:
            fn()
        except Exception:  # noqa: BLE001
            log.exception("%s failed in worker %s", what, self.worker_id)

    # ------------------------------------------------------------ handoff --
    def hold_blocks(self, req: PrefillRequest, job, cache, num_tokens: int) -> Optional[HeldBlocks]:
        """For a handoff by reference: lease the prompt's leading full blocks
        that the cache service already has (its cached prefix, mostly) for the
        request. The decode worker takes most of them from its own memory (a
        swarm's system prompt, the conversation it answered last turn), so
        only the rest crosses the arena, in the handoff's tail. The prompt's
        new blocks are stored from that tail (store_and_send), not before it
        is written: storing them first copied them off the device twice, and
        put a reserve, a copy and a commit (~15 ms on the H100) between every
        first token and its decode. A prompt with images is held under its
        image-aware block keys. None when the handoff must carry all the KV:
        no prefix cache, a cache that holds no blocks or is not plain KV
        (Gemma 3's sliding window), or a handoff by value (another host's
        decode worker cannot take this host's blocks)."""
        if (self.prefix is None or req.kv_by_value or not is_plain_kv(cache)
                or len(req.prompt_tokens) != num_tokens):
            return None
        hold = self.prefix.hold(req.prompt_tokens, owner=req.request_id, lease_s=kv_handoff.HANDOFF_TTL_S,
                                per_block=getattr(job, "per_block", None), salt=req.cache_salt)
        return hold if hold.hashes else None

    def hand_off(self, req: PrefillRequest, result, hold: Optional[HeldBlocks] = None,
                 staged: Optional[list] = None) -> KVHandoff:
        """Put the prompt's KV in the arena (workers/kv/handoff.py
        write_handoff), after `hold`'s blocks only when given; or, for a
        decode worker on another host (`kv_by_value`) or when the arena has
        no room (write_handoff_anyway), in the message. A
        group's rank writes its own part and learns the others'
        (workers/group/handoff_shards.py)."""
        release = self.prefix.release if self.prefix is not None else (lambda lease: None)
        if self.group is None:  # by value when asked, or when the arena has no room (a group's ranks must agree)
            return kv_handoff.write_handoff_anyway(self.cache, self.arena_buf, req.request_id, result, hold,
                                                   staged, release_held=release, by_value=req.kv_by_value)
        if req.kv_by_value:  # the router never asks a group for it (router/routing/handoff_route.py)
            raise ValueError("a worker group hands its KV off through this host's arena, rank by rank, "
                             "not by value")

        def write():  # this rank's part, through the arena
            return kv_handoff.write_handoff(self.cache, self.arena_buf, req.request_id, result, hold, staged,
                                            release_held=release)

        return handoff_shards.hand_off(self.group, write, lambda h: kv_handoff.give_back(self.cache, h))

    def handoff_tail(self, h: KVHandoff):
        return kv_handoff.handoff_tail(h, self.arena_buf)
