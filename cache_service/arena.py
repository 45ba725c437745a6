"""One named shared-memory segment that every process maps: the cache arena.

The cache service creates it; workers attach to it by name and read or write
the byte ranges the service hands out. Data never crosses a socket.

Lifetime is explicit: the service unlinks the segment when it stops, the
supervisor calls `unlink_arena` after a service that was killed, and at its
start `sweep_arenas` for servers killed whole (deploy/run_dir.py). Python's
resource_tracker is kept out of it entirely (before 3.13 it would unlink a
segment when any process that merely attached to it exits, and print "leaked
shared_memory" warnings); on 3.13+ that is `track=False`.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import sys
import threading
from multiprocessing import shared_memory

import numpy as np

log = logging.getLogger(__name__)

# macOS limits POSIX shm names to 31 bytes including the leading slash; enforce
# it everywhere so a name that works on a Linux CI machine works on a Mac.
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,30}$")

_TRACK_PARAM = sys.version_info >= (3, 13)
_untrack_lock = threading.Lock()

# SharedMemory objects whose close() failed because numpy arrays or memoryviews
# still pointed into the mapping. They stay referenced here (so their __del__
# does not retry and print errors) and are closed by a later `Arena.close`.
_lingering: list = []
_lingering_lock = threading.Lock()


class _NoTracker:
    """Stands in for resource_tracker inside multiprocessing.shared_memory."""

    @staticmethod
    def register(name, rtype):
        pass

    @staticmethod
    def unregister(name, rtype):
        pass


def _shm_untracked(name: str, create: bool = False, size: int = 0) -> shared_memory.SharedMemory:
    if _TRACK_PARAM:
        return shared_memory.SharedMemory(name, create=create, size=size, track=False)
    # Python < 3.13 registers every segment it opens with the resource tracker.
    # Swapping the module's tracker for a no-op while the constructor runs is
    # what 3.13's track=False does; the lock keeps two threads from racing it.
    with _untrack_lock:
        real = shared_memory.resource_tracker
        shared_memory.resource_tracker = _NoTracker
        try:
            return shared_memory.SharedMemory(name, create=create, size=size)
        finally:
            shared_memory.resource_tracker = real


def _unlink_untracked(shm: shared_memory.SharedMemory) -> None:
    if _TRACK_PARAM:
        shm.unlink()  # track=False: no unregister
        return
    with _untrack_lock:
        real = shared_memory.resource_tracker
        shared_memory.resource_tracker = _NoTracker
        try:
            shm.unlink()
        finally:
            shared_memory.resource_tracker = real


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"bad arena name {name!r}: 1-30 characters of A-Z a-z 0-9 . _ -")


def new_arena_name(prefix: str = "tandem") -> str:
    """A fresh segment name (the supervisor picks one per service start)."""
    name = f"{prefix}-{secrets.token_hex(6)}"
    _check_name(name)
    return name


def _check_shm_space(size: int) -> None:
    """Fail at creation, not with SIGBUS at first write, when /dev/shm is small.

    Linux backs the segment with tmpfs pages allocated on first touch; writing
    past what tmpfs can hold kills the writer with SIGBUS (Docker's default
    /dev/shm is 64 MiB). macOS has no such limit to check.
    """
    if not os.path.isdir("/dev/shm"):
        return
    st = os.statvfs("/dev/shm")
    avail = st.f_bavail * st.f_frsize
    if avail < size:
        raise OSError(errno.ENOSPC, f"/dev/shm has {avail} bytes free, the cache arena needs {size}; "
                      "lower the cache memory or enlarge /dev/shm")


def _try_close(shm: shared_memory.SharedMemory) -> bool:
    try:
        shm.close()
        return True
    except BufferError:  # views still exported; the mapping stays valid for them
        return False


class Arena:
    """A mapping of the named segment. Build with `create` or `attach`."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
        self._shm = shm
        self._name = shm.name
        self._size = shm.size
        self._owner = owner  # created it (the service); informational only
        self._unlinked = False

    @classmethod
    def create(cls, name: str, size: int) -> "Arena":
        """Create a new segment; FileExistsError if the name is taken."""
        _check_name(name)
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"arena size must be a positive int, got {size!r}")
        _check_shm_space(size)
        return cls(_shm_untracked(name, create=True, size=size), owner=True)

    @classmethod
    def attach(cls, name: str) -> "Arena":
        """Map an existing segment; FileNotFoundError if there is none."""
        _check_name(name)
        return cls(_shm_untracked(name), owner=False)

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        """Bytes mapped (macOS may round the requested size up to a page)."""
        return self._size

    @property
    def closed(self) -> bool:
        return self._shm is None

    @property
    def buf(self) -> memoryview:
        """The whole mapping. Wrap it with `ndarray`/`view` or np.frombuffer,
        never np.ndarray(buffer=...) (see `ndarray`)."""
        if self._shm is None:
            raise ValueError(f"arena {self._name} is closed")
        return self._shm.buf

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside arena {self._name} "
                             f"of {self._size} bytes")

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable memoryview of `nbytes` at `offset` (no copy)."""
        self._check_range(offset, nbytes)
        return self.buf[offset:offset + nbytes]

    def ndarray(self, offset: int, dtype, shape) -> np.ndarray:
        """A numpy array living in the arena at `offset` (a view, no copy)."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._check_range(offset, nbytes)
        # frombuffer, not np.ndarray(buffer=...): the latter keeps no buffer
        # export on the mapping, so close() could unmap memory it still points
        # to (a segfault). frombuffer's memoryview base pins the mapping.
        count = nbytes // dtype.itemsize if dtype.itemsize else 0
        return np.frombuffer(self.buf, dtype=dtype, count=count, offset=offset).reshape(shape)

    def discard(self, offset: int, nbytes: int) -> int:
        """Give the pages wholly inside [offset, offset + nbytes) back to the
        system; they read as zeros afterwards. Only for ranges nobody holds
        (memory pressure: blocks just evicted). Returns the bytes discarded,
        0 where the system cannot (then the pages simply stay until reused).

        An evicted block's pages stay resident otherwise: the segment is tmpfs
        on Linux (MADV_REMOVE punches them out of it) and a shared VM object on
        macOS (MADV_FREE_REUSABLE lets the kernel take them; unverified there)."""
        self._check_range(offset, nbytes)
        advice = getattr(mmap, "MADV_REMOVE", None) or getattr(mmap, "MADV_FREE_REUSABLE", None)
        mapping = getattr(self._shm, "_mmap", None)  # SharedMemory's own mapping (CPython 3.8+)
        start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if advice is None or mapping is None or end <= start:
            return 0
        try:
            mapping.madvise(advice, start, end - start)
        except (OSError, ValueError):
            return 0
        return end - start

    def close(self) -> None:
        """Unmap. Idempotent. Arrays still pointing into the arena keep their
        pages mapped (and valid) until they are dropped."""
        with _lingering_lock:
            _lingering[:] = [old for old in _lingering if not _try_close(old)]
            shm, self._shm = self._shm, None
            if shm is not None and not _try_close(shm):
                log.debug("arena %s: views still alive, unmapping when they are dropped", self._name)
                _lingering.append(shm)

    def unlink(self) -> None:
        """Remove the segment's name (mappings stay valid). Idempotent."""
        if self._unlinked:
            return
        self._unlinked = True
        unlink_arena(self._name)

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Arena({self._name!r}, size={self._size}, {state})"


