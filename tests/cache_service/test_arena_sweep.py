"""The arena sweep at a server's start (cache_service/arena.py sweep_arenas):
an arena whose supervisor is gone is unlinked; one whose supervisor lives, and
any segment not named as a server's arena, is never touched. Real POSIX
shared memory under /dev/shm (Linux; macOS cannot list it)."""

from __future__ import annotations

import os
import secrets

import pytest

from cache_service.arena import Arena, new_arena_name, server_arenas, sweep_arenas, unlink_arena

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="lists /dev/shm (Linux)")

DEAD, LIVE = 999_999_001, 999_999_002  # above any pid_max: these pids have no process
# Other servers may run on this machine: a predicate here says "gone" only of DEAD.


@pytest.fixture
def segments():
    made: list[str] = []

    def make(name: str) -> str:
        Arena.create(name, 1 << 16).close()
        made.append(name)
        return name

    yield make
    for name in made:
        unlink_arena(name)


def test_a_dead_supervisors_arena_is_unlinked_and_a_live_ones_kept(segments):
    dead = segments(f"tandem-{DEAD}-{secrets.token_hex(4)}")
    live = segments(f"tandem-{LIVE}-{secrets.token_hex(4)}")
    asked: list[int] = []

    def owner_alive(pid: int) -> bool:
        asked.append(pid)
        return pid != DEAD  # never False for another server's arena on this machine

    removed = sweep_arenas(owner_alive)
    assert dead in removed and live not in removed
    assert not os.path.exists(f"/dev/shm/{dead}") and os.path.exists(f"/dev/shm/{live}")
    assert {DEAD, LIVE} <= set(asked)


def test_segments_not_named_as_a_servers_arena_are_never_touched(segments):
    """A test's arena, another program's segment, a name that only looks alike."""
    others = [segments(new_arena_name("tsc")), segments(new_arena_name()), segments(f"tandem-{DEAD}-XYZ"),
              segments(f"tandemx-{DEAD}-ab"), segments(f"tandem-{DEAD}")]
    sweep_arenas(lambda pid: pid != DEAD)
    assert all(os.path.exists(f"/dev/shm/{name}") for name in others)
    assert not {name for name, _ in server_arenas()} & set(others)


def test_another_users_segment_is_not_listed(segments):
    """/dev/shm is shared by every user; only this user's segments are candidates."""
    name = segments(f"tandem-{DEAD}-{secrets.token_hex(4)}")
    assert (name, DEAD) in server_arenas()
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    os.chown(f"/dev/shm/{name}", 12345, -1)
    assert (name, DEAD) not in server_arenas()
    assert name not in sweep_arenas(lambda pid: pid != DEAD)
