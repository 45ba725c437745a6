"""One KV block's file: a header (magic, format version, payload length,
SHA-256 of the payload), then the payload.

Apart from the disk tier (disk_tier.py: which files exist, their recency,
the writer thread) and from where files go (disk_layout.py) because this is
the format alone: what a reader checks before a byte is served.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Optional

MAGIC = b"TNDMKVB\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256(payload)


def header_of(data: memoryview) -> bytes:
    """The header a file of payload `data` starts with."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, data.nbytes, hashlib.sha256(data).digest())


def read_verified(f, dest: memoryview) -> Optional[str]:
    """Read one block file into `dest`; what is wrong with it, or None."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return "truncated header"
    magic, version, length, digest = HEADER.unpack(head)
    if magic != MAGIC:
        return "bad magic"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    if length != dest.nbytes:
        return f"payload length {length} in the header, {dest.nbytes} expected from the file size"
    got = f.readinto(dest)
    if got != length:
        return f"truncated payload ({got} of {length} bytes)"
    if f.read(1):
        return "bytes past the payload"
    if hashlib.sha256(dest).digest() != digest:
        return "checksum mismatch"
    return None
