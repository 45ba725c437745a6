"""What the Worker loop (workers/worker.py) asks of each role a process holds
(workers/prefill/role.py, workers/decode/role.py, workers/vision/role.py):
take a request, say whether work waits, drop a request, count the load; and
how a role's unit of work fails one request, never the process.

A role gets everything it uses in its constructor (engine, prefix cache,
cache client, arena, outbox, clock, ...), so a test builds one alone, with
fakes, and drives it as the loop would.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from cache_service.client import CacheUnavailable
from protos.messages import RequestFailed

log = logging.getLogger(__name__)


def request_failed(request_id: str, exc: Exception) -> RequestFailed:
    """What the router hears of a request that `exc` broke: a cache service
    away is a 503 (try again), anything else a 500."""
    status = 503 if isinstance(exc, CacheUnavailable) else 500
    return RequestFailed(request_id, f"{type(exc).__name__}: {exc}", status)


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
