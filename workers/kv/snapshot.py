"""Snapshots: a whole cache state at one token boundary as one byte range.

For caches that cannot be cut into blocks (sliding windows, recurrent
state), the prefix cache keeps the state at one point of a prompt
(snapshot_cache.py). The cache service sees one opaque entry, so the entry
describes itself (below).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Sequence, Tuple

import mlx.core as mx
import numpy as np

from protos.messages import ArenaSlice
from workers.kv.arena_io import STATE_DTYPE_NAMES, align, host_view, release_view
from workers.kv.cache_state import encode_cache
from workers.kv.handoff import read_cache


# --------------------------------------------------------------------------- #
# Snapshots: a whole cache state at one token boundary as one byte range
# --------------------------------------------------------------------------- #
#
# For caches that cannot be cut into blocks, the prefix cache keeps the state
# at one point of a prompt. The cache service sees one opaque entry, so the
# entry describes itself:
#
#   [magic 8 B][header length u32 LE][header JSON][pad to ALIGN][arrays...]
#
# header = {"tokens": n, "layers": [spec, ...], "slices": per layer
# [[offset from the data start, nbytes, dtype, shape], ...]}; each array
# starts on an ALIGN boundary from the data start.

SNAPSHOT_MAGIC = b"TDSNAP01"
_SNAP_HEAD = struct.Struct("<8sI")
_MAX_HEADER = 16 << 20  # a header is kilobytes; anything larger is garbage


@dataclass
class Snapshot:
    """A cache's state at `tokens`, copied to host memory at that point (the
    live cache goes on being updated in place by the chunks that follow)."""

    tokens: int
    header: bytes
    arrays: list  # numpy copies (bfloat16 as its uint16 bits), in header order
    data_offset: int  # where the arrays start, from the snapshot's start
    nbytes: int  # the whole entry


def capture_snapshot(cache: Sequence, tokens: int) -> Snapshot:
    """Copy `cache` (holding exactly the first `tokens` tokens) to host memory."""
    enc = encode_cache(cache, with_meta=True)
    mx.eval(enc.arrays)
    host, slices, pos = [], [], 0
    for layer in enc.arrays:
        out = []
        for a in layer:
            name = STATE_DTYPE_NAMES.get(a.dtype)
            if name is None:
                raise ValueError(f"unsupported state dtype {a.dtype}")
            host.append(np.array(host_view(a)))  # the copy (contiguous)
            out.append([pos, a.nbytes, name, list(a.shape)])
            pos += align(a.nbytes)
        slices.append(out)
    header = json.dumps({"tokens": int(tokens), "layers": enc.meta, "slices": slices},
                        separators=(",", ":")).encode()
    data = align(_SNAP_HEAD.size + len(header))
    return Snapshot(int(tokens), header, host, data, data + pos)


def write_snapshot(buf, offset: int, snap: Snapshot) -> None:
    """Copy a snapshot into `buf` at `offset` (snap.nbytes bytes)."""
    mv = memoryview(buf).cast("B")
    try:
        if offset < 0 or offset + snap.nbytes > mv.nbytes:
            raise ValueError(f"snapshot of {snap.nbytes} bytes at {offset} is outside the buffer "
                             f"of {mv.nbytes} bytes")
        _SNAP_HEAD.pack_into(mv, offset, SNAPSHOT_MAGIC, len(snap.header))
        start = offset + _SNAP_HEAD.size
        mv[start:start + len(snap.header)] = snap.header
        pos = offset + snap.data_offset
        for a in snap.arrays:
            if a.size:
                dst = np.frombuffer(mv, dtype=a.dtype, count=a.size, offset=pos)
                dst[...] = a.reshape(-1)
                del dst
            pos += align(a.nbytes)
    finally:
        release_view(mv)


def read_snapshot(buf, offset: int, nbytes: int) -> Tuple[list, int]:
    """Rebuild the caches of the snapshot entry at `offset` (`nbytes` long).
    Returns (caches, tokens they hold); they own their memory. ValueError for
    anything that is not a whole, well-formed snapshot."""
    mv = memoryview(buf).cast("B")
    try:
        if offset < 0 or nbytes < _SNAP_HEAD.size or offset + nbytes > mv.nbytes:
            raise ValueError(f"snapshot at {offset} (+{nbytes}) is outside the buffer of {mv.nbytes} bytes")
        magic, hlen = _SNAP_HEAD.unpack_from(mv, offset)
        if magic != SNAPSHOT_MAGIC:
            raise ValueError("not a snapshot (bad magic)")
        if hlen > min(_MAX_HEADER, nbytes - _SNAP_HEAD.size):
            raise ValueError(f"snapshot header of {hlen} bytes does not fit its {nbytes}-byte entry")
        start = offset + _SNAP_HEAD.size
        raw = bytes(mv[start:start + hlen])
    finally:
        release_view(mv)
    try:
        header = json.loads(raw)
        tokens, meta, slices = int(header["tokens"]), header["layers"], header["slices"]
        data, end = offset + align(_SNAP_HEAD.size + hlen), offset + nbytes
        layers = [[ArenaSlice(offset=data + int(o), nbytes=int(nb), dtype=str(dt), shape=[int(d) for d in shape])
                   for o, nb, dt, shape in layer] for layer in slices]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"bad snapshot header: {exc}") from None
    if any(s.offset < data or s.offset + s.nbytes > end for layer in layers for s in layer):
        raise ValueError("snapshot slice outside its entry")
    if not meta or not isinstance(meta, list):
        raise ValueError("snapshot without layers")
    return read_cache(buf, layers, meta), tokens
