"""A worker group's KV handoff rank by rank (workers/group/handoff_shards.py):
two real ring ranks gather their parts into rank 0's handoff, and fail alike
when one could not write its part; a decode rank takes its own part, and a
handoff made for another group (or none) is refused the same way on every rank."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from protos.messages import ArenaSlice, DecodeRequest, KVHandoff, KVShard, SamplingParams
from tests.support.ring_ranks import run_ring_ranks
from workers.group.handoff_shards import own_part

RANK = textwrap.dedent("""
    import json, sys
    from cache_service.client import CacheUnavailable
    from protos.messages import ArenaSlice, KVHandoff
    from workers.group.handoff_shards import hand_off
    from protos.group_plan import RankSpec
    from workers.group.ranks import join_group

    rank, hostfile = int(sys.argv[1]), sys.argv[2]
    group = join_group(RankSpec("g", rank, 2, hostfile), deadline_s=60)
    given_back = []

    def write(ok):
        def w():
            if not ok:
                raise CacheUnavailable("KV handoff of 4096 bytes refused: arena full")
            # Rank r's part of the KV (its heads), at a place of its own in the arena.
            layers = [[ArenaSlice(4096 * rank + 64 * i, 64, "float32", [1, 1, 4, 4]) for i in range(2)]]
            return KVHandoff("r1", 4, 4, arena="arena-a", allocation=10 + rank, layers=layers)
        return w

    out = {}
    h = hand_off(group, write(True), given_back.append)
    out["shards"] = [[s.arena, s.allocation, s.layers[0][1].offset] for s in h.shards]
    out["own"] = [h.allocation, h.layers[0][0].offset]
    try:  # rank 1's reservation refused: both ranks fail the prompt, rank 0 gives its part back
        hand_off(group, write(rank == 0), given_back.append)
        out["second"] = "handed off"
    except CacheUnavailable as exc:
        out["second"] = str(exc)
    out["given_back"] = [g.allocation for g in given_back]
    print(json.dumps(out), flush=True)
""")


def test_two_ring_ranks_gather_their_parts_and_fail_alike(tmp_path):
    r0, r1 = run_ring_ranks(RANK, tmp_path)
    assert r0["own"] == [10, 0] and r1["own"] == [11, 4096]
    assert r0["shards"] == [["arena-a", 11, 4096 + 64]]  # rank 1's part, as rank 1 wrote it
    assert r1["shards"] == []  # a follower's handoff goes nowhere: it reads no part
    assert "rank 1 of the group could not write its part" in r0["second"]
    assert r1["second"] == "KV handoff of 4096 bytes refused: arena full"
    assert r0["given_back"] == [10] and r1["given_back"] == []  # rank 0's written part, not left to its TTL


def layers_at(offset: int) -> list:
    return [[ArenaSlice(offset, 64, "float32", [1, 1, 4, 4]), ArenaSlice(offset + 64, 64, "float32", [1, 1, 4, 4])]]


def decode_request(handoff: KVHandoff) -> DecodeRequest:
    return DecodeRequest("r1", [1, 2, 3, 4], 5, handoff, SamplingParams(max_tokens=4, temperature=0))


def test_each_decode_rank_takes_its_own_part():
    parts = [KVShard("arena-b", 21, layers_at(4096)), KVShard("arena-b", 22, layers_at(8192))]
    msg = decode_request(KVHandoff("r1", 4, 4, arena="arena-a", allocation=20, layers=layers_at(0), shards=parts))
    mine = [own_part(msg, r, 3).handoff for r in range(3)]
    assert [(h.arena, h.allocation, h.layers) for h in mine] == [
        ("arena-a", 20, layers_at(0)), ("arena-b", 21, layers_at(4096)), ("arena-b", 22, layers_at(8192))]
    assert all(h.shards == [] and h.num_tokens == 4 for h in mine)
    # Kept in its process (a colocated group), or no handoff: nothing to take.
    local = decode_request(KVHandoff("r1", 4, 4, local=True))
    assert own_part(local, 1, 2) is local


@pytest.mark.parametrize("shards, rank, size, says", [
    (1, 0, 1, "made by a group of 2 cannot be read by a worker alone"),
    (0, 1, 2, "made by a worker alone cannot be read by a group of 2"),
    (2, 1, 2, "made by a group of 3 cannot be read by a group of 2"),
])
def test_a_handoff_from_another_group_shape_is_refused(shards, rank, size, says):
    parts = [KVShard("arena-a", 30 + i, layers_at(4096 * (i + 1))) for i in range(shards)]
    msg = decode_request(KVHandoff("r1", 4, 4, arena="arena-a", allocation=20, layers=layers_at(0), shards=parts))
    with pytest.raises(ValueError, match=says):
        own_part(msg, rank, size)


def test_a_group_takes_no_kv_by_value():
    payload = np.zeros(128, np.uint8)
    msg = decode_request(KVHandoff("r1", 4, 4, layers=layers_at(0), payload=payload))
    assert own_part(msg, 0, 1) is msg  # a worker alone reads it from the message
    with pytest.raises(ValueError, match="not by value"):
        own_part(msg, 0, 2)
    # Parts by value (a remote worker's, say) name slots in this host's arena: refused, nothing read.
    forged = decode_request(KVHandoff("r1", 4, 4, layers=layers_at(0), payload=payload,
                                      shards=[KVShard("tandem-arena-0", 7, layers_at(0))]))
    with pytest.raises(ValueError, match="made by a group of 2 cannot be read by a worker alone"):
        own_part(forged, 0, 1)
