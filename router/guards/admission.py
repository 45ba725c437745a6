"""Admission: the one bound on the requests the router takes on, decided
before any heavy work, and the threads that heavy work runs in.

A request is admitted, or refused with 429 and `Retry-After`, right after
its body is read (bounded by --max-request-bytes) and before its JSON is
decoded, its media fetched, its chat template applied or its prompt
tokenized: a flood costs the router no more than reading it. Capacity: what
the decode batches hold (--max-batch per worker with the decode role) plus
--max-queue, the requests admitted beyond those (waiting for their template,
media, prefill or a decode slot). An admitted request holds its ticket until
it ends in any way (answered, refused while parsed, failed, its client gone),
and a thread still working for it holds it until that work ends.

The heavy work runs in a few threads, never on the event loop that sends
every stream's tokens. The tokenizers library releases the GIL while it
tokenizes (an 8 MiB prompt: ~11 s on a 2-core box), and json.loads of 8 MiB
of tiny values (~1 s) lets the loop in often enough; the threads run at a
lower priority than the loop and the workers. Bodies over LARGE_BODY_BYTES
have their own lane, so a few huge prompts never hold up an ordinary chat's
template.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from environment.power.policy import THERMAL_RETRY_AFTER_S
from environment.settings import Settings
from router.api.errors import ApiError

RETRY_AFTER_S = 1  # a slot frees when any admitted request ends: soon, under load
LARGE_BODY_BYTES = 1 << 20  # ~1.3 s of tokenization
SMALL_THREADS = 2
LARGE_THREADS = 1  # on a 2-core box the workers need the other core
THREAD_NICE = 10  # below the event loop and the workers (Linux)

T = TypeVar("T")


def capacity(settings: Settings) -> int:
    """Requests admitted at once: the decode batches' rows, plus max_queue."""
    decoders = sum(1 for _, roles in settings.worker_plan() if "decode" in roles)
    return settings.max_batch * decoders + settings.max_queue


def _yield_the_cpu() -> None:
    """A thread preparing prompts runs below the event loop and the model
    workers: on a 2-core box they would share cores with it, so every stream
    would slow while a huge prompt is tokenized. Linux keeps a nice value
    per thread; elsewhere the thread runs as any other."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), THREAD_NICE)
        except OSError:
            pass


class Admission:
    """Counts admitted requests against `capacity`; `timeout_s` bounds a
    request's wait for a thread."""

    def __init__(self, capacity: int, timeout_s: float):
        self.configured = capacity  # the settings' capacity
        self.capacity = capacity  # in force: the power policy may lower it (follow)
        self.refusing = ""  # why every new request is refused now (a critically hot machine), or ""
        self.timeout_s = timeout_s
        self.admitted = 0
        self.refused = 0  # since start
        # Rows of decode batches on other hosts (router/routing/worker_table.py remote_rows):
        # room remote workers add; the power policy caps only this machine's.
        self.remote_rows: Callable[[], int] = lambda: 0
        self._lanes = (ThreadPoolExecutor(SMALL_THREADS, "parse", initializer=_yield_the_cpu),
                       ThreadPoolExecutor(LARGE_THREADS, "parse-large", initializer=_yield_the_cpu))

    @classmethod
    def from_settings(cls, settings: Settings) -> "Admission":
        return cls(capacity(settings), settings.request_timeout_s)

    def follow(self, power) -> None:
        """Apply the power policy in force now and at every change (router/power_watch.py)."""
        self.apply_power(power.policy)
        power.listeners.append(self.apply_power)

    def apply_power(self, policy) -> None:
        """A environment.power.policy.PowerPolicy: its admission cap and whether it refuses new requests.
        Admitted requests are never dropped: a lower cap only refuses new ones until enough end."""
        self.capacity = min(self.configured, policy.max_admitted or self.configured)
        self.refusing = policy.reason if policy.refuse_new else ""

    def admit(self, body_bytes: int) -> "Ticket":
        """A ticket for a request of `body_bytes`; 429 when `capacity` are admitted
        or while the power policy refuses new requests."""
        if self.refusing:
            self.refused += 1
            raise ApiError(429, f"Server paused by its power policy: {self.refusing}; retry after "
                           f"{THERMAL_RETRY_AFTER_S} s", code="power_policy",
                           headers={"Retry-After": str(THERMAL_RETRY_AFTER_S)})
        if self.admitted >= self.capacity + self.remote_rows():
            self.refused += 1
            bound = "the decode batches hold plus --max-queue" if self.capacity == self.configured \
                else "the power policy in force allows"
            raise ApiError(429, f"Server busy: {self.admitted} requests are admitted, as many as {bound}; "
                           f"retry after {RETRY_AFTER_S} s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.admitted += 1
        return Ticket(self, self._lanes[body_bytes > LARGE_BODY_BYTES])

    def _end(self) -> None:
        self.admitted -= 1


class Ticket:
    """One admitted request's place, released exactly once, and the lane its
    heavy work runs in."""

    def __init__(self, admission: Admission, lane: ThreadPoolExecutor):
        self._admission = admission
        self._lane = lane
        self._released = False
        self._busy: Future | None = None  # a thread still working for a request that gave up on it

    async def off_loop(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) in a thread: its result, or its exception as
        raised (an ApiError 400 stays one). 504 past the request deadline."""
        future = self._lane.submit(fn, *args, **kwargs)
        deadline = asyncio.timeout(self._admission.timeout_s)
        try:
            async with deadline:
                return await asyncio.wrap_future(future)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise ApiError(504, f"Request timed out after {self._admission.timeout_s:g} s waiting for a thread "
                           "to prepare its prompt", code="timeout") from None
        finally:
            if not future.done():  # cancelled or timed out while it runs: it keeps the place until it ends
                self._busy = future

    def release(self) -> None:
        """The request ended: its place is free (once its thread is done)."""
        if self._released:
            return
        self._released = True
        busy = self._busy
        if busy is None or busy.done():
            self._admission._end()
            return
        loop = asyncio.get_running_loop()

        def thread_done(_: Future) -> None:
            try:
                loop.call_soon_threadsafe(self._admission._end)
            except RuntimeError:  # the loop has closed: nothing counts any more
                pass

        busy.add_done_callback(thread_done)

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        """`with ticket:` releases it if the block raises (a request refused
        while parsed); a block that returns hands it to the response."""
        if kind is not None:
            self.release()
