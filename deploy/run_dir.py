"""The supervisor's run dir (the folder of its processes' ipc sockets), and
the sweep of what servers that are gone left behind.

`tandem serve` makes `<tmp>/tandem-<its pid>-<random>`, 0700 so that only its
user reaches the sockets, holds an exclusive lock on `lock` inside it while it
runs, and lists in `arenas` each shared-memory arena it names before the
cache service creates it. A normal or signalled exit removes both. A server
killed whole (SIGKILL to its process group, a crash of the machine's session)
ran no clean-up, so each start sweeps:

- a run dir whose lock nobody holds: the arenas it lists are unlinked and the
  folder removed;
- (Linux) an arena `tandem-<pid>-<hex>` in /dev/shm whose pid holds no run dir
  lock; where that pid has no run dir at all (a server given its own run dir,
  or an older Tandem), only when no process has that pid.

The kernel releases a lock when its holder dies, however it dies: a live
server's leftovers are never touched, whatever process it runs in (a test's
pytest too), and a dead one's are found even after its pid was reused. The
folder is made under another name and renamed once locked, so a sweep never
sees a live server's run dir unlocked. On macOS, where shared-memory names
cannot be listed, the `arenas` list is the only way back to a dead server's
arena (unverified there).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import tempfile
import time

from cache_service.arena import sweep_arenas, unlink_arena

RUN_DIR_RE = re.compile(r"^tandem-(\d+)-[A-Za-z0-9_]+$")
STAGING_PREFIX = ".tandem-new-"
# Tandem before run dirs carried a pid: every Settings() made an empty
# tempfile.mkdtemp(prefix="tandem-"). Removed when empty and this old.
OLD_RUN_DIR_RE = re.compile(r"^tandem-[a-z0-9_]{8}$")
OLD_RUN_DIR_AGE_S = 3600.0
LOCK = "lock"
ARENAS = "arenas"


class RunDir:
    """A run dir this process made and holds (`create`), until `remove`."""

    def __init__(self, path: str, lock_fd: int):
        self.path = path
        self._lock_fd = lock_fd

    @classmethod
    def create(cls, parent: str | None = None) -> "RunDir":
        parent = parent or tempfile.gettempdir()
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=parent)  # 0700
        fd = -1
        try:
            fd = os.open(os.path.join(staging, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = os.path.join(parent, f"tandem-{os.getpid()}-{os.path.basename(staging)[len(STAGING_PREFIX):]}")
            os.rename(staging, path)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return cls(path, fd)

    def record_arena(self, name: str) -> None:
        """Before the arena exists: a sweep after a kill finds it here."""
        with open(os.path.join(self.path, ARENAS), "a", encoding="ascii") as f:
            f.write(name + "\n")

    def remove(self) -> None:
        """Delete the folder, then let go of the lock. Idempotent."""
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def sweep_leftovers(parent: str | None = None) -> list[str]:
    """Remove the run dirs and arenas of servers that are gone (see the
    module's notes); returns what was removed (paths and arena names)."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    held_pids: set[int] = set()  # pids with a live run dir
    dir_pids: set[int] = set()  # pids with any run dir
    for entry in _own_dirs(parent):
        match = RUN_DIR_RE.match(entry.name)
        if match is None:
            if OLD_RUN_DIR_RE.match(entry.name) and _remove_old_empty(entry):
                removed.append(entry.path)
            continue
        pid = int(match.group(1))
        dir_pids.add(pid)
        if _in_use(entry.path, pid):
            held_pids.add(pid)
            continue
        removed += [name for name in _recorded_arenas(entry.path) if _unlink(name)]
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    removed += sweep_arenas(lambda pid: pid in held_pids or (pid not in dir_pids and pid_alive(pid)))
    return removed


def _own_dirs(parent: str) -> list[os.DirEntry]:
    out = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return out
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.geteuid():
                out.append(entry)
        except OSError:  # removed while listing
            continue
    return out


def _in_use(path: str, pid: int) -> bool:
    """Whether a live server holds this run dir: its lock is taken (or, for a
    folder without one, its pid is alive)."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return pid_alive(pid)
    except OSError:
        return True  # cannot tell: leave it
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK), or cannot tell: leave it either way
        return True
    finally:
        os.close(fd)  # our own lock, if we got it, goes with the descriptor
    return False


def _recorded_arenas(path: str) -> list[str]:
    try:
        with open(os.path.join(path, ARENAS), encoding="ascii", errors="replace") as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


def _unlink(name: str) -> bool:
    try:
        return unlink_arena(name)
    except (ValueError, OSError):  # not an arena name (a damaged list), or not ours
        return False


def _remove_old_empty(entry: os.DirEntry) -> bool:
    try:
        if time.time() - entry.stat(follow_symlinks=False).st_mtime < OLD_RUN_DIR_AGE_S:
            return False
        os.rmdir(entry.path)  # only an empty one: a live older server's has its sockets in it
        return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process (not a zombie) has this pid."""
    if pid <= 0:
        return True  # not a pid: never treat it as gone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return True
