"""KV blocks on disk: one file per block, LRU-bounded, kept across restarts.

A restarted service (launchd restarts it, a new `tandem serve`) rebuilds its
index from the directory and keeps its warm prefixes. The service writes every
committed block through on a background thread (`submit`, a queue bounded in
bytes, since what waits there is pinned arena memory; dropped and counted when
full) and reads a block back on a memory miss (`read_into`, straight into the
arena).

File: <root>/<first hex byte>/<hash hex>.kvb (disk_layout.py) =
    header (magic, format version, payload length, SHA-256 of the payload) + payload
    (block_file.py).
Written to a temporary name and renamed, so a reader sees a whole file or none.
A file that fails any check (bad magic or version, wrong length, checksum) is
deleted, counted, and treated as a miss: never served. The length is checked
against the file and against the space the caller gives, so blocks of other
models (other sizes) can share the directory: their hashes differ anyway.

LRU by last use in any tier: the service reports every lookup hit, memory
hits too (`touch`), or the hottest prefixes, never read back from disk, would
be the first files evicted. The writer thread carries recency over to the
files' mtimes, which order the index rebuilt at start-up. Several services may
share a directory: a file another one evicted is just a miss. Touches go
through the writer's queue, so they land in order with the writes: the cached
head of a chain touched after its new tail was queued ends up the more recent.

Private: KV can be turned back into the prompt that made it, so the root and
its folders are 0700 and the files 0600, created so (never more open for an
instant, whatever the umask), and a tree an older version left open is closed
at start. With a `ttl_s`, a file unused that long (by its mtime, which every
use moves) is deleted at start and by the writer thread every few minutes.
Names, modes and clearing: cache_service/disk_layout.py; the writer's queue:
disk_queue.py.
"""

from __future__ import annotations

import logging
import os
import queue
import stat
import threading
import time
from collections import OrderedDict
from typing import Optional

from cache_service.block_file import HEADER, header_of, read_verified
from cache_service.disk_layout import (DIR_MODE, FILE_MODE, TMP_SUFFIX, block_path, close_mode,
                                       create_private_file, hash_of_name, make_private_dir, scandir, unlink)
from cache_service.disk_queue import DiskQueue

log = logging.getLogger(__name__)

_STALE_TMP_S = 60.0  # older temp files are a crashed writer's leftovers; younger may be another service's
# Expiry passes: at most this far apart (and an eighth of the TTL), each
# deleting at most a batch (the writes wait meanwhile).
_EXPIRY_EVERY_S = 300.0
_EXPIRY_BATCH = 1024

# Arena bytes that may wait for the writer (pinned until written): a long
# prompt's commit is tens of MB; a slow disk must not pin the whole arena.
QUEUE_BYTES = 256 << 20
QUEUE_ITEMS = 4096  # writes and touches waiting (touches hold no arena bytes)

_COUNTERS = ("disk_hits_total", "disk_corrupt_total", "disk_evictions_total", "disk_expired_total",
             "disk_writes_total", "disk_writes_dropped_total", "disk_write_errors_total")


