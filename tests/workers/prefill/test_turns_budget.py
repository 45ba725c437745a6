"""The prefill turns' time budget (workers/prefill/turns.py) alone, on a fake
clock: a step's seconds are the own time of the prompt it ran and are charged
to each waiting prompt that arrived before it; a prompt charged more than
OVERTAKE_SHARE of its own time runs next until its own time pays for it. No
model: jobs are stand-ins with a token count."""

from __future__ import annotations

from protos.messages import PrefillRequest, SamplingParams
from workers.prefill.turns import OVERTAKE_SHARE, Turns

CHUNK = 16


class _Job:
    def __init__(self, remaining: int):
        self.remaining = remaining


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _req(rid: str, n: int) -> PrefillRequest:
    return PrefillRequest(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), "w")


def _setup(*prompts: tuple[str, int]):
    clock = _Clock()
    turns = Turns(chunk_size=CHUNK, clock=clock)
    for rid, n in prompts:
        turns.add(_req(rid, n))
    return turns, clock


def _run(turns: Turns, clock: _Clock, c, seconds: float, done: bool = False, since=None) -> None:
    """One step for `c` that takes `seconds` (a chunk off a started prompt's
    job; `done`: it finishes, and is dropped, inside the step)."""
    with turns.timed(c, since):
        clock.now += seconds
        if hasattr(c, "job"):
            c.job.remaining -= min(CHUNK, c.job.remaining)
        if done:
            turns.drop(c.request_id)


def test_a_prompt_alone_is_never_held_back():
    """One prompt alone: its turn every step, never owed, nothing charged."""
    turns, clock = _setup(("long", 10 * CHUNK))
    long = turns.start(turns.next_to_start(), _Job(10 * CHUNK))
    for _ in range(9):
        assert turns.pick() is long and not turns.owed("long")
        _run(turns, clock, long, 1.0)
    assert turns.state() == [["long", 9.0, 0.0]]
    _run(turns, clock, long, 1.0, done=True)
    assert not turns and turns.state() == []


def test_overtakes_are_charged_their_time_and_earned_back():
    """A short prompt's first overtake of a long one is free; its time is
    then owed to the long one, which runs (before a newer, shorter prompt)
    until OVERTAKE_SHARE of its own time covers it. Prompts that arrived
    later are never charged for an earlier one's steps."""
    turns, clock = _setup(("long", 10 * CHUNK))
    long = turns.start(turns.next_to_start(), _Job(10 * CHUNK))
    _run(turns, clock, long, 1.0)
    turns.add(_req("s1", 4))
    s1 = turns.start(turns.next_to_start(), _Job(4))
    assert turns.pick() is s1  # 1 x 0.15 < the 0.5 it will take: checked before, not for it
    _run(turns, clock, s1, 0.5, done=True)
    assert turns.owed("long")
    turns.add(_req("s2", 4))
    runs = 0
    while turns.owed("long"):
        assert turns.pick() is long  # though s2 has fewer tokens left
        _run(turns, clock, long, 1.0)
        runs += 1
    assert runs == 3  # 3 s of its own x 0.15 < 0.5 <= 4 s x 0.15
    assert turns.pick().request_id == "s2" and dict((r, lost) for r, _, lost in turns.state()) == {"long": 0.5}


def test_a_batched_pass_is_one_overtake_charged_its_time():
    """A pass led by one short prompt, with others finishing inside it
    (workers/prefill/batch.py), charges the long prompt the pass's time
    once, however many rows it took; the rows are forgotten."""
    turns, clock = _setup(("long", 10 * CHUNK))
    long = turns.start(turns.next_to_start(), _Job(10 * CHUNK))
    _run(turns, clock, long, 4.0)
    for i in range(8):
        turns.add(_req(f"s{i}", 4))
    lead = turns.pick()
    with turns.timed(lead):
        clock.now += 0.5
        for i in range(8):
            turns.drop(f"s{i}")
    assert turns.state() == [["long", 4.0, 0.5]] and not turns.owed("long")  # 0.5 <= 4 x 0.15
    assert OVERTAKE_SHARE * 4.0 < 8 * 0.5  # eight passes of their own would have been owed


def test_a_step_counts_from_its_start():
    """A step timed from `since` (the role's step start: a queued prompt
    started then, its prefix loaded) counts that time too."""
    turns, clock = _setup(("long", 10 * CHUNK))
    long = turns.start(turns.next_to_start(), _Job(10 * CHUNK))
    since = clock()
    clock.now += 2.0  # the start
    _run(turns, clock, long, 1.0, since=since)
    assert turns.state() == [["long", 3.0, 0.0]]


def test_every_rank_picks_on_rank_0s_times():
    """A group's follower that loads rank 0's state before each step picks
    as rank 0 does, whatever its own clock says."""
    picks, states = [], []  # rank 0's state before each of its steps
    for clock_rate, follower in ((1.0, False), (0.0, True)):
        turns, clock = _setup(("long", 10 * CHUNK))
        picks.append([])
        long = turns.start(turns.next_to_start(), _Job(10 * CHUNK))
        for step in range(8):
            turns.add(_req(f"s{step}", 4))
            if follower:
                turns.load(states[step])
            else:
                states.append(turns.state())
            c = turns.pick()
            if not hasattr(c, "job"):
                c = turns.start(c, _Job(4))
            picks[-1].append(c.request_id)
            _run(turns, clock, c, clock_rate * (1.0 if c is long else 0.4), done=c is not long)
    assert picks[0] == picks[1] == ["s0", "long", "long", "long", "s1", "long", "long", "long"]
