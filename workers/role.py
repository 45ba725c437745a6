"""What the Worker loop (workers/worker.py) asks of each role a process holds
(workers/prefill/role.py, workers/decode/role.py, workers/vision/role.py,
workers/warm_up.py): take a request, say whether work waits, offer the
units of MLX work due now, drop a request, take the power policy's limits,
report its load; and how a role's unit of work fails one request, never
the process.

A unit is an object (`Unit`), not a name the loop dispatches on: the loop
runs what a role offers, and a group's rank 0 records each unit by its name
for the other ranks, which run the same role's unit of that name
(workers/group/members.py).

A role gets everything it uses in its constructor (engine, prefix cache,
cache client, arena, outbox, clock, ...), so a test builds one alone, with
fakes, and drives it as the loop would.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

from cache_service.client import CacheUnavailable
from protos.messages import RequestFailed

log = logging.getLogger(__name__)


def request_failed(request_id: str, exc: Exception) -> RequestFailed:
    """What the router hears of a request that `exc` broke: a cache service
    away is a 503 (try again), anything else a 500."""
    status = 503 if isinstance(exc, CacheUnavailable) else 500
    return RequestFailed(request_id, f"{type(exc).__name__}: {exc}", status)


@dataclass(frozen=True)
class Unit:
    """One unit of MLX work a role offers the loop (one prefill chunk, one
    decode step, ...). `run(wait)`; `wait`: whether it may wait for what it
    needs (the decode role's handoff reads, when the loop has nothing else
    to do). `shared`: for a unit whose run hangs on what rank 0 decided by
    time, the object holding that decision (state() / load(): a decode
    step's speculative step costs), which a group's followers load."""

    name: str  # the logs' and a group's records' name for it
    run: Callable[[bool], None]
    wait: bool = False
    shared: Optional[Callable[[], object]] = None

    def __call__(self) -> None:
        self.run(self.wait)

    def waiting(self, wait: bool) -> "Unit":
        return replace(self, wait=wait)


class Role:
    """One capability of a worker process. `fail` (request id, exception)
    drops a broken request: the Worker's drops it from every role it holds;
    without one (a role on its own) it is dropped here."""

    def __init__(self, worker_id: str, outbox, clock, fail: Optional[Callable[[str, Exception], None]] = None):
        self.worker_id = worker_id
        self.outbox = outbox  # workers.socket_loop.Outbox: send() to the router, any thread
        self.clock = clock  # workers.loop_clock.LoopClock: the Worker's (replaced when it starts serving)
        self.fail = fail or self.fail_here

    def handle(self, msg) -> None:
        """Take a request of this role's kind."""
        raise NotImplementedError

    def has_work(self) -> bool:
        return False

    def units(self, busy_elsewhere: Callable[[], bool]) -> Iterator[Unit]:
        """The units due now, in order; the loop runs each before asking for
        the next. `busy_elsewhere()`: whether another role has work."""
        return iter(())

    def unit_kinds(self) -> list[Unit]:
        """Every unit this role may offer: a group's followers find rank 0's by name."""
        return []

    def pause_s(self) -> float:
        """After `units`: how long the loop may wait for messages before this
        role's deferred work is due (the power policy's decode pace); 0: none."""
        return 0.0

    def limit(self, limits) -> str:
        """Take the power policy's limits (protos.messages.WorkerLimits),
        never above the settings'; what they are now, in words ("": none)."""
        return ""

    def report(self, hello) -> None:
        """This role's part of the heartbeat (protos.messages.WorkerHello)
        beyond running and waiting."""

    def set_clock(self, clock) -> None:
        self.clock = clock

    def cancel(self, request_id: str, save: bool = True) -> None:
        """Drop a request wherever it is in this role (`save`: its KV may
        still go to the prefix cache)."""

    @property
    def running(self) -> int:
        return 0

    @property
    def waiting(self) -> int:
        return 0

    def guarded(self, request_id: str, fn, *args) -> None:
        """Run one unit of work; a failure fails that request, never the process."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure must reach the client
            self.fail(request_id, exc)

    def fail_here(self, request_id: str, exc: Exception) -> None:
        log.error("request %s failed in worker %s", request_id, self.worker_id, exc_info=exc)
        self.cancel(request_id, save=False)
        self.outbox.send(request_failed(request_id, exc))
