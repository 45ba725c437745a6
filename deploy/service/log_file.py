"""`tandem service logs` on macOS: the LaunchAgent's log file, its last lines
and, with -f, what is appended (a truncated or replaced file is read anew)."""

from __future__ import annotations

import os
import sys
import time
from collections import deque

POLL_S = 0.5
TAIL_CHUNK = 1 << 16


def last_lines(path: str, n: int, end: int | None = None) -> list:
    """The last n lines before byte `end` (default: the end of the file),
    read backwards: a log may be large."""
    if n <= 0:
        return []
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell() if end is None else min(end, f.tell())
        data = b""
        while pos > 0 and data.count(b"\n") <= n:
            pos = max(0, pos - TAIL_CHUNK)
            f.seek(pos)
            data = f.read(end - pos)
    lines = data.decode(errors="replace").splitlines()
    return list(deque(lines, maxlen=n))


def follow(path: str, start: int | None = None, out=sys.stdout, poll_s: float = POLL_S,
           should_stop=lambda: False) -> None:
    """Print what the file holds from byte `start` (default: its end) on, as
    it grows, until Ctrl-C (or should_stop())."""
    f = open(path, "rb")
    f.seek(0, os.SEEK_END)
    if start is not None and start < f.tell():
        f.seek(start)
    try:
        while not should_stop():
            chunk = f.read()
            if chunk:
                out.write(chunk.decode(errors="replace"))
                out.flush()
                continue
            time.sleep(poll_s)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_ino != os.fstat(f.fileno()).st_ino or st.st_size < f.tell():  # replaced or truncated
                f.close()
                f = open(path, "rb")
    except KeyboardInterrupt:
        pass
    finally:
        f.close()
