"""What waits for the disk tier's writer thread: block writes and touches,
in order, bounded in items and in the bytes of the writes.

A queued write holds a view of arena memory that stays pinned until it is
written, so the bound is in bytes (a slow disk must not pin the whole
arena); what does not fit is refused, and the caller counts it dropped.
Apart from the disk tier (disk_tier.py) because the bound, the count of
what is pending and the writes finished are the two threads' hand-over,
not the files'.
"""

from __future__ import annotations

import queue
import threading
from collections import deque


class DiskQueue:
    """("write", hash, memoryview) and ("touch", [hash, ...]) items between
    the service's thread (put) and the writer thread (get, done)."""

    def __init__(self, max_bytes: int, max_items: int):
        self._queue: queue.Queue = queue.Queue(maxsize=max_items)
        self.max_bytes = max_bytes
        self._queued_bytes = 0  # of the writes in the queue; guarded by _idle
        self._finished: deque[bytes] = deque()  # hashes whose submitted write is over
        self._idle = threading.Condition()
        self._pending = 0
        self._closing = False

    def put(self, item: tuple, nbytes: int = 0) -> bool:
        """Queue `item` (a write of `nbytes`); False when closing or full (an
        empty queue also takes one larger write)."""
        with self._idle:
            if self._closing or (nbytes and self._queued_bytes and self._queued_bytes + nbytes > self.max_bytes):
                return False
            self._pending += 1
            self._queued_bytes += nbytes
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self._done_one(nbytes)
            return False

    def get(self, timeout_s: float) -> tuple:
        """The next item (the writer thread); queue.Empty after `timeout_s`."""
        return self._queue.get(timeout=timeout_s)

    def done(self, item: tuple) -> None:
        """`item` is over (the writer thread): a write's view is released and
        its hash goes to `finished`."""
        nbytes = 0
        if item[0] == "write":
            nbytes = item[2].nbytes
            item[2].release()  # the arena can unmap once no view is left
            self._finished.append(item[1])
        self._done_one(nbytes)

    def _done_one(self, nbytes: int = 0) -> None:
        with self._idle:
            self._pending -= 1
            self._queued_bytes -= nbytes
            self._idle.notify_all()

    def room_bytes(self) -> int:
        """Bytes of writes the queue takes now (an empty queue also takes one larger write)."""
        with self._idle:
            return max(0, self.max_bytes - self._queued_bytes)

    def finished(self) -> list[bytes]:
        """Hashes whose submitted write is over (written, skipped or failed)."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every queued item is over; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        """Take nothing more."""
        with self._idle:
            self._closing = True
