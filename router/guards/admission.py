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
template; and in each lane the callers (API keys, else client addresses) take
turns (router/guards/fair_lanes.py), so one caller's flood of bodies delays
another's request by at most one job per caller, not by the whole flood.

Bodies are bounded in bytes as well as in number: the admitted requests'
bodies together stay within settings.admitted_body_bytes (429 past it, 413
for a body larger than all of it), so places times the largest body is not
what the router may have to hold.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

from environment.power.policy import THERMAL_RETRY_AFTER_S
from environment.settings import Settings
from router.api.errors import ApiError
from router.guards.fair_lanes import FairLane

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
    """Counts admitted requests against `capacity` and their bodies' bytes
    against `body_budget`; `timeout_s` bounds a request's wait for a thread."""

    def __init__(self, capacity: int, timeout_s: float, body_budget: int = Settings.admitted_body_bytes):
        self.configured = capacity  # the settings' capacity
        self.capacity = capacity  # in force: the power policy may lower it (follow)
        self.refusing = ""  # why every new request is refused now (a critically hot machine), or ""
        self.timeout_s = timeout_s
        self.admitted = 0
        self.refused = 0  # since start
        self.body_budget = body_budget
        self.body_bytes = 0  # of the admitted requests' bodies
        # Rows of decode batches on other hosts (router/routing/worker_table.py remote_rows):
        # room remote workers add; the power policy caps only this machine's.
        self.remote_rows: Callable[[], int] = lambda: 0
        self.lanes = (FairLane(SMALL_THREADS, "parse", _yield_the_cpu),
                      FairLane(LARGE_THREADS, "parse-large", _yield_the_cpu))

    @classmethod
    def from_settings(cls, settings: Settings) -> "Admission":
        return cls(capacity(settings), settings.request_timeout_s, settings.admitted_body_bytes)

    def follow(self, power) -> None:
        """Apply the power policy in force now and at every change (router/power_watch.py)."""
        self.apply_power(power.policy)
        power.listeners.append(self.apply_power)

    def apply_power(self, policy) -> None:
        """A environment.power.policy.PowerPolicy: its admission cap and whether it refuses new requests.
        Admitted requests are never dropped: a lower cap only refuses new ones until enough end."""
        self.capacity = min(self.configured, policy.max_admitted or self.configured)
        self.refusing = policy.reason if policy.refuse_new else ""

    def admit(self, body_bytes: int, caller: str = "") -> "Ticket":
        """A ticket for a request of `body_bytes` from `caller` (whose turns its
        work takes: router/guards/fair_lanes.py caller_of); 429 when `capacity`
        are admitted, when the bodies admitted would pass the body budget, or
        while the power policy refuses new requests; 413 for a body larger
        than the whole budget."""
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
        self._check_body_bytes(body_bytes)
        self.admitted += 1
        self.body_bytes += body_bytes
        return Ticket(self, self.lanes[body_bytes > LARGE_BODY_BYTES], caller, body_bytes)

    def _check_body_bytes(self, body_bytes: int) -> None:
        if body_bytes > self.body_budget:
            raise ApiError(413, f"Request body of {body_bytes} bytes is larger than the {self.body_budget} bytes "
                           "all admitted requests' bodies may hold (--request-bodies-memory)",
                           code="request_too_large")
        if self.body_bytes + body_bytes > self.body_budget:
            self.refused += 1
            raise ApiError(429, f"Server busy: the admitted requests' bodies hold {self.body_bytes} bytes, and "
                           f"{body_bytes} more would pass the {self.body_budget} bytes allowed "
                           f"(--request-bodies-memory); retry after {RETRY_AFTER_S} s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def _end(self, body_bytes: int) -> None:
        self.admitted -= 1
        self.body_bytes -= body_bytes


class Ticket:
    """One admitted request's place and body bytes, released exactly once, and
    the lane (and the caller's turn in it) its heavy work runs in."""

    def __init__(self, admission: Admission, lane: FairLane, caller: str, body_bytes: int):
        self._admission = admission
        self._lane = lane
        self._caller = caller
        self._body_bytes = body_bytes
        self._released = False
        self._busy: Future | None = None  # a thread still working for a request that gave up on it
        self._also: list[Callable[[], None]] = []  # what else the request holds until it ends (its model's lease)

    def also_release(self, fn: Callable[[], None]) -> None:
        """`fn` is called once, when the ticket is released."""
        self._also.append(fn)

    async def off_loop(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) in a thread: its result, or its exception as
        raised (an ApiError 400 stays one). 504 past the request deadline."""
        future = self._lane.submit(self._caller, fn, *args, **kwargs)
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
        for fn in self._also:
            fn()
        busy = self._busy
        if busy is None or busy.done():
            self._admission._end(self._body_bytes)
            return
        loop = asyncio.get_running_loop()

        def thread_done(_: Future) -> None:
            try:
                loop.call_soon_threadsafe(self._admission._end, self._body_bytes)
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
