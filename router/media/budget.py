"""What media may take: one request's pixels, and the bytes all requests together may hold
while their media are fetched and decoded; and `MediaError`, how a media part is refused.

One `MediaMemory` per router (`--media-memory`, settings.media_budget_bytes): downloads count as
their bytes arrive, decoded pixels (3 bytes each) before they are decoded. A request that would
pass it waits on the event loop until other requests give bytes back, up to a deadline; then it
is refused with 429 and Retry-After (`MediaBusy`), as is, at once, one that holds bytes and needs
more while an older request waits (no two requests wait for each other). A decoding thread never waits (a pool of
threads all waiting for room that only other threads' work would free is a stall): it takes
room only if there is some, else raises `NoRoom`, and the event loop waits for the room and runs
it again (router/media/parts.py). Each request's share is kept by its `PixelBudget`.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import deque
from dataclasses import dataclass

from router.api.errors import ApiError


class MediaError(ApiError):
    """A media part the server refuses: 400, the part's path in the message and in `param`."""

    def __init__(self, where: str, problem: str, code: str = "invalid_media"):
        super().__init__(400, f"{where}: {problem}", param=where, code=code)


class NoRoom(Exception):
    """Raised in a decoding thread: `nbytes` more bytes are needed than the server has free."""

    def __init__(self, nbytes: int, where: str):
        super().__init__(f"{where}: no room for {nbytes} bytes of media")
        self.nbytes = nbytes
        self.where = where


class MediaBusy(ApiError):
    """429: other requests' media hold the server's media memory, and no room came back in time
    (or this request gave way to an older one)."""

    def __init__(self, where: str, retry_after_s: float):
        super().__init__(
            429, f"{where}: server busy: other requests' images and videos fill its media memory; retry shortly",
            param=where, code="media_busy", headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
        )


@dataclass(eq=False)
class _Waiter:
    owner: object
    nbytes: int
    future: asyncio.Future
    granted: bool | None = None  # None: still waiting; False: gave way, or stopped waiting


class MediaMemory:
    """Bytes in use, at most `limit`, by owner (a request's PixelBudget); thread-safe.

    Requests that hold bytes and wait for more could wait for each other (one holds its
    download and needs room for its pixels, the other the same) until their deadlines. So the
    oldest holder (of those holding bytes, the first to take them) always gets through: while
    it waits, nobody else takes room, what comes back is its own, and a younger holder that needs
    more gives way (its request is refused and releases what it holds) instead of waiting. A
    request holding nothing blocks nobody and may wait. Otherwise waiters are served in arrival
    order, each as soon as it fits."""

    def __init__(self, limit: int, wait_s: float):
        if limit < 1:
            raise ValueError(f"the media memory must be at least 1 byte, not {limit}")
        self.limit = limit
        self.wait_s = wait_s  # how long a request waits for room, all its waits together
        self.used = 0
        self._held: dict[object, int] = {}  # owner -> bytes, the oldest holder first
        self._waiters: deque[_Waiter] = deque()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Waits for room now."""
        return len(self._waiters)

    def try_take(self, owner: object, nbytes: int) -> bool:
        """Take `nbytes` for `owner` if it may now (any thread)."""
        with self._lock:
            if not self._may_take(owner, nbytes):
                return False
            self._grant(owner, nbytes)
            return True

    async def take(self, owner: object, nbytes: int, timeout_s: float) -> bool:
        """Take `nbytes` for `owner`, waiting up to `timeout_s`; False when they did not come in
        time, or when `owner` must give way to an older request (then release all it holds)."""
        with self._lock:
            if self._may_take(owner, nbytes):
                self._grant(owner, nbytes)
                return True
            if owner in self._held and self._waiting_oldest() not in (None, owner):
                return False
            waiter = _Waiter(owner, nbytes, asyncio.get_running_loop().create_future())
            self._waiters.append(waiter)
            self._settle()
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), max(0.0, timeout_s))
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            if self._stop_waiting(waiter):
                self.give_back(owner, nbytes)
            raise
        return self._stop_waiting(waiter)

    def give_back(self, owner: object, nbytes: int) -> None:
        """Return `owner`'s `nbytes` and hand the room on (any thread)."""
        with self._lock:
            self.used -= nbytes
            left = self._held.get(owner, 0) - nbytes
            if left > 0:
                self._held[owner] = left  # keeps its place: its age
            else:
                self._held.pop(owner, None)
            self._settle()

    # Under the lock:

    def _waiting_oldest(self) -> object | None:
        """The oldest holder, if it waits for room."""
        oldest = next(iter(self._held), None)
        return oldest if oldest is not None and any(w.owner is oldest for w in self._waiters) else None

    def _may_take(self, owner: object, nbytes: int) -> bool:
        return self.used + nbytes <= self.limit and self._waiting_oldest() in (None, owner)

    def _grant(self, owner: object, nbytes: int) -> None:
        self.used += nbytes
        self._held[owner] = self._held.get(owner, 0) + nbytes

    def _settle(self) -> None:
        """Grant waiters that may take their bytes; younger holders that wait while the oldest
        waits give way. Again until nothing changes (a grant can end the oldest's wait)."""
        changed = True
        while changed:
            changed = False
            oldest = self._waiting_oldest()
            for waiter in list(self._waiters):
                if oldest is not None and waiter.owner is not oldest and waiter.owner in self._held:
                    self._finish(waiter, False)
                elif self._may_take(waiter.owner, waiter.nbytes):
                    self._grant(waiter.owner, waiter.nbytes)
                    self._finish(waiter, True)
                    changed = True

    def _finish(self, waiter: _Waiter, granted: bool) -> None:
        self._waiters.remove(waiter)
        waiter.granted = granted
        waiter.future.get_loop().call_soon_threadsafe(_wake, waiter.future)

    def _stop_waiting(self, waiter: _Waiter) -> bool:
        """Whether `waiter` got its bytes; one still waiting stops (a timeout, a cancel)."""
        with self._lock:
            if waiter.granted is None:
                self._waiters.remove(waiter)
                waiter.granted = False
                self._settle()  # an oldest that stops waiting lets others take again
            return waiter.granted


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


