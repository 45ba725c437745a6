"""The decode role: handed-off prompts in, a token per request per step out.

A DecodeRequest's KV comes from this process (`local_kv`, --colocate) or
from the arena and the prefix cache (workers/kv/handoff.py take_in); the
request then joins the batch (workers/decode/engine.py), which the Worker
loop steps between other units of MLX work.

On MLX's CUDA backend a handoff's copy into managed memory is ~8 ms that the
decode loop would otherwise stand still for, so a `reader` thread makes it
(workers/kv/handoff.py start_copy: array creation alone, which CUDA's
allocator locks for) while the batch steps: DecodeRequests wait in
`reading`, in arrival order, with the copy's future (None: nothing to copy),
and join once it is done. Elsewhere MLX stays on one thread (Metal crashes
when two threads touch it) and the copy is ~1 ms on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from concurrent.futures import wait as wait_for
from typing import Callable

from protos.messages import DecodeRequest, KVHandoff, RequestFailed, TokenBatch
from workers.group.handoff_shards import own_part
from workers.kv import handoff as kv_handoff
from workers.role import Role, Unit

log = logging.getLogger(__name__)

# A handoff's copy on the reader thread takes milliseconds; past this the
# request fails rather than hold the decode loop.
HANDOFF_READ_S = 30.0


class DecodeRole(Role):
    """A worker's decode: `engine` (a DecodeEngine) over the requests it is
    sent, with `prefix` (the prefix cache held blocks come from, or None),
    `cache` (a CacheClient: frees handoff slots, releases leases),
    `arena_buf` (arena name -> its buffer), `local_kv` (request id -> KV,
    filled by this process's PrefillRole when colocated) and `reader` (a
    one-thread executor for handoff copies, or None). `rank`: (rank, size) of
    a decode group, whose every rank reads its own part of a handoff
    (workers/group/handoff_shards.py); (0, 1) alone. `max_batch`: the
    settings' decode batch, which the power policy lowers, never raises."""

    def __init__(self, engine, *, worker_id: str, prefix, cache, arena_buf: Callable[[str], object], outbox,
                 clock, local_kv: dict, reader=None, fail=None, rank: tuple = (0, 1),
                 max_batch: int = 0):
        super().__init__(worker_id, outbox, clock, fail)
        self.engine = engine
        self.prefix = prefix
        self.cache = cache
        self.arena_buf = arena_buf
        self.local_kv = local_kv
        self.reader = reader
        self.rank = rank
        self.max_batch = max_batch
        self.read_unit = Unit("reads", self.take_reads)
        self.step_unit = Unit("decode", lambda wait: self.step(), shared=self.step_costs)
        self.paused_s = 0.0  # the last pass's pace wait
        self.reading: deque[tuple] = deque()  # (DecodeRequest, its copy's future or None), arrival order
        self.pace_s = 0.0  # seconds a token at least (the power policy's pace); 0: unpaced
        self.last_step_tokens = 1  # the most tokens one request got from the last step
        self.last_step = 0.0  # time.monotonic() of the last step

    # ------------------------------------------------------------ the loop --
    def handle(self, msg: DecodeRequest) -> None:
        self.read_handoff(own_part(msg, *self.rank))

    def has_work(self) -> bool:
        return bool(self.reading or self.engine.has_work)

    @property
    def running(self) -> int:
        return self.engine.running

    @property
    def waiting(self) -> int:
        return len(self.reading) + self.engine.waiting

    def units(self, busy_elsewhere):
        """The handoffs whose copies are done (waiting for them when nothing
        else has work), then a decode step unless the pace holds it back."""
        self.paused_s = 0.0
        if self.reading:
            yield self.read_unit.waiting(not (self.engine.has_work or busy_elsewhere()))
        if self.engine.has_work:
            delay = self.pace_delay()
            if delay > 0:
                self.paused_s = delay
            else:
                yield self.step_unit

    def unit_kinds(self) -> list[Unit]:
        return [self.read_unit, self.step_unit]

    def pause_s(self) -> float:
        return self.paused_s

    def step_costs(self):
        """What a step may speculate by (workers/decode/speculation.py
        StepCosts, timed on this rank), or None."""
        spec = self.engine.speculation
        return spec.costs if spec is not None else None

    def limit(self, limits) -> str:
        """A smaller batch lets the rows beyond it finish; none join until below."""
        pace = limits.pace_tokens_per_s
        self.engine.max_batch = max(1, min(limits.max_batch, self.max_batch))
        self.pace_s = 1.0 / pace if 0.0 < pace < 1e6 else 0.0
        return f"decode batch {self.engine.max_batch}, pace {f'{pace:g} tok/s' if self.pace_s else 'off'}"

    def report(self, hello) -> None:
        hello.kv_bytes, hello.max_batch = self.engine.kv_bytes, self.engine.max_batch
        spec = self.engine.speculation
        if spec is not None:
            hello.spec_method, hello.spec_proposed, hello.spec_accepted = spec.method, spec.proposed, spec.accepted

    def set_clock(self, clock) -> None:
        self.clock = self.engine.clock = clock

    def cancel(self, request_id: str, save: bool = True) -> None:
        """A decoding request's KV goes to the prefix cache (unless `save` is
        False: its batch is suspect); one still waiting for its copy gives its
        handoff back."""
        dropped = [req for req, _ in self.reading if req.request_id == request_id]
        if dropped:
            self.reading = deque(e for e in self.reading if e[0].request_id != request_id)
            self.drop_handoff(dropped[0].handoff)
        self.engine.cancel(request_id, save=save)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------ handoffs --
    def read_handoff(self, req: DecodeRequest) -> None:
        """Start a decode request, or with a reader thread queue it behind
        the copy of its handoff (and behind those queued before it)."""
        copies = kv_handoff.start_copy(self.reader, self.arena_buf, req.handoff)
        if copies is None and not self.reading:  # nothing to copy, and nothing queued before it
            self.guarded(req.request_id, self.start_decode, req)
            return
        self.reading.append((req, copies))

    def take_reads(self, wait: bool) -> None:
        """Start the queued decode requests whose copies are done, in order;
        with `wait`, wait for them (the loop has nothing else to do)."""
        while self.reading:
            req, copies = self.reading[0]
            if copies is not None and not copies.done():
                if not wait:
                    return
                with self.clock.phase("wait"):
                    wait_for([copies], timeout=HANDOFF_READ_S)
            self.reading.popleft()
            with self.clock.phase("handle DecodeRequest"):
                self.guarded(req.request_id, self.start_decode, req, copies)

    def drop_handoff(self, h: KVHandoff) -> None:
        kv_handoff.give_back(self.cache, h)

    def start_decode(self, req: DecodeRequest, copies=None) -> None:
        """Take a request's KV (colocated, from the arena, or `copies`: the
        reader thread's future of copy_kv) and add it to the decode batch."""
        h = req.handoff
        if h.local:
            cache = self.local_kv.pop(req.request_id, None)
            if cache is None:
                raise RuntimeError("colocated KV for this request is gone (cancelled or never prefilled here)")
        else:
            cache = kv_handoff.take_in(h, self.cache, self.arena_buf, self.prefix, self.clock, copies)
        with self.clock.part("add"):
            self.engine.add(req, cache)

    # -------------------------------------------------------------- a step --
    def pace_delay(self) -> float:
        """Seconds until the paced batch may step again (0: now)."""
        if not self.pace_s:
            return 0.0
        return max(0.0, self.last_step + self.pace_s * self.last_step_tokens - time.monotonic())

    def step(self) -> None:
        self.last_step = time.monotonic()
        try:
            with self.clock.phase("decode step"):
                updates = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a broken batch fails its requests, not the worker
            log.exception("decode step failed in worker %s", self.worker_id)
            ended = self.engine.abandon_commits()  # finished before the failure: their answers stand
            if ended:
                self.outbox.send(TokenBatch(ended))
            for rid in self.engine.request_ids():
                self.engine.cancel(rid, save=False)
                self.outbox.send(RequestFailed(rid, f"decode failed: {type(exc).__name__}: {exc}", 500))
            return
        # A request's last token comes back from step() only once its KV is
        # committed to the prefix cache (workers/decode/engine.py): an agent sends
        # its next turn the moment it has the answer, and that turn must find
        # the answer's blocks.
        self.clock.count("tokens", len(updates))
        if self.pace_s:  # a speculative step gives a row several tokens: the pace is per token
            self.last_step_tokens = max(Counter(u.request_id for u in updates).values(), default=1)
        if updates:
            self.outbox.send(TokenBatch(updates))
        for request_id, exc in self.engine.take_failures():  # a token its grammar refused: that request alone
            self.fail(request_id, exc)