def unlink_arena(name: str) -> bool:
    """Remove a segment by name; False if there was none. For the service on
    exit and for the supervisor after a killed service."""
    _check_name(name)
    try:
        shm = _shm_untracked(name)
    except FileNotFoundError:
        return False
    try:
        _unlink_untracked(shm)
    except FileNotFoundError:  # someone else unlinked it between open and unlink
        return False
    finally:
        _try_close(shm)
    return True


# `tandem serve` names its arenas tandem-<supervisor pid>-<hex> (deploy/supervisor.py):
# the pid says whose an arena is once nothing references it any more.
SERVER_ARENA_RE = re.compile(r"^tandem-(\d+)-[0-9a-f]+$")
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory, one file per name


def server_arenas() -> list[tuple[str, int]] | None:
    """(name, supervisor pid) of every server arena of this user; None where
    shared-memory names cannot be listed (macOS: the run dir records them)."""
    if not os.path.isdir(SHM_DIR):
        return None
    out = []
    for entry in os.scandir(SHM_DIR):
        match = SERVER_ARENA_RE.match(entry.name)
        try:
            ours = match is not None and entry.is_file(follow_symlinks=False) \
                and entry.stat(follow_symlinks=False).st_uid == os.geteuid()
        except OSError:  # removed while listing
            continue
        if ours:
            out.append((entry.name, int(match.group(1))))
    return out


def sweep_arenas(owner_alive) -> list[str]:
    """Unlink the server arenas whose supervisor is gone (`owner_alive(pid)`
    says); a server killed with its process group ran no clean-up, and its
    arena would hold memory until reboot. Returns the names removed."""
    removed = []
    for name, pid in server_arenas() or []:
        if not owner_alive(pid) and unlink_arena(name):
            removed.append(name)
    return removed


class ArenaAttachment:
    """A worker's one mapping of the current arena.

    Workers attach once and keep the mapping; when a handle names another
    arena (the service restarted with a fresh segment) it re-attaches. Safe to
    share between threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arena: Arena | None = None

    def get(self, name: str) -> Arena:
        with self._lock:
            if self._arena is not None and self._arena.name == name and not self._arena.closed:
                return self._arena
            old, self._arena = self._arena, Arena.attach(name)
            if old is not None:
                log.info("cache arena changed %s -> %s, re-attached", old.name, name)
                old.close()
            return self._arena

    def close(self) -> None:
        with self._lock:
            if self._arena is not None:
                self._arena.close()
                self._arena = None
