"""What a caller's arguments to the cache service must be: block hashes of a
bounded length, positive finite seconds, positive byte counts.

Apart from the index that enforces them on every call (block_index.py)
because the disk tier's file names keep the same hash rule (disk_layout.py).
"""

from __future__ import annotations

import math

HASH_MIN_BYTES = 16  # design rule: block hashes are at least 128 bits, never truncated
HASH_MAX_BYTES = 64


def check_hashes(hashes) -> None:
    if not isinstance(hashes, (list, tuple)):
        raise ValueError("hashes must be a list of bytes")
    for h in hashes:
        if not isinstance(h, bytes) or not HASH_MIN_BYTES <= len(h) <= HASH_MAX_BYTES:
            raise ValueError(f"every hash must be {HASH_MIN_BYTES} to {HASH_MAX_BYTES} bytes, "
                             f"got {type(h).__name__} of length {len(h) if isinstance(h, bytes) else '-'}")


def check_seconds(value, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")


def check_nbytes(value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"nbytes must be a positive integer, got {value!r}")
