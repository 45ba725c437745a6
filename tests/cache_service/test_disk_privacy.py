"""The disk tier keeps KV, which can be turned back into the prompts that
made it: another user of the machine must not read it (0600 files in 0700
folders, whatever the umask, and an open tree left by an older version
closed at start), and it must not stay forever (--cache-disk-ttl)."""

from __future__ import annotations

import os
import stat
import time

import pytest

from cache_service.block_file import HEADER
from cache_service.disk_layout import clear_folder
from cache_service.disk_tier import DiskTier

B = 4096


def H(name: str, i: int = 0) -> bytes:
    import hashlib

    return hashlib.sha256(f"{name}/{i}".encode()).digest()


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def disks(tmp_path):
    made = []

    def make(root=None, **kw):
        d = DiskTier(str(root or tmp_path / "cache" / "kv"), 1 << 20, **kw)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close(0.5)


def _tree_modes(root) -> dict:
    found = {os.fspath(root): mode(root)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            found[os.path.join(folder, name)] = mode(os.path.join(folder, name))
    return found


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_blocks_are_private_whatever_the_umask(disks, tmp_path, umask):
    """0o000: a careless service manager; 0o277: one that even takes the
    owner's write bit (the tier must still work, and still be private)."""
    old = os.umask(umask)
    try:
        disk = disks()
        assert disk.write(H("a"), os.urandom(B))
        disk.submit(H("b"), memoryview(bytearray(B)))  # the writer thread's way
        assert disk.wait_idle(5)
    finally:
        os.umask(old)
    root = tmp_path / "cache" / "kv"
    assert mode(tmp_path / "cache") == 0o700  # a missing parent is made private too
    modes = _tree_modes(root)
    assert len(modes) >= 3
    for path, m in modes.items():
        assert m == (0o700 if os.path.isdir(path) else 0o600), (path, oct(m))
    dest = memoryview(bytearray(B))
    assert disk.read_into(H("a"), dest)  # and still readable by its owner


def test_an_open_tree_of_an_older_version_is_closed_at_start(disks, tmp_path):
    root = tmp_path / "kv"
    disk = disks(root)
    for i in range(3):
        disk.write(H("old", i), os.urandom(B))
    disk.close()
    stray = root / "notes.txt"  # not the tier's: left as it is
    stray.write_text("mine")
    for path in _tree_modes(root):
        os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
    again = disks(root)
    assert again.stats()["disk_blocks"] == 3
    modes = _tree_modes(root)
    assert modes.pop(os.fspath(stray)) == 0o644
    assert all(m == (0o700 if os.path.isdir(p) else 0o600) for p, m in modes.items()), modes


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user's takes root")
def test_a_folder_of_another_user_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir()
    os.chmod(root, 0o777)
    os.chown(root, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to user 12345"):
        DiskTier(str(root), 1 << 20)
    assert mode(root) == 0o777  # not ours to change


def _age(disk, h, seconds):
    t = time.time() - seconds
    os.utime(disk.path(h), (t, t))


def test_blocks_unused_past_the_ttl_are_deleted_by_the_expiry_pass(disks):
    day = 86400.0
    disk = disks(ttl_s=day)
    old, used, fresh = H("old"), H("used"), H("fresh")
    for h in (old, used, fresh):
        assert disk.write(h, os.urandom(B))
    _age(disk, old, 2 * day)
    _age(disk, used, 2 * day)
    disk.touch([used])  # read since (any tier's hit touches): not unused
    assert disk.wait_idle(5)
    assert disk.expire_unused() == 1
    assert [h in disk for h in (old, used, fresh)] == [False, True, True]
    assert not os.path.exists(disk.path(old)) and os.path.exists(disk.path(fresh))
    st = disk.stats()
    assert st["disk_expired_total"] == 1 and st["disk_blocks"] == 2
    assert disk.expire_unused(now=time.time() + 2 * day) == 2  # two days on, nobody used them
    assert disk.stats()["disk_blocks"] == 0 and disk.stats()["disk_bytes"] == 0


def test_blocks_unused_past_the_ttl_are_deleted_at_start(disks, tmp_path):
    disk = disks()
    for h in (H("old"), H("fresh")):
        disk.write(h, os.urandom(B))
    disk.close()
    _age(disk, H("old"), 3600)
    assert disks().stats()["disk_blocks"] == 2  # no TTL: kept until evicted
    again = disks(ttl_s=600)
    assert H("old") not in again and H("fresh") in again
    assert not os.path.exists(again.path(H("old")))
    assert again.stats()["disk_expired_total"] == 1 and again.expire_unused() == 0


def test_clear_under_a_running_tier_is_a_miss_not_a_failure(disks, tmp_path):
    """`tandem cache clear` while a server runs: its tier misses the deleted
    blocks and goes on writing new ones."""
    root = tmp_path / "kv"
    disk = disks(root)
    for i in range(4):
        disk.write(H("x", i), os.urandom(B))
    assert clear_folder(str(root)) == (4, 4 * (HEADER.size + B))
    assert not disk.read_into(H("x", 0), memoryview(bytearray(B)))
    assert disk.stats()["disk_corrupt_total"] == 0
    assert disk.write(H("new"), os.urandom(B)) and os.path.exists(disk.path(H("new")))
    assert mode(os.path.dirname(disk.path(H("new")))) == 0o700
    assert disk.expire_unused() == 0  # (no TTL)
