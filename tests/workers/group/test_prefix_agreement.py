"""A worker group's prefix cache (workers/group/prefix_agreement.py): ranks
whose caches hold different hits agree on one every rank can use, in the
same collectives; two real ranks over MLX's ring backend, and the
agreement's rounds over simulated ranks."""

from __future__ import annotations

import textwrap
import threading

from tests.support.ring_ranks import run_ring_ranks
from workers.group.prefix_agreement import agree_hit


class SimulatedGroup:
    """min_and_max over N threads, one a rank: every rank's value in, the
    smallest and largest out (a collective that waits for all, as MLX's)."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=10)
        self.values = [0] * n
        self.rounds = 0

    def extremes(self, rank: int, value: int) -> tuple[int, int]:
        self.values[rank] = value
        self.barrier.wait()
        out = min(self.values), max(self.values)
        if rank == 0:
            self.rounds += 1
        self.barrier.wait()  # nobody writes the next round's values before all read these
        return out


def run_ranks(hits: list[int], cuts: list) -> tuple[list, int]:
    """Every rank's agree_hit at once: [(cache, hit) per rank], rounds."""
    group, out = SimulatedGroup(len(hits)), [None] * len(hits)

    def rank(r: int) -> None:
        out[r] = agree_hit(f"kv of {hits[r]}", hits[r], lambda h: group.extremes(r, h), cuts[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(hits))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in the agreement"
    return out, group.rounds


def exact_cut(n: int) -> tuple:
    """KV blocks: any shorter prefix of a hit, exactly."""
    return (f"kv cut to {n}", n) if n else (None, 0)


def snapshots_at(points: set):
    """A snapshot cache: the latest of its snapshots at or before n."""
    return lambda n: max(((f"snapshot {p}", p) for p in points if p <= n), default=(None, 0), key=lambda x: x[1])


def test_equal_hits_agree_at_once():
    out, rounds = run_ranks([24, 24], [exact_cut, exact_cut])
    assert out == [("kv of 24", 24)] * 2 and rounds == 1


def test_kv_blocks_agree_on_the_smallest_hit_a_tail_included():
    out, rounds = run_ranks([37, 48, 37, 40], [exact_cut] * 4)
    assert [hit for _, hit in out] == [37] * 4 and rounds == 2
    assert out[1] == ("kv cut to 37", 37) and out[0] == ("kv of 37", 37)  # the smallest keeps what it read


def test_snapshots_go_down_until_every_rank_has_one():
    # Rank 0 has snapshots at 32 and 96, rank 1 at 32 and 64: both have 32.
    out, _ = run_ranks([96, 64], [snapshots_at({32, 96}), snapshots_at({32, 64})])
    assert out == [("snapshot 32", 32)] * 2
    # No snapshot in common: the whole prompt, on every rank.
    out, rounds = run_ranks([96, 64], [snapshots_at({32, 96}), snapshots_at({64})])
    assert out == [(None, 0)] * 2 and rounds == 4


def test_a_cut_that_does_not_cut_computes_the_whole_prompt():
    out, _ = run_ranks([16, 8], [exact_cut, lambda n: ("still 16", 16)])
    out_b, _ = run_ranks([8, 16], [exact_cut, lambda n: ("still 16", 16)])
    assert out[1] == ("kv of 8", 8) and out_b == [(None, 0), (None, 0)]


RANK = textwrap.dedent("""
    import json, sys
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from workers.group.prefix_agreement import group_prefix, rank_shard
    from protos.group_plan import RankSpec
    from workers.group.ranks import join_group
    from workers.kv.block_hash import BlockHasher, block_extra

    rank, hostfile = int(sys.argv[1]), sys.argv[2]
    # What each rank's own cache holds, by prompt (its owner here).
    HITS = [{"tail": 13, "same": 8, "lost": 0, "short": 99}, {"tail": 9, "same": 8, "lost": 12, "short": 99}][rank]

    class Blocks:
        "A PrefixCache as the agreement sees it: this rank's hits, as per-layer KV."
        kind, block_size, stats = "blocks", 4, "this rank's counters"

        def __init__(self, shard=None):  # made as make_prefix_cache makes a rank's: keyed by its shard
            self.hasher = BlockHasher(block_extra(b"f" * 32, "float32", 4), 4).for_shard(shard)

        def fetch(self, tokens, max_blocks, owner, per_block=None, compute_s_per_token=None, *, salt=""):
            hit = HITS[owner]
            if not hit:
                return None, 0
            c = KVCache()
            c.state = (mx.zeros((1, 2, hit, 8)), mx.zeros((1, 2, hit, 8)), hit)
            return [c, c], hit

    group = join_group(RankSpec("g", rank, 2, hostfile), deadline_s=60)
    prefix = group_prefix(Blocks(rank_shard(group)), group)
    out = {"key": prefix.hasher.hashes(list(range(8)))[0].hex(), "stats": prefix.stats,
           "held": prefix.hold(list(range(8)), "x", 1.0).hashes}
    for owner, n in (("tail", 20), ("same", 20), ("lost", 20), ("short", 3)):
        cache, hit = prefix.fetch(list(range(n)), (n - 1) // 4, owner)
        out[owner] = [hit, None if cache is None else [(c.offset, c.keys.shape[2]) for c in cache]]
    # A rank without a prefix cache: the group goes without.
    out["one lacks"] = group_prefix(Blocks() if rank == 0 else None, group) is None
    print(json.dumps(out), flush=True)
""")


def test_two_ring_ranks_agree_on_every_hit_and_keep_their_own_keys(tmp_path):
    r0, r1 = run_ring_ranks(RANK, tmp_path)
    assert r0["key"] != r1["key"]  # each rank's shard under its own key
    assert r0["stats"] == "this rank's counters" and r0["held"] == [] == r1["held"]
    for r in (r0, r1):
        assert r["tail"] == [9, [[9, 9], [9, 9]]]  # rank 0's 13 cut to rank 1's 9
        assert r["same"] == [8, [[8, 8], [8, 8]]]
        assert r["lost"] == [0, None]  # rank 0 has nothing: neither uses its hit
        assert r["short"] == [0, None]  # no full block within reach: no lookup, no agreement
        assert r["one lacks"] is True
