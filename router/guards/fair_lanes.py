"""Threads shared fairly between callers: the lanes that parse and tokenize
requests (router/guards/admission.py).

A plain thread pool runs jobs in the order they come: one caller sending
eighteen 1 MiB bodies at once put a 4-token chat behind all of their
tokenization (70 s instead of 2). Here each caller has its own queue, and the
threads take the callers in turn, one job each (round-robin): a caller's job
waits for the jobs already running and at most one job of each other caller
with work queued, however many that caller has. A `count_tokens` request is
work of its caller like any other, so it takes no more than that caller's
turns.

The caller is the API key's tenant; without keys it is the client's address
(a connection carries one request at a time, so taking turns by connection
would be the arrival order again, and a flood from one host would get as
many turns as it opens connections).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Callable

from router.guards.cache_salt import tenant_of

IDLE_EXIT_S = 30.0  # a thread with no work this long ends; the next job starts one


def caller_of(request) -> str:
    """Whose turn a request's work takes: its API key's tenant, else its client's address."""
    tenant = tenant_of(request)
    if tenant:
        return "key:" + tenant
    client = request.scope.get("client")
    return "address:" + (str(client[0]) if client else "")


class FairLane:
    """Up to `threads` threads running jobs from per-caller queues, the callers
    served in turn. `initializer` runs first in each thread."""

    def __init__(self, threads: int, name: str, initializer: Callable[[], None] | None = None):
        self.max_threads = threads
        self.name = name
        self._initializer = initializer
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queues: dict[str, deque] = {}  # caller -> its jobs not yet started
        self._turns: deque[str] = deque()  # the callers with jobs queued, next served first
        self._queued = 0
        self._threads = 0
        self._idle = 0  # threads waiting for work

    def submit(self, caller: str, fn: Callable, *args, **kwargs) -> Future:
        """fn(*args, **kwargs) in one of the lane's threads, in `caller`'s turn.
        Cancelling the future before it starts drops the job."""
        future: Future = Future()
        with self._lock:
            queue = self._queues.get(caller)
            if queue is None:
                queue = self._queues[caller] = deque()
                self._turns.append(caller)
            queue.append((future, fn, args, kwargs))
            self._queued += 1
            if self._queued > self._idle and self._threads < self.max_threads:
                self._threads += 1
                threading.Thread(target=self._run, name=f"{self.name}-{self._threads}", daemon=True).start()
            self._work.notify()
        return future

    def queued(self, caller: str) -> int:
        """Jobs of `caller` not yet started."""
        with self._lock:
            return len(self._queues.get(caller, ()))

    def _next(self) -> tuple | None:
        """The next caller's first job; None when none came for IDLE_EXIT_S (the thread ends)."""
        with self._lock:
            while not self._turns:
                self._idle += 1
                woken = self._work.wait(IDLE_EXIT_S)
                self._idle -= 1
                if not woken and not self._turns:
                    self._threads -= 1
                    return None
            caller = self._turns.popleft()
            queue = self._queues[caller]
            job = queue.popleft()
            self._queued -= 1
            if queue:
                self._turns.append(caller)  # its next job after every other caller's
            else:
                del self._queues[caller]
            return job

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (job := self._next()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue  # its request gave up while it waited
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request as raised
                future.set_exception(exc)
            else:
                future.set_result(result)
            del job, future, fn, args, kwargs  # no reference kept while waiting for the next
