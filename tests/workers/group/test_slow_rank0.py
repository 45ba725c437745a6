"""A group's rank 0 busy with one long step (issue 40: a batch of handoffs
read in, a kernel compiled) is waited for by its followers: rank 0's beat
thread speaks for it while its loop lives (workers/group/lockstep.py), so a
step longer than a follower's patience for silence is no death. Rank 0 and
a follower over real ipc sockets, on fake roles; the step made slow by the
test fault (Settings.slow_step_dir, workers/group/members.py `SlowStep`)."""

from __future__ import annotations

import queue
import threading

import zmq

from environment.settings import Settings
from protos.group_plan import RankSpec
from protos.messages import PrefillRequest, SamplingParams, WorkerHello
from workers.group.lockstep import RecordStream
from workers.group.members import Follower, Leader
from workers.group.ranks import lockstep_address
from workers.power_limits import PowerLimits
from workers.role import Role, Unit
from workers.worker import Worker


class Sent(list):
    def send(self, msg, wait_s=None):
        self.append(msg)

    def close(self):
        pass


class Steps(Role):
    """A fake role: each request it takes is one unit, `ran` in order."""

    def __init__(self):
        super().__init__("g", Sent(), clock=None)
        self.queue: list[str] = []
        self.ran: list[str] = []
        self.unit = Unit("step", self.run_one)

    def handle(self, msg) -> None:
        self.queue.append(msg.request_id)

    def has_work(self) -> bool:
        return bool(self.queue)

    def units(self, busy_elsewhere):
        while self.queue:
            yield self.unit

    def unit_kinds(self) -> list[Unit]:
        return [self.unit]

    def run_one(self, wait: bool) -> None:
        self.ran.append(self.queue.pop(0))


def loop_over(role: Steps, outbox, settings: Settings, runner=None) -> Worker:
    hello = WorkerHello(worker_id="g", roles=["fake"], pid=0, state="ready")
    return Worker([role], {PrefillRequest: role}, worker_id="g", inbox=queue.Queue(), outbox=outbox, hello=hello,
                  power=PowerLimits(settings, may_defer=False), runner=runner)


def test_a_follower_waits_out_a_rank_0_step_longer_than_its_patience(tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    # A follower's patience: max(heartbeat_timeout_s, 6 beats) = 0.3 s; the slow step: 1 s.
    settings = Settings(run_dir=str(tmp_path), heartbeat_interval_s=0.05, heartbeat_timeout_s=0.3,
                        group_unit_timeout_s=0, slow_step_dir=str(slow))
    spec = RankSpec("g", 0, 2, str(tmp_path / "g.hosts.json"))
    ctx = zmq.Context()
    errors: list = []
    try:
        hello = WorkerHello(worker_id="g", roles=["fake"], pid=0, state="loading")
        leader = Leader(settings, ctx, hello, group=None, spec=spec)
        lead_role, follow_role = Steps(), Steps()
        rank0 = loop_over(lead_role, leader.wrap_outbox(Sent()), settings, runner=leader)
        follower = Follower(loop_over(follow_role, Sent(), settings),
                            RecordStream(ctx, lockstep_address(spec, settings.run_dir, 1)), settings)

        def follow():
            try:
                follower.serve()
            except Exception as exc:  # noqa: BLE001 - the test's verdict
                errors.append(exc)

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        (slow / "g").write_text("1.0")  # rank 0's next unit ends 1 s late
        leader.loaded()
        for rid in ("a", "b"):
            rank0.inbox.put(PrefillRequest(rid, [1, 2], SamplingParams(max_tokens=1, temperature=0.0),
                                           decode_worker="g"))
        rank0.drain_inbox(block=False)
        rank0.step()
        leader.close()  # its last record: stop
        thread.join(timeout=30)
        follower.stream.close()
    finally:
        ctx.destroy(linger=0)
    assert errors == [] and not thread.is_alive()
    assert lead_role.ran == follow_role.ran == ["a", "b"] and follower.worker.stopping
    assert not (slow / "g").exists()  # the slow step was taken, once