RGB_BYTES = 3  # what a decoded pixel holds


class PixelBudget:
    """What one request's media may still take, shared by its decoding threads: pixels (all
    parts together at most `limit`), and bytes of the server's MediaMemory (downloads as they
    arrive, RGB_BYTES per pixel before it is decoded), all given back by `release` when the
    request's media are decoded or refused."""

    def __init__(self, limit: int, memory: MediaMemory | None = None, wait_s: float = 10.0):
        self.left = limit
        self.limit = limit
        self.memory = memory
        self.wait_s = wait_s  # the longest this request waits for room in `memory`, all waits together
        self.held = 0  # bytes taken from memory
        self.used = 0  # of those, bytes its parts account for; the rest came from a wait, unspent
        self._wait_until: float | None = None
        self._released = False
        self._lock = threading.Lock()

    def take(self, pixels: int, where: str, decoded: bool = True) -> None:
        """`pixels` more for `where`, and their bytes unless not `decoded` now (a remembered
        picture's). NoRoom (nothing taken) when the server has no room for the bytes."""
        with self._lock:
            if pixels > self.left:
                raise MediaError(
                    where,
                    f"the request's images and video frames exceed the limit of {self.limit} pixels in all",
                    code="media_too_large",
                )
            if decoded:
                self._take_bytes(pixels * RGB_BYTES, where)
            self.left -= pixels

    def take_bytes(self, nbytes: int, where: str) -> None:
        """`nbytes` of the server's media memory for `where`, now or NoRoom (any thread)."""
        with self._lock:
            self._take_bytes(nbytes, where)

    def _take_bytes(self, nbytes: int, where: str) -> None:
        if self.memory is None or nbytes <= 0:
            return
        if self._released:  # a thread still decoding for a request already refused: nothing to keep
            raise MediaError(where, "the request's media were refused")
        if self.used + nbytes > self.memory.limit:  # would never fit: no use waiting
            raise MediaError(where, f"the request's images and videos need more than this server's media memory "
                             f"of {self.memory.limit} bytes (--media-memory)", code="media_too_large")
        missing = self.used + nbytes - self.held
        if missing > 0:
            if not self.memory.try_take(self, missing):
                raise NoRoom(missing, where)
            self.held += missing
        self.used += nbytes

    async def wait_for_room(self, nbytes: int, where: str) -> None:
        """Wait (on the event loop) until the server's media memory gives this request `nbytes`
        more, kept for its next take; MediaBusy (429) past the request's deadline."""
        loop = asyncio.get_running_loop()
        if self._wait_until is None:
            self._wait_until = loop.time() + self.wait_s
        if self.memory is None or not await self.memory.take(self, nbytes, self._wait_until - loop.time()):
            raise MediaBusy(where, self.wait_s)
        with self._lock:
            if not self._released:
                self.held += nbytes
                return
        self.memory.give_back(self, nbytes)

    def give_back(self, nbytes: int) -> None:
        """Bytes a part no longer holds (a download, once decoded)."""
        with self._lock:
            nbytes = min(nbytes, self.used)
            self.used -= nbytes
            self.held -= nbytes
        if self.memory is not None and nbytes > 0:
            self.memory.give_back(self, nbytes)

    def release(self) -> None:
        """Everything back: the request's media are done, or refused."""
        with self._lock:
            held, self.held, self.used, self._released = self.held, 0, 0, True
        if self.memory is not None and held > 0:
            self.memory.give_back(self, held)
