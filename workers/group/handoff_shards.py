"""A worker group's KV handoff, rank by rank (the split layout with
--tensor-parallel or --pipeline-parallel).

Each rank of a prefill group holds its own shard of a prompt's KV (its KV
heads; a pipeline rank, its layers) and writes it into this host's arena
itself; the same rank of the decode group reads it, so no shard moves
between ranks, let alone hosts. Rank 0 alone talks to the router, so its
KVHandoff must name every rank's part: after writing, the ranks gather
their parts (`hand_off`: two all_gathers, at the same point on every rank,
since every rank finishes the same prompts in the same unit), and rank 0's
handoff carries the others' as `shards`. The gather comes after every
rank's copy into the arena, so once rank 0 sends the handoff each part is
there to read.

A rank that could not write its part (its reservation refused) gathers an
empty one: every rank then gives its own part back and the prompt fails
alike on all (the router hears rank 0's RequestFailed). A group holds no
prefix-cache blocks for a handoff (workers/group/prefix_agreement.py: how
much a handoff refers to would differ per rank), so each part is the whole
prompt's KV shard.

On the decode group every rank gets rank 0's DecodeRequest (the followers
replay it: workers/group/lockstep.py) and takes its own part (`own_part`),
which also refuses a handoff from a group of another size (or from a
worker alone), the same way on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np

from cache_service.client import CacheUnavailable
from protos import codec
from protos.messages import DecodeRequest, KVHandoff, KVShard


def part_of(h: KVHandoff) -> KVShard:
    """Where a rank's own handoff put its KV."""
    return KVShard(h.arena, h.allocation, h.layers)


def gather_parts(group, part: Optional[KVShard]) -> List[bytes]:
    """Every rank's part, by rank, encoded (b"": that rank wrote none; `read_part`
    decodes one). Collectives: every rank must call it at the same point."""
    data = b"" if part is None else codec.encode(part)[0]
    lengths = np.array(mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int32), group=group)).tolist()
    longest = max(lengths)
    if longest == 0:
        return [b""] * len(lengths)
    padded = np.zeros(longest, np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.array(mx.distributed.all_gather(mx.array(padded), group=group)).reshape(len(lengths), longest)
    return [rows[r, :n].tobytes() for r, n in enumerate(lengths)]


def read_part(data: bytes) -> KVShard:
    return codec.decode([data])


def hand_off(group, write: Callable[[], KVHandoff], give_back: Callable[[KVHandoff], None]) -> KVHandoff:
    """This rank's handoff (`write`: write_handoff into the arena), with
    the other ranks' parts as `shards` (rank 0's is the one the router
    gets). Raises on every rank alike when any rank could not write its part."""
    try:
        handoff, error = write(), None
    except Exception as exc:  # noqa: BLE001 - gathered first, so no rank is left in the collective
        handoff, error = None, exc
    parts = gather_parts(group, None if handoff is None else part_of(handoff))
    missing = [r for r, p in enumerate(parts) if not p]
    if missing and handoff is not None:
        give_back(handoff)
    if error is not None:
        raise error
    if missing:
        raise CacheUnavailable(f"rank {', '.join(map(str, missing))} of the group could not write "
                               "its part of the KV handoff")
    # Only rank 0's handoff reaches the router: the followers need not read the parts.
    handoff.shards = [read_part(p) for p in parts[1:]] if group.rank() == 0 else []
    return handoff


def own_part(msg: DecodeRequest, rank: int, size: int) -> DecodeRequest:
    """`msg` with this rank's part of its handoff (rank `rank` of a decode
    group of `size`; a worker alone: 0 of 1). Raises ValueError for a
    handoff whose parts do not match this group (the same on every rank)."""
    h = msg.handoff
    if h is None:
        return msg
    if h.payload is not None and size > 1:
        raise ValueError("a worker group takes KV through this host's arena, rank by rank, not by value")
    want = size - 1 if not h.local and h.payload is None else 0
    if len(h.shards) != want:
        made = f"a group of {len(h.shards) + 1}" if h.shards else "a worker alone"
        here = f"a group of {size}" if size > 1 else "a worker alone"
        raise ValueError(f"a KV handoff made by {made} cannot be read by {here}: each rank holds its own shard")
    if not h.shards:
        return msg
    if rank == 0:
        return dataclasses.replace(msg, handoff=dataclasses.replace(h, shards=[]))
    s = h.shards[rank - 1]
    return dataclasses.replace(msg, handoff=dataclasses.replace(h, arena=s.arena, allocation=s.allocation,
                                                                 layers=s.layers, shards=[]))
