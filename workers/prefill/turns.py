"""Whose turn it is to prefill: the prefill role's order over its prompts
(workers/prefill/role.py), so that a short prompt never waits for a long one's
whole prefill, and a long one loses at most a set share of its own time to
the prompts that overtake it.

Prompts arrive in `queue`. A prompt whose job has started (its cache made, its
cached prefix loaded: PrefillJob, or VLMPrefillJob with images) is in `started`
until it finishes, fails or is cancelled, each with its own cache, so any of
them can run its next chunk in any step. Each step of the role runs one chunk of
one prompt (a prompt whose new tokens fit one chunk runs whole, and on a GPU
short text prompts run as one batched pass: workers/prefill/batch.py), and
`pick` says which:

* shortest remaining first: the fewest tokens left to compute (a started
  prompt: after its cached prefix and the chunks run; a queued one: its whole
  length, its cached prefix unknown until it starts), the first to arrive
  among equals. A "Say hi" sent while a 6k-token prompt prefills waits for
  the chunk in progress, not for the other ~11; two long prompts run one
  after the other, not alternately (alternating would make both late). Each
  step first starts the oldest queued prompt while there is room
  (`next_to_start`; a text prompt's cached prefix is loaded then), so a
  follow-up turn of a long conversation counts only its new tail;
* overtakes are paid for in time: every step is timed (`timed`; a queued
  prompt started in it counts with it), its seconds are the own time of
  the prompt it ran, and they are charged to each waiting prompt that
  arrived before it. A prompt charged for more than `OVERTAKE_SHARE` of its
  own time so far is owed (`owed`): it runs next (the oldest such first)
  until its own time pays for what it lost. So a long prompt's prefill takes
  at most (1 + OVERTAKE_SHARE) x its time alone, plus the one overtake that
  crossed the line, however many short prompts come, and a batched pass of
  sixteen short prompts (about one short one's time on a GPU) costs it what
  one does. The first overtake of a prompt never waits (the budget is
  checked before it, not for it), so a short prompt beside a long one waits
  for the step in progress; once the budget is spent, it also waits for each
  earlier prompt that is owed to earn its debt back: the last overtake's
  time / OVERTAKE_SHARE of its chunks (short prompts that arrive meanwhile
  then go in one batched pass). On an H200 a short prompt costs about what a
  512-token chunk does (25-45 ms): a long prompt keeps ~6 chunks per short
  one once its budget is spent (BENCHMARKS.md, "Fair prefill");
* at most `MAX_STARTED` prompts started at once (each holds its KV so far);
  when that many are, only prompts that fit one chunk whole may start.

Times are what rank 0 of a worker group measured: it sends its `state()` with
each prefill step and the other ranks `load` it before theirs
(workers/group/members.py, as a decode step's costs), so every rank steps the
same prompt in the same step. A prompt alone is never held back: nothing
overtakes it.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from protos.messages import PrefillRequest

# Later prompts may delay a prompt by at most this share of its own prefill
# time (plus the overtake that crosses it): issue 42's goal is 1.2x its TTFT
# alone, and the rest is left for that last overtake and the loop's own work.
OVERTAKE_SHARE = 0.15
MAX_STARTED = 4  # prompts started and not finished (their KV held), beyond those that fit one chunk


class Turn:
    """A started prompt: its request and job (`remaining`: tokens left to compute)."""

    __slots__ = ("req", "job")

    def __init__(self, req: PrefillRequest, job):
        self.req, self.job = req, job

    @property
    def request_id(self) -> str:
        return self.req.request_id


class Turns:
    """The prompts of one prefill role, queued and started, and whose turn it
    is. `chunk_size`: the role's prefill chunk (a prompt within it runs whole);
    `clock`: seconds, for timing steps (tests pass a fake one)."""

    def __init__(self, chunk_size: int, share: float = OVERTAKE_SHARE, max_started: int = MAX_STARTED,
                 clock: Callable[[], float] = time.perf_counter):
        self.chunk_size = chunk_size
        self.share = share
        self.max_started = max_started
        self.clock = clock
        self.queue: deque[PrefillRequest] = deque()  # arrived, not started
        self.started: dict[str, Turn] = {}  # request id -> its turn, in the order they started
        self._arrival: dict[str, int] = {}  # request id -> arrival number (first seen in `queue`)
        self._own: dict[str, float] = {}  # request id -> seconds of steps run for it
        self._overtaken: dict[str, float] = {}  # request id -> seconds of later prompts' steps it waited for
        self._arrivals = 0

    def __bool__(self) -> bool:
        return bool(self.queue or self.started)

    def add(self, req: PrefillRequest) -> None:
        """`req` arrived: queued, numbered in arrival order."""
        self.queue.append(req)
        self._arrival.setdefault(req.request_id, self._arrivals)
        self._arrivals += 1

    # ------------------------------------------------------------ the pick --
    def pick(self) -> PrefillRequest | Turn:
        """Whose turn it is: a started prompt (its Turn) or a queued one (its
        request, for the caller to `start`). Only when there is work."""
        candidates = list(self._candidates())
        owed = [c for c in candidates if self.owed(self._id(c))]
        if owed:
            return min(owed, key=self._arrived)
        return min(candidates, key=lambda c: (self.remaining(c), self._arrived(c)))

    def owed(self, request_id: str) -> bool:
        """Whether later prompts have taken more than their share of
        `request_id`'s time: then it runs before them."""
        return self._overtaken.get(request_id, 0.0) > self.share * self._own.get(request_id, 0.0)

    @contextmanager
    def timed(self, ran: PrefillRequest | Turn, since: Optional[float] = None):
        """Time the step run for `ran` (a chunk, a batched pass it leads),
        from `since` (the step's start, a queued prompt started then
        included; None: now): the seconds are its own, and each waiting
        prompt that arrived before it is charged them. Charged only once the
        step is over, so every rank of a group picks on rank 0's times."""
        rid = self._id(ran)
        mine = self._arrival.get(rid)
        t0 = self.clock() if since is None else since
        try:
            yield
        finally:
            self.took(rid, mine, self.clock() - t0)

    def took(self, rid: str, arrived: Optional[int], seconds: float) -> None:
        """`rid` (arrival number `arrived`) ran for `seconds`."""
        if rid in self._arrival:  # still waiting (not finished, failed or cancelled)
            self._own[rid] = self._own.get(rid, 0.0) + seconds
        if arrived is None:
            return
        for c in self._waiting():
            other = self._id(c)
            if other != rid and self._arrival[other] < arrived:
                self._overtaken[other] = self._overtaken.get(other, 0.0) + seconds

    def remaining(self, c: PrefillRequest | Turn) -> int:
        """Tokens left to compute: a started job's own count, a queued prompt's length."""
        return c.job.remaining if isinstance(c, Turn) else len(c.prompt_tokens)

    def next_to_start(self) -> Optional[PrefillRequest]:
        """The queued prompt to start now, before any pick, so that its
        cached prefix is known when the turns are weighed (a follow-up turn of
        a long conversation is long but has only its tail to compute): the
        first to arrive, while fewer than `max_started` are started."""
        return self.queue[0] if self.queue and len(self.started) < self.max_started else None

    def may_start(self, req: PrefillRequest) -> bool:
        """Whether `req` may start now: fewer than `max_started` prompts hold
        their KV, or it fits one chunk whole."""
        return len(self.started) < self.max_started or len(req.prompt_tokens) <= self.chunk_size

    # ------------------------------------------------------------- moves --
    def start(self, req: PrefillRequest, job) -> Turn:
        """`req` leaves the queue with its `job` (made, its prefix maybe loaded)."""
        for i, r in enumerate(self.queue):
            if r is req:
                del self.queue[i]
                break
        turn = self.started[req.request_id] = Turn(req, job)
        return turn

    def drop(self, request_id: str) -> Optional[Turn]:
        """`request_id` is finished, failed or cancelled: forgotten, its job
        (and the KV it holds) with it. Its Turn, if it had started."""
        if any(r.request_id == request_id for r in self.queue):
            self.queue = deque(r for r in self.queue if r.request_id != request_id)
        self._arrival.pop(request_id, None)
        self._own.pop(request_id, None)
        self._overtaken.pop(request_id, None)
        return self.started.pop(request_id, None)

    def first_started(self) -> Optional[Turn]:
        return next(iter(self.started.values()), None)

    # ------------------------------------------------ a group's shared times --
    def state(self) -> list:
        """The times measured so far, as msgpack-ready lists: a group's rank
        0 sends them with each prefill step (workers/group/members.py)."""
        return [[rid, self._own.get(rid, 0.0), self._overtaken.get(rid, 0.0)]
                for rid in self._arrival if rid in self._own or rid in self._overtaken]

    def load(self, state: list) -> None:
        """Take rank 0's `state()`: this rank's picks are rank 0's from now."""
        self._own = {rid: float(own) for rid, own, _ in state if own}
        self._overtaken = {rid: float(lost) for rid, _, lost in state if lost}

    # ------------------------------------------------------------ helpers --
    def _candidates(self) -> Iterator[PrefillRequest | Turn]:
        yield from self.started.values()
        for req in self.queue:
            if self.may_start(req):
                yield req

    def _waiting(self) -> Iterator[PrefillRequest | Turn]:
        yield from self.started.values()
        yield from self.queue

    @staticmethod
    def _id(c: PrefillRequest | Turn) -> str:
        return c.request_id

    def _arrived(self, c: PrefillRequest | Turn) -> int:
        """`c`'s arrival number (given by `add`)."""
        return self._arrival[self._id(c)]
