"""Rank 0's records to its followers (workers/group/lockstep.py) over real
ipc sockets: order, heartbeats, deadlines, a follower's death noticed, and
the seeds rank 0 decides for every rank."""

from __future__ import annotations

import time

import pytest
import zmq

from protos import transport
from protos.messages import Cancel, DecodeRequest, KVHandoff, PrefillRequest, SamplingParams
from workers.group.lockstep import GroupBroken, Recorder, RecordStream, pin_seed


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def pair(ctx, run_dir, beat_s=0.05):
    address = transport.ipc_address(str(run_dir), "g.lockstep.r1")
    return Recorder(ctx, [address], beat_s=beat_s), RecordStream(ctx, address)


def test_messages_go_with_the_next_unit_in_the_order_handled(ctx, tmp_path):
    recorder, stream = pair(ctx, tmp_path)
    req = PrefillRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0), decode_worker="g")
    recorder.message(req)
    recorder.message(Cancel("r0"))
    recorder.unit("prefill")
    recorder.unit("reads", wait=True)
    recorder.send_op("stop")
    assert stream.next(5.0) == [("m", req), ("m", Cancel("r0")), ("u", "prefill", False)]
    assert stream.next(5.0) == [("u", "reads", True)]
    assert stream.next(5.0) == [("stop",)]
    recorder.close()
    stream.close()


def test_beat_sends_waiting_messages_or_a_heartbeat_once_due(ctx, tmp_path):
    recorder, stream = pair(ctx, tmp_path, beat_s=0.0)
    recorder.message(Cancel("r9"))
    recorder.beat()
    recorder.beat()
    assert stream.next(5.0) == [("m", Cancel("r9"))]
    assert stream.next(5.0) == []  # the heartbeat: an empty record
    recorder.beat_s = 3600.0
    recorder.beat()  # not due: nothing sent
    with pytest.raises(GroupBroken, match="no record from rank 0"):
        stream.next(0.3)
    recorder.close()
    stream.close()


def test_rank_0_beats_from_a_thread_while_its_loop_lives_and_falls_silent_once_stuck(ctx, tmp_path):
    """A loop inside a long unit sends nothing itself: the beat thread keeps
    its followers from taking the silence for death, as long as the loop
    showed life within `alive_s` (the unit deadline); a loop stuck past it
    goes silent, and a follower gives up on it; life again, beats again."""
    recorder, stream = pair(ctx, tmp_path, beat_s=0.02)
    recorder.start_beats(alive_s=1.0)
    recorder.unit("decode")  # and stays in it
    assert stream.next(5.0) == [("u", "decode", False)]
    assert [stream.next(1.0) for _ in range(3)] == [[], [], []]  # beats, not silence
    with pytest.raises(GroupBroken, match="no record from rank 0"):
        for _ in range(500):  # the beats sent while it counted as alive, then none
            assert stream.next(0.3) == []
    recorder.alive()
    assert stream.next(5.0) == []
    recorder.close()
    stream.close()


def test_a_follower_stops_waiting_when_asked(ctx, tmp_path):
    _, stream = pair(ctx, tmp_path)
    assert stream.next(30.0, stopping=lambda: True) is None


def test_rank_0_notices_a_follower_gone_and_a_send_nobody_takes(ctx, tmp_path):
    recorder, stream = pair(ctx, tmp_path)
    recorder.unit("decode")
    assert stream.next(5.0) == [("u", "decode", False)]
    assert not recorder.follower_lost(0.1)  # connected, alive
    stream.close()  # what a dead follower's process does to its socket
    assert recorder.follower_lost(5.0)
    recorder.socks[0].setsockopt(zmq.SNDTIMEO, 100)
    # A send may still go into the closing pipe until the socket has handled
    # its end (ZeroMQ does that lazily, on a later call): keep sending, 5 s at most.
    deadline = time.monotonic() + 5.0
    with pytest.raises(GroupBroken, match="took no record"):
        while time.monotonic() < deadline:
            recorder.unit("decode")
    recorder.send_op("stop", wait=False)  # a stop never waits
    recorder.close()


def test_rank_0_picks_the_seed_of_a_sampled_request_without_one():
    sampled = PrefillRequest("a", [1], SamplingParams(max_tokens=2, temperature=0.7), decode_worker="g")
    pinned = pin_seed(sampled)
    assert isinstance(pinned.sampling.seed, int) and pinned.prompt_tokens == [1]
    assert pin_seed(pinned) is pinned  # seeded: as it is
    greedy = DecodeRequest("b", [1], 5, KVHandoff("b", 1, 0, local=True), SamplingParams(max_tokens=2, temperature=0.0))
    assert pin_seed(greedy) is greedy  # greedy draws nothing
    decode = DecodeRequest("c", [1], 5, KVHandoff("c", 1, 0, local=True), SamplingParams(max_tokens=2, temperature=1.0))
    assert pin_seed(decode).sampling.seed is not None
    assert pin_seed(Cancel("d")) == Cancel("d")


def test_a_decode_step_carries_rank_0s_costs_and_a_follower_drafts_as_rank_0_does(ctx, tmp_path):
    """How many tokens a row drafts follows what steps cost, timed per rank
    (StepCosts): a follower that timed its own steps could draft another k
    and run another verify pass, and the group's collectives would hang. So
    a decode unit's record carries rank 0's costs, and a follower that loads
    them chooses every k as rank 0 does."""
    from workers.decode.prompt_lookup import PromptLookup
    from workers.decode.speculation import Speculation

    leader, follower = (Speculation(PromptLookup(), max_tokens=8, max_rows=8) for _ in range(2))
    leader.costs.ordinary(1, 0.010)
    leader.costs.speculative(1, 5, 0.030)  # dear drafts on rank 0's machine
    follower.costs.ordinary(1, 0.010)
    follower.costs.speculative(1, 9, 0.0105)  # cheap ones on the follower's
    assert leader.best_k(0.6, 1) != follower.best_k(0.6, 1)
    recorder, stream = pair(ctx, tmp_path)
    recorder.unit("decode", costs=leader.costs.state())
    [op] = stream.next(5.0)
    assert op[:3] == ("u", "decode", False)
    follower.costs.load(op[3])
    assert all(follower.best_k(rate, rows) == leader.best_k(rate, rows) for rate in (0.3, 0.6, 0.9) for rows in (1, 2))
    recorder.close()
    stream.close()
