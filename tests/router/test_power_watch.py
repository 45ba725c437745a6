"""The router follows the power policy live: readings in, a change logged
and told to admission and to every model worker's next heartbeat; a reader
that fails or hangs changes nothing. The readings are scripted here (the
platform readers have their own tests with recorded outputs)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from environment.power.state import PowerState
from environment.settings import Settings
from protos.messages import WorkerHello
from router import power_watch
from router.guards.admission import Admission
from router.api.errors import ApiError
from router.power_watch import PowerWatch

AC = PowerState(source="ac", reader="test")
LOW = PowerState(source="battery", percent=12, reader="test")
HOT = PowerState(source="ac", thermal="critical", reader="test")


def _watch(**kw) -> PowerWatch:
    return PowerWatch(Settings(max_batch=32, prefill_batch=16, max_queue=100, **kw), read=lambda s: AC)


def test_a_change_reaches_admission_and_each_worker_once(caplog):
    watch = _watch()
    admission = Admission(capacity=132, timeout_s=5)
    admission.follow(watch)
    hello = WorkerHello("decode-0", ["decode"], 1, "ready")
    limits = watch.limits_for(hello)  # a worker that never heard of a policy gets the one in force
    assert limits is not None and limits.policy == "performance" and limits.max_batch == 32
    hello.limits_version = limits.version
    assert watch.limits_for(hello) is None  # echoed: nothing more to send
    assert not watch.update(AC)
    with caplog.at_level(logging.WARNING, logger="tandem.power"):
        assert watch.update(LOW)
    assert "performance -> saver" in caplog.text and "12%" in caplog.text
    saver = watch.limits_for(hello)
    assert saver.policy == "saver" and saver.max_batch == 4 and saver.pace_tokens_per_s > 0
    assert admission.capacity == 4 + 8 and admission.configured == 132
    assert watch.limits_for(WorkerHello("vision-0", ["vision"], 2, "ready")) is None  # no limits to apply
    watch.update(AC)
    assert admission.capacity == 132 and watch.changes == 2


def test_critical_heat_refuses_new_requests_with_retry_after_and_keeps_admitted_ones():
    watch = _watch()
    admission = Admission(capacity=10, timeout_s=5)
    admission.follow(watch)
    held = admission.admit(100)
    watch.update(HOT)
    with pytest.raises(ApiError) as err:
        admission.admit(100)
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "30"
    assert "thermal state critical" in err.value.message and err.value.code == "power_policy"
    assert admission.admitted == 1  # the admitted request goes on
    held.release()
    watch.update(AC)
    admission.admit(100).release()
    assert watch.health()["refusing_new_requests"] is False


def test_health_says_what_is_read_and_why():
    watch = _watch(power_policy="auto")
    watch.update(LOW)
    h = watch.health()
    assert (h["source"], h["percent"], h["policy"], h["requested"]) == ("battery", 12, "saver", "auto")
    assert h["decode_batch_limit"] == 4 and h["admitted_limit"] == 12 and "12%" in h["reason"]


def test_a_reader_that_fails_or_hangs_keeps_the_policy(monkeypatch):
    monkeypatch.setattr(power_watch, "READ_TIMEOUT_S", 0.2)
    calls = []

    def flaky(settings):
        calls.append(1)
        if len(calls) == 1:
            return LOW
        if len(calls) == 2:
            raise RuntimeError("reader bug")
        import time
        time.sleep(1.0)  # hangs past the deadline
        return AC

    watch = PowerWatch(Settings(power_poll_s=0.05), read=flaky)

    async def run_until_past_a_hang():
        """Until a fourth reading starts: the third hung, and the watch gave up on it and polled on
        (a deadline, not a fixed time: on a loaded box the first readings alone took 0.8 s)."""
        task = asyncio.create_task(watch.run())
        deadline = time.monotonic() + 10
        while len(calls) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run_until_past_a_hang())
    assert len(calls) >= 4 and watch.policy.name == "saver"  # the last good reading stands


def test_a_cancel_that_comes_as_a_reading_ends_stops_the_watch():
    """Python 3.11's wait_for returns a result that came with a cancel and
    drops the cancel: the watch then polled on and the router's stop (and a
    scripted test's) waited on it forever. Cancels at many points of the
    poll; with wait_for, about 5 in 300 were lost."""
    import random

    watch = PowerWatch(Settings(power_poll_s=0.0), read=lambda settings: AC)

    async def cancel_at_many_points() -> int:
        lost = 0
        for _ in range(400):
            task = asyncio.create_task(watch.run())
            for _ in range(random.randrange(40)):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2.0)
            if not done:
                lost += 1
                task.cancel()
                await asyncio.wait({task}, timeout=2.0)
        return lost

    assert asyncio.run(cancel_at_many_points()) == 0


def test_workers_get_the_limits_with_their_heartbeats_until_they_echo_them():
    """Real dispatcher and sockets; the workers are scripted (tests/support/dispatcher.py)
    and apply WorkerLimits as a worker does: their heartbeats echo the version."""
    from tests.support.dispatcher import run

    async def limits_come(w, n, timeout=5.0):
        """Wait (with a deadline, not a fixed time) until `w` has applied `n` WorkerLimits."""
        deadline = time.monotonic() + timeout
        while len(w.limits) < n:
            assert time.monotonic() < deadline, f"{len(w.limits)} WorkerLimits, {n} expected"
            assert await w.silent_for(0.05)

    async def body(disp, worker):
        dec, vis = worker("decode-0", ["decode"]), worker("vision-0", ["vision"])
        await dec.beat()
        await vis.beat()
        await limits_come(dec, 1)
        assert [l.policy for l in dec.limits] == ["performance"]
        assert vis.limits == [] and await vis.silent_for(0.1)  # nothing of it to apply
        await dec.beat()  # echoes the version: nothing more
        assert await dec.silent_for(0.2) and len(dec.limits) == 1
        disp.power.update(LOW)
        await dec.beat()
        await limits_come(dec, 2)
        assert [l.policy for l in dec.limits] == ["performance", "saver"] and dec.limits[-1].max_batch == 4
        dec.hello.pid += 1  # restarted: a new process that never heard of a policy
        dec.hello.limits_version = 0
        await dec.beat()
        await limits_come(dec, 3)
        assert dec.limits[-1].policy == "saver" and await dec.silent_for(0.1) and len(dec.limits) == 3

    run(body, max_batch=32)


def test_a_worker_busy_loading_is_not_flooded_with_the_same_limits():
    """Heartbeats keep coming while a worker loads its model (its inbox waits):
    the same limits go again only after RESEND_S, a new version at once."""
    watch = _watch()
    hello = WorkerHello("decode-0", ["decode"], 7, "loading")
    assert watch.limits_for(hello, now=100.0) is not None
    assert watch.limits_for(hello, now=100.5) is None
    assert watch.limits_for(hello, now=100.0 + power_watch.RESEND_S + 0.1) is not None
    watch.update(LOW)
    assert watch.limits_for(hello, now=102.2).policy == "saver"
