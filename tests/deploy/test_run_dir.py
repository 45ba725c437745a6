"""What a server leaves behind: its run dir (0700, locked while it runs) and
its shared-memory arena. The attacks: a server killed whole with SIGKILL (its
leftovers must be swept at the next start), a live server beside the one
starting (its leftovers must never be touched), a dead server's pid reused
by another process (its leftovers must still be swept). Real processes,
real locks and real POSIX shared memory."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from cache_service.arena import Arena, unlink_arena
from deploy.run_dir import ARENAS, LOCK, OLD_RUN_DIR_AGE_S, RunDir, sweep_leftovers
from environment.settings import Settings

REPO = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists /dev/shm (Linux)")


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _arena_name(pid: int) -> str:
    return f"tandem-{pid}-{uuid.uuid4().hex[:8]}"


# A server as far as its leftovers go: a run dir held, an arena recorded then created.
SERVER = textwrap.dedent("""
    import sys, time, uuid, os
    from cache_service.arena import Arena
    from deploy.run_dir import RunDir
    run_dir = RunDir.create(sys.argv[1])
    name = f"tandem-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    run_dir.record_arena(name)
    Arena.create(name, 1 << 16)
    print(run_dir.path, name, flush=True)
    time.sleep(120)
""")


def _start_server(parent: Path) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(parent)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    path, name = proc.stdout.readline().split()
    return proc, path, name


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


@linux_only
def test_a_killed_servers_run_dir_and_arena_are_swept_at_the_next_start(tmp_path):
    proc, path, name = _start_server(tmp_path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700  # its sockets: this user only
        assert os.path.basename(path).startswith(f"tandem-{proc.pid}-") and _shm_exists(name)
    finally:
        _kill(proc)
    assert os.path.isdir(path) and _shm_exists(name)  # SIGKILL: no clean-up ran
    removed = sweep_leftovers(str(tmp_path))
    assert path in removed and name in removed
    assert not os.path.exists(path) and not _shm_exists(name)


@linux_only
def test_a_live_servers_run_dir_and_arena_are_never_touched(tmp_path):
    proc, path, name = _start_server(tmp_path)
    try:
        removed = sweep_leftovers(str(tmp_path))
        assert path not in removed and name not in removed
        assert os.path.isdir(path) and os.path.exists(os.path.join(path, LOCK)) and _shm_exists(name)
    finally:
        _kill(proc)
        sweep_leftovers(str(tmp_path))
    assert not _shm_exists(name)


@linux_only
def test_a_dead_servers_leftovers_are_swept_though_its_pid_was_reused(tmp_path):
    """The pid in the names now belongs to a live process (this one) that
    holds no lock on the folder: the owner is gone all the same."""
    name = _arena_name(os.getpid())
    path = tmp_path / f"tandem-{os.getpid()}-reused01"
    path.mkdir(mode=0o700)
    (path / LOCK).touch()
    (path / ARENAS).write_text(name + "\n")
    Arena.create(name, 1 << 16).close()
    try:
        removed = sweep_leftovers(str(tmp_path))
        assert str(path) in removed and name in removed and not _shm_exists(name)
    finally:
        unlink_arena(name)


@linux_only
def test_an_arena_without_a_run_dir_is_kept_while_its_pid_lives(tmp_path):
    """A server given its own run dir, or an older Tandem's: only the pid tells."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    alive, gone = _arena_name(os.getpid()), _arena_name(dead.pid)
    for name in (alive, gone):
        Arena.create(name, 1 << 16).close()
    try:
        removed = sweep_leftovers(str(tmp_path))
        assert gone in removed and alive not in removed
        assert _shm_exists(alive) and not _shm_exists(gone)
    finally:
        unlink_arena(alive)
        unlink_arena(gone)


def test_a_damaged_arena_list_unlinks_nothing_else(tmp_path):
    """A dead run dir's list names only arenas; anything else in it is skipped."""
    path = tmp_path / "tandem-999999999-damaged1"
    path.mkdir(mode=0o700)
    (path / LOCK).touch()
    (path / ARENAS).write_text("../../etc/passwd\n/evil\n\n" + "x" * 200 + "\n")
    assert str(path) in sweep_leftovers(str(tmp_path)) and not path.exists()


def test_old_empty_run_dirs_are_removed_and_others_left(tmp_path):
    old = tmp_path / "tandem-ab12cd_9"  # tempfile.mkdtemp(prefix="tandem-"): what Settings() used to leak
    young, full, unrelated = tmp_path / "tandem-zz12cd_9", tmp_path / "tandem-xy12cd_9", tmp_path / "tandem-bench-x1"
    for p in (old, young, full, unrelated):
        p.mkdir()
    (full / "router.sock").touch()
    past = time.time() - OLD_RUN_DIR_AGE_S - 60
    for p in (old, full, unrelated):
        os.utime(p, (past, past))
    assert sweep_leftovers(str(tmp_path)) == [str(old)]
    assert not old.exists() and young.exists() and full.exists() and unrelated.exists()


def test_a_run_dir_is_created_locked_and_removed(tmp_path):
    run_dir = RunDir.create(str(tmp_path))
    assert stat.S_IMODE(os.stat(run_dir.path).st_mode) == 0o700
    assert sweep_leftovers(str(tmp_path)) == []  # held by this very process: never swept
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(run_dir.path)]  # no staging name left
    run_dir.remove()
    run_dir.remove()
    assert list(tmp_path.iterdir()) == []


def test_settings_make_no_folder():
    """Every Settings() (tests, `tandem generate`, the bench) used to leave an empty /tmp/tandem-*."""
    assert Settings().run_dir == ""
