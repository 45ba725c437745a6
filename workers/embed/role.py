"""The embed role: EmbedRequests in, one EmbedResult each (workers/embed/engine.py
runs the passes).

Every queued input, whichever request it belongs to, waits in one queue in
arrival order; each unit runs ONE forward pass over as many of the first
inputs as fit `tokens_per_pass` (padded to the longest), so several requests'
inputs share a pass and the loop is back for messages and heartbeats after
every pass. An input longer than a pass (a decoder's) runs alone, a pass per
unit. A request's result goes once its last input is done, its vectors cut
to `dimensions` there. An embedding model's worker holds this role alone
(environment/settings.py worker_plan): embeddings never share a process, or
a step, with a chat model's decode.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from protos.messages import EmbedRequest, EmbedResult, RequestFailed
from workers.embed.engine import EmbedEngine, Long, cut
from workers.role import Role, Unit

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    req: EmbedRequest
    vectors: list = field(default_factory=list)  # by input index; None until done
    left: int = 0
    passes: int = 0


@dataclass
class _Input:
    request_id: str
    index: int
    tokens: list[int]


class EmbedRole(Role):
    def __init__(self, engine: EmbedEngine, *, worker_id: str, outbox, clock, fail=None):
        super().__init__(worker_id, outbox, clock, fail)
        self.engine = engine
        self.pending: dict[str, _Pending] = {}
        self.queue: deque[_Input] = deque()
        self.long: Optional[tuple[_Input, Long]] = None  # the long input in progress
        self.passes = 0  # forward passes run, since start
        self.unit = Unit("embed", self.timed_step)

    def handle(self, msg: EmbedRequest) -> None:
        why = self.refusal(msg)
        if why:  # the router checks these first: a backstop, a 400 all the same
            self.outbox.send(RequestFailed(msg.request_id, why, 400))
            return
        self.pending[msg.request_id] = _Pending(msg, [None] * len(msg.inputs), len(msg.inputs))
        self.queue.extend(_Input(msg.request_id, i, list(t)) for i, t in enumerate(msg.inputs))

    def refusal(self, msg: EmbedRequest) -> str:
        if not msg.inputs or not all(msg.inputs):
            return "every input must have at least one token"
        if not 0 <= min(min(t) for t in msg.inputs) <= max(max(t) for t in msg.inputs) < self.engine.vocab:
            return f"token ids must be within the model's vocabulary (0-{self.engine.vocab - 1})"
        if msg.dimensions and not self.engine.matryoshka:
            return "this model does not support 'dimensions'"
        if msg.dimensions < 0 or msg.dimensions > self.engine.width:
            return f"'dimensions' must be between 1 and {self.engine.width}"
        return ""

    def has_work(self) -> bool:
        return bool(self.queue) or self.long is not None

    @property
    def running(self) -> int:
        """Requests with an input embedded or in progress."""
        in_long = self.long[0].request_id if self.long is not None else None
        return sum(1 for rid, p in self.pending.items() if p.left < len(p.vectors) or rid == in_long)

    @property
    def waiting(self) -> int:
        return len(self.pending) - self.running

    def units(self, busy_elsewhere):
        if self.has_work():
            yield self.unit

    def unit_kinds(self) -> list[Unit]:
        return [self.unit]

    def timed_step(self, wait: bool = False) -> None:
        with self.clock.phase("embed"):
            self.step()

    def step(self) -> None:
        """One forward pass: the long input's next part, or a batch of the first queued inputs."""
        if self.long is None and self.queue and self.engine.runs_long(len(self.queue[0].tokens)):
            item = self.queue.popleft()
            self.long = (item, self.engine.start_long(item.tokens))
        if self.long is not None:
            item, long = self.long
            self._run([item], lambda: self.engine.step_long(long))
            return
        n = self.engine.batch_size([len(i.tokens) for i in self.queue if not self.engine.runs_long(len(i.tokens))])
        batch = []
        while self.queue and len(batch) < n and not self.engine.runs_long(len(self.queue[0].tokens)):
            batch.append(self.queue.popleft())
        self._run(batch, lambda: self.engine.embed([i.tokens for i in batch]))

    def _run(self, items: list[_Input], forward) -> None:
        """Run one pass; a failure fails every request with an input in it."""
        self.passes += 1
        t0 = time.perf_counter()
        try:
            vectors = forward()
        except Exception as exc:  # noqa: BLE001 - the requests fail, never the process
            self.long = None
            for rid in dict.fromkeys(i.request_id for i in items):
                self.fail(rid, exc)
            return
        log.debug("embed pass of %d input(s), %d tokens: %.1f ms", len(items), sum(len(i.tokens) for i in items),
                  (time.perf_counter() - t0) * 1000)
        if vectors is None:  # a long input's pass that was not its last
            self.pending[items[0].request_id].passes += 1
            return
        self.long = None
        for rid in dict.fromkeys(i.request_id for i in items):
            self.pending[rid].passes += 1
        for item, vector in zip(items, vectors):
            p = self.pending[item.request_id]
            p.vectors[item.index] = vector
            p.left -= 1
            if p.left == 0:
                self._finish(p)

    def _finish(self, p: _Pending) -> None:
        del self.pending[p.req.request_id]
        vectors = cut(np.stack(p.vectors), p.req.dimensions)
        self.outbox.send(EmbedResult(p.req.request_id, np.ascontiguousarray(vectors, dtype=np.float32),
                                     sum(len(t) for t in p.req.inputs), p.passes))

    def cancel(self, request_id: str, save: bool = True) -> None:
        if self.pending.pop(request_id, None) is None:
            return
        self.queue = deque(i for i in self.queue if i.request_id != request_id)
        if self.long is not None and self.long[0].request_id == request_id:
            self.long = None
