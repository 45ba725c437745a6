"""The worker loop's phase clock: what it sums and when it reports."""

from workers.loop_clock import LoopClock, part, tally_line


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_phases_are_summed_and_reported_once_per_interval():
    now = FakeClock()
    clock = LoopClock("worker w", interval_s=10.0, clock=now)
    with clock.phase("decode step"):
        now.t += 3.0
    with clock.phase("handle DecodeRequest"):
        now.t += 1.5
    with clock.phase("decode step"):
        now.t += 2.0
    clock.count("tokens", 64)
    now.t += 0.5  # outside any phase
    assert clock.maybe_report() is None  # 7 s of a 10 s interval
    with clock.phase("wait"):
        now.t += 4.0
    line = clock.maybe_report()
    assert line is not None
    assert "decode step 5.00 s/2" in line
    assert "handle DecodeRequest 1.50 s/1" in line
    assert line.index("decode step") < line.index("handle DecodeRequest")  # largest first
    assert "wait 4.00 s" in line and "other 0.50 s" in line and "tokens 64" in line
    # It starts over: the next interval holds only what happens after.
    with clock.phase("prefill"):
        now.t += 11.0
    line = clock.maybe_report()
    assert "prefill 11.00 s/1" in line and "decode step" not in line


def test_an_idle_interval_logs_nothing():
    now = FakeClock()
    clock = LoopClock("worker w", interval_s=1.0, clock=now)
    with clock.phase("wait"):
        now.t += 5.0
    assert clock.maybe_report() is None
    assert not clock.seconds  # reset all the same


def test_a_phase_that_raises_is_still_timed():
    now = FakeClock()
    clock = LoopClock("worker w", clock=now)
    try:
        with clock.phase("decode step"):
            now.t += 2.0
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert clock.seconds["decode step"] == 2.0 and clock.counts["decode step"] == 1

def test_parts_of_a_phase_are_reported_apart_and_not_added_twice():
    now = FakeClock()
    clock = LoopClock("worker w", interval_s=10.0, clock=now)
    with clock.phase("decode step"):
        with clock.part("barrier"):
            now.t += 1.0
        now.t += 2.0
    with clock.phase("wait"):
        now.t += 7.0
    line = clock.maybe_report()
    assert "decode step 3.00 s/1" in line and "barrier 1.00 s/1" in line
    assert "other 0.00 s" in line  # the part is inside its phase, not extra time
    assert line.index("other") < line.index("barrier")  # parts come after the phases


def test_part_adds_to_the_loop_clock_and_to_a_request_tally():
    now = FakeClock()
    clock = LoopClock("worker w", interval_s=10.0, clock=now)
    tally = {}
    with clock.phase("prefill"):
        with part(clock, "chunk", tally):
            now.t += 2.0
        with part(clock, "chunk", tally):
            now.t += 1.0
        with part(None, "first token", tally):  # no loop clock: the tally alone
            pass
    assert clock.parts["chunk"] == 3.0 and clock.counts["chunk"] == 2
    assert set(tally) == {"chunk", "first token"} and all(v >= 0.0 for v in tally.values())
    assert tally_line({"load prefix": 0.0006, "chunk": 0.212}) == "load prefix 0.6 ms, chunk 212.0 ms"
