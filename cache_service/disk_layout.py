"""The disk tier's folder: where a block's file goes, what its names look
like, how folders and files are made private, and how `tandem cache clear`
empties one.

    <root>/<first hex byte>/<hash hex>.kvb            a block (block_file.py: its bytes)
    <root>/<first hex byte>/<hash hex>.kvb.<pid>.<thread>.tmp   a block being written

KV can be turned back into the prompt that made it: the root and its folders
are 0700 and the files 0600, each created so (the umask can only take bits
off, and a file's mode is set on its descriptor before a byte is written), so
none is ever open to others, not even for an instant.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from typing import Optional

from cache_service.checks import HASH_MAX_BYTES, HASH_MIN_BYTES

log = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_TMP_NAME = re.compile(r"([0-9a-f]+\.kvb)\.\d+\.\d+\.tmp")  # <block file name>.<pid>.<thread>.tmp
_SUB_NAME = re.compile(r"[0-9a-f]{2}")
DIR_MODE = 0o700
FILE_MODE = 0o600
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_IGNORED = frozenset((".DS_Store",))  # Finder's, in any folder it showed


def block_path(root: str, h: bytes) -> str:
    name = h.hex()
    return os.path.join(root, name[:2], name + SUFFIX)


def hash_of_name(name: str) -> Optional[bytes]:
    """The hash a block file's name holds; None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[:-len(SUFFIX)]
    try:
        h = bytes.fromhex(stem)
    except ValueError:
        return None
    if h.hex() != stem or not HASH_MIN_BYTES <= len(h) <= HASH_MAX_BYTES:
        return None
    return h


# ------------------------------------------------------- private folders --

def make_private_dir(path: str) -> None:
    """`path` as a folder only this user can enter: created 0700 (missing
    parents too), an existing one of this user's closed to 0700. OSError
    when it is not a folder or belongs to another user (who could read it)."""
    missing, top = [], path
    while not os.path.exists(top):
        missing.append(top)
        parent = os.path.dirname(top)
        if parent == top:
            break
        top = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, DIR_MODE)  # the umask only ever takes bits off...
        except FileExistsError:  # another service made it meanwhile
            continue
        os.chmod(folder, DIR_MODE)  # ...owner bits too: put them back before making the next one inside
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a folder")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to user {st.st_uid}, not to this one ({os.geteuid()}): "
                              "the KV disk tier needs a folder of its own")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


def close_mode(path: str, mode: int) -> None:
    """Set `path`'s mode unless it is a link; a failure is logged, not raised."""
    try:
        st = os.lstat(path)
        if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
            os.chmod(path, mode)
    except OSError as exc:
        log.warning("could not make %s private: %s", path, exc)


def create_private_file(path: str) -> int:
    """A new file at `path`, 0600 from its first instant, open for writing
    (a descriptor); its folder is made (0700) when missing. A leftover of a
    crashed writer with our pid and thread (so our name) is replaced."""
    for _ in range(2):
        try:
            fd = os.open(path, _CREATE_FLAGS, FILE_MODE)
        except FileNotFoundError:  # the folder's first block, or `tandem cache clear` removed it
            make_private_dir(os.path.dirname(path))
            continue
        except FileExistsError:
            unlink(path)
            continue
        break
    else:
        fd = os.open(path, _CREATE_FLAGS, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # the umask may have taken bits off
    except OSError:
        os.close(fd)
        raise
    return fd


# --------------------------------------------------------------- clearing --

def tier_files(root: str) -> list[str]:
    """Every file a disk tier keeps under `root` (block files, temp files).
    ValueError naming the first entry a disk tier would not have written
    there: such a folder is not (only) a KV cache, and is left alone."""
    files = []
    for sub in _entries(root):
        if sub.name in _IGNORED:
            continue
        if not (_SUB_NAME.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
            raise ValueError(f"{root} does not look like a Tandem KV cache folder: it holds {sub.name!r}")
        for entry in _entries(sub.path):
            if entry.name in _IGNORED:
                continue
            tmp = _TMP_NAME.fullmatch(entry.name)
            name = tmp.group(1) if tmp else entry.name
            if hash_of_name(name) is None or name[:2] != sub.name or not entry.is_file(follow_symlinks=False):
                raise ValueError(f"{root} does not look like a Tandem KV cache folder: it holds "
                                 f"{os.path.join(sub.name, entry.name)!r}")
            files.append(entry.path)
    return files


def clear_folder(root: str) -> tuple[int, int]:
    """Delete the disk tier's files under `root` and its emptied folders
    (`root` itself stays): (files, bytes) deleted. The whole folder is
    checked before anything is deleted (tier_files' ValueError; OSError
    when it cannot be read). A service using the folder meanwhile just
    misses the blocks deleted."""
    if not os.path.lexists(root):
        return 0, 0
    if not os.path.isdir(root):
        raise ValueError(f"{root} is not a folder")
    removed = nbytes = 0
    for path in tier_files(root):
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
        except FileNotFoundError:  # a running service evicted it (or renamed its temp file) meanwhile
            continue
        removed += 1
        nbytes += size
    for sub in scandir(root):
        if _SUB_NAME.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False):
            try:
                os.rmdir(sub.path)
            except OSError:  # a running service wrote a new block there meanwhile
                pass
    return removed, nbytes


def _entries(path: str) -> list:
    """A folder's entries by name; OSError when it cannot be read (a clear
    must not take an unreadable folder for an empty one)."""
    with os.scandir(path) as it:
        return sorted(it, key=lambda e: e.name)


def scandir(path: str) -> list:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not delete %s: %s", path, exc)