class DiskTier:
    def __init__(self, root: str, capacity_bytes: int, *, ttl_s: Optional[float] = None,
                 queue_bytes: int = QUEUE_BYTES, queue_items: int = QUEUE_ITEMS):
        """`ttl_s`: files unused for longer are deleted (None: kept until evicted).
        OSError when `root` cannot be made a private folder of this user's."""
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s if ttl_s and ttl_s > 0 else None
        make_private_dir(root)
        self._next_expiry = time.monotonic() + self._expiry_every_s()
        self._lock = threading.Lock()  # guards _files, _bytes and the counters
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._bytes = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._scan()
        self._queue = DiskQueue(queue_bytes, queue_items)
        self._last_touch_ns = 0
        self._stop = threading.Event()
        self._abandon = False  # close() ran out of time: drop what is still queued
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # ------------------------------------------------------------- start-up --

    def _scan(self) -> None:
        found = []
        now = time.time()
        stale_before = now - self.ttl_s if self.ttl_s else None
        for sub in scandir(self.root):
            if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                continue
            close_mode(sub.path, DIR_MODE)  # an older version made them 0755
            for entry in scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if entry.name.endswith(TMP_SUFFIX):
                    if now - st.st_mtime > _STALE_TMP_S:
                        unlink(entry.path)
                    continue
                h = hash_of_name(entry.name)
                if h is None or entry.name[:2] != sub.name:
                    continue
                if stale_before is not None and st.st_mtime < stale_before:
                    unlink(entry.path)
                    self.counters["disk_expired_total"] += 1
                    continue
                if stat.S_IMODE(st.st_mode) != FILE_MODE:
                    close_mode(entry.path, FILE_MODE)
                found.append((st.st_mtime_ns, h, st.st_size))
        if self.counters["disk_expired_total"]:
            log.info("deleted %d KV block files unused for more than %.0f s", self.counters["disk_expired_total"],
                     self.ttl_s)
        found.sort(key=lambda f: f[0])
        for _, h, size in found:
            self._files[h] = size
            self._bytes += size
        for h in self._over_capacity():  # the limit may have been lowered since
            unlink(self.path(h))

    # --------------------------------------------------------------- reads --

    def path(self, h: bytes) -> str:
        return block_path(self.root, h)

    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self._files

    def payload_size(self, h: bytes) -> Optional[int]:
        """Bytes of the block stored for `h` (from the file size), None if
        absent. A file too short to hold any block is deleted as corrupt."""
        with self._lock:
            size = self._files.get(h)
        if size is None or size > HEADER.size:
            return None if size is None else size - HEADER.size
        self._discard_corrupt(h, "shorter than a header")
        return None

    def read_into(self, h: bytes, dest: memoryview) -> bool:
        """Fill `dest` with the block's verified bytes. False on a miss; a
        file that fails a check is deleted first."""
        path = self.path(h)
        try:
            with open(path, "rb") as f:
                problem = read_verified(f, dest)
        except FileNotFoundError:  # another service sharing the directory evicted it
            self._forget(h)
            return False
        except OSError as exc:
            log.warning("could not read KV block file %s: %s", path, exc)
            return False
        if problem:
            self._discard_corrupt(h, problem)
            return False
        with self._lock:
            self.counters["disk_hits_total"] += 1
        self.touch([h])
        return True

    def touch(self, hashes: list) -> None:
        """Mark blocks used, in order (the last is the most recent). Queued
        behind the pending writes; dropped when the queue is full."""
        self._queue.put(("touch", list(hashes)))

    def _touch_now(self, hashes: list) -> None:
        with self._lock:
            hashes = [h for h in hashes if h in self._files]
            for h in hashes:
                self._files.move_to_end(h)
        for h in hashes:
            # Strictly increasing times: the rebuilt order must not depend on clock granularity.
            self._last_touch_ns = max(time.time_ns(), self._last_touch_ns + 1)
            try:
                os.utime(self.path(h), ns=(self._last_touch_ns, self._last_touch_ns))
            except OSError:
                pass  # evicted meanwhile (maybe by another service): nothing to mark

    def _discard_corrupt(self, h: bytes, problem: str) -> None:
        path = self.path(h)
        log.warning("KV block file %s is corrupt (%s): deleted", path, problem)
        self._forget(h)
        unlink(path)
        with self._lock:
            self.counters["disk_corrupt_total"] += 1

    def _forget(self, h: bytes) -> None:
        with self._lock:
            size = self._files.pop(h, None)
            if size is not None:
                self._bytes -= size

    # -------------------------------------------------------------- writes --

    def submit(self, h: bytes, data: memoryview) -> bool:
        """Queue a write of `data` (the caller keeps it unchanged until `h`
        comes out of `finished()`). False, counted, when the queue is full."""
        if self._queue.put(("write", h, data), data.nbytes):
            return True
        self.count_dropped(1)
        return False

    def room_bytes(self) -> int:
        """Bytes of writes the queue takes now (an empty queue also takes one larger write)."""
        return self._queue.room_bytes()

    def count_dropped(self, n: int) -> None:
        """Writes the caller did not submit for want of room."""
        with self._lock:
            self.counters["disk_writes_dropped_total"] += n

    def finished(self) -> list[bytes]:
        """Hashes whose submitted write is over (written, skipped or failed)."""
        return self._queue.finished()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted write is over; False on timeout."""
        return self._queue.wait_idle(timeout_s)

    def write(self, h: bytes, data) -> bool:
        """Store one block now (the writer thread's job; tests call it too)."""
        with memoryview(data).cast("B") as view:
            return self._write(h, view)

    def _write(self, h: bytes, data: memoryview) -> bool:
        file_bytes = HEADER.size + data.nbytes
        path = self.path(h)
        if file_bytes > self.capacity_bytes:
            with self._lock:
                self.counters["disk_writes_dropped_total"] += 1
            return False
        with self._lock:
            stored = h in self._files
        if stored and os.path.exists(path):  # same hash, same bytes: only its recency changes
            self._touch_now([h])
            return True
        header = header_of(data)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        try:
            with os.fdopen(create_private_file(tmp), "wb") as f:
                f.write(header)
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            unlink(tmp)
            with self._lock:
                self.counters["disk_write_errors_total"] += 1
                errors = self.counters["disk_write_errors_total"]
            if errors % 100 == 1:  # a full or read-only disk fails every write: say so, not every time
                log.warning("could not write KV block file %s: %s (%d failed writes so far)", path, exc, errors)
            return False
        with self._lock:
            self._bytes += file_bytes - self._files.pop(h, 0)
            self._files[h] = file_bytes
            self.counters["disk_writes_total"] += 1
            victims = self._over_capacity()
        for victim in victims:
            unlink(self.path(victim))
        return True

    def _over_capacity(self) -> list[bytes]:
        """Drop least recently used files from the index until under the limit
        (call with the lock held, or before the writer starts); returns them."""
        victims = []
        while self._bytes > self.capacity_bytes and self._files:
            h, size = self._files.popitem(last=False)
            self._bytes -= size
            victims.append(h)
        self.counters["disk_evictions_total"] += len(victims)
        return victims

    def _write_loop(self) -> None:
        while True:
            self._maybe_expire()
            try:
                item = self._queue.get(0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            try:
                if item[0] == "touch":
                    self._touch_now(item[1])
                elif self._abandon:
                    with self._lock:
                        self.counters["disk_writes_dropped_total"] += 1
                else:
                    self.write(item[1], item[2])
            except Exception:  # the writer must outlive any one bad write
                log.exception("KV disk tier: %s failed", item[0])
            finally:
                self._queue.done(item)

    # -------------------------------------------------------------- expiry --

    def _expiry_every_s(self) -> float:
        return min(_EXPIRY_EVERY_S, max(1.0, self.ttl_s / 8)) if self.ttl_s else _EXPIRY_EVERY_S

    def _maybe_expire(self) -> None:
        if self.ttl_s is None or time.monotonic() < self._next_expiry:
            return
        try:
            full = self.expire_unused() >= _EXPIRY_BATCH
        except Exception:  # the writer must outlive a failed pass
            log.exception("KV disk tier: expiry pass failed")
            full = False
        # A full batch: more are due; go on after the writes queued meanwhile.
        self._next_expiry = time.monotonic() + (0.0 if full else self._expiry_every_s())

    def expire_unused(self, now: Optional[float] = None) -> int:
        """Delete the files unused for longer than the TTL (at most a batch),
        least recently used first, up to the first one still fresh (the
        index's order is the files' mtimes' order); returns how many. Runs
        on the writer thread (tests call it), which is the one that moves
        mtimes, so a file cannot be used anew between its check and its end."""
        if self.ttl_s is None:
            return 0
        stale_before = (time.time() if now is None else now) - self.ttl_s
        expired = 0
        while expired < _EXPIRY_BATCH:
            with self._lock:
                h = next(iter(self._files), None)
            if h is None:
                break
            try:
                mtime = os.stat(self.path(h)).st_mtime
            except FileNotFoundError:  # deleted behind our back (another service, `tandem cache clear`)
                self._forget(h)
                continue
            if mtime >= stale_before:
                break
            with self._lock:
                if next(iter(self._files), None) != h:  # forgotten meanwhile (a failed read)
                    continue
                self._bytes -= self._files.pop(h)
                self.counters["disk_expired_total"] += 1
            unlink(self.path(h))
            expired += 1
        return expired

    def close(self, flush_timeout_s: float = 1.0) -> None:
        """Stop taking writes, finish the queued ones within the timeout (then
        drop the rest), stop the writer."""
        self._queue.close()
        if not self.wait_idle(flush_timeout_s):
            log.warning("dropping unwritten KV blocks at shutdown")
            self._abandon = True
        self._stop.set()
        self._writer.join(2.0)

    # --------------------------------------------------------------- stats --

    def stats(self) -> dict:
        with self._lock:
            return {"disk_bytes": self._bytes, "disk_blocks": len(self._files),
                    "disk_capacity_bytes": self.capacity_bytes, **self.counters}


def empty_stats() -> dict:
    """The disk keys of the stats when there is no disk tier."""
    return {"disk_bytes": 0, "disk_blocks": 0, "disk_capacity_bytes": 0, **dict.fromkeys(_COUNTERS, 0)}
