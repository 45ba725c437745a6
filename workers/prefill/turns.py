"""Whose turn it is to prefill: the prefill role's order over its prompts
(workers/prefill/role.py), so that a short prompt never waits for a long one's
whole prefill.

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
* anti-starvation: a prompt passed over for one that arrived after it
  `OVERTAKE_LIMIT` times in a row runs next (the oldest such first), so a
  stream of shorter prompts slows a long one to at worst one chunk in
  `OVERTAKE_LIMIT + 1` steps, never stops it;
* at most `MAX_STARTED` prompts started at once (each holds its KV so far);
  when that many are, only prompts that fit one chunk whole may start.

The order depends only on what every rank of a worker group sees alike (the
order requests arrived in, the chunks run, the cached prefixes, which the ranks
agree on: workers/group/prefix_agreement.py), never on time, so every rank
steps the same prompt in the same step (workers/group/members.py replays rank
0's units by name).
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Optional

from protos.messages import PrefillRequest

OVERTAKE_LIMIT = 4  # later prompts run before an earlier one at most this many steps in a row
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
    is. `chunk_size`: the role's prefill chunk (a prompt within it runs whole)."""

    def __init__(self, chunk_size: int, overtake_limit: int = OVERTAKE_LIMIT, max_started: int = MAX_STARTED):
        self.chunk_size = chunk_size
        self.overtake_limit = overtake_limit
        self.max_started = max_started
        self.queue: deque[PrefillRequest] = deque()  # arrived, not started
        self.started: dict[str, Turn] = {}  # request id -> its turn, in the order they started
        self._arrival: dict[str, int] = {}  # request id -> arrival number (first seen in `queue`)
        self._overtaken: dict[str, int] = {}  # request id -> steps later prompts ran before it, in a row
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
        starving = [c for c in candidates if self._overtaken.get(self._id(c), 0) >= self.overtake_limit]
        if starving:
            return min(starving, key=self._arrived)
        return min(candidates, key=lambda c: (self.remaining(c), self._arrived(c)))

    def took(self, ran: PrefillRequest | Turn) -> None:
        """`ran` has this step: the prompts that arrived before it and wait
        count one more overtaking; its own count starts again."""
        mine = self._arrived(ran)
        self._overtaken.pop(self._id(ran), None)
        for c in self._waiting():
            if self._id(c) != self._id(ran) and self._arrived(c) < mine:
                self._overtaken[self._id(c)] = self._overtaken.get(self._id(c), 0) + 1

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
        self._overtaken.pop(request_id, None)
        return self.started.pop(request_id, None)

    def first_started(self) -> Optional[Turn]:
        return next(iter(self.started.values()), None)

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
