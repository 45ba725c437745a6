"""The Worker loop (workers/worker.py) over fake roles, in this process: a
role offers units and the loop runs them, fails a broken request alone,
waits out a role's pace on the inbox, hands the power policy's limits to
the roles; and a group's wrappers (workers/group/members.py) record rank
0's messages and units and replay them on a follower's loop, which knows
nothing of groups."""

from __future__ import annotations

import queue

import pytest
import zmq

from environment.settings import Settings
from protos.group_plan import RankSpec
from protos.messages import Cancel, PrefillRequest, RequestFailed, SamplingParams, WorkerHello, WorkerLimits
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


class Costs:
    """What rank 0's steps decided by time (a decode step's StepCosts, as it were)."""

    def __init__(self, k: int):
        self.k = k

    def state(self) -> list:
        return [self.k]

    def load(self, state: list) -> None:
        self.k = state[0]


class Queued(Role):
    """A fake role: each request it takes is one unit of work, `kind`;
    "bad" fails its step. `ran`: (request id, wait, costs) per unit run."""

    def __init__(self, kind: str, outbox, costs: Costs | None = None):
        super().__init__("w", outbox, clock=None)
        self.queue: list[str] = []
        self.ran: list = []
        self.costs = costs
        self.batch = 8
        self.unit = Unit(kind, self.run_one, shared=(lambda: self.costs) if costs else None)

    def handle(self, msg) -> None:
        self.queue.append(msg.request_id)

    def has_work(self) -> bool:
        return bool(self.queue)

    def units(self, busy_elsewhere):
        while self.queue:  # all it has, each run before the next is offered
            yield self.unit.waiting(not busy_elsewhere())

    def unit_kinds(self) -> list[Unit]:
        return [self.unit]

    def run_one(self, wait: bool) -> None:
        rid = self.queue.pop(0)
        self.ran.append((rid, wait, self.costs.k if self.costs else None))
        self.guarded(rid, self.step, rid)

    def step(self, rid: str) -> None:
        if rid == "bad":
            raise RuntimeError("broken step")

    def cancel(self, request_id: str, save: bool = True) -> None:
        self.queue = [r for r in self.queue if r != request_id]

    def limit(self, limits) -> str:
        self.batch = min(limits.max_batch, 8)
        return f"batch {self.batch}"

    def report(self, hello) -> None:
        hello.max_batch = self.batch

    @property
    def waiting(self) -> int:
        return len(self.queue)


def request(rid: str) -> PrefillRequest:
    return PrefillRequest(rid, [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0), decode_worker="g")


def loop_over(roles, takes, outbox, runner=None, settings=None):
    hello = WorkerHello(worker_id="w", roles=["fake"], pid=0, state="ready")
    return Worker(roles, takes, worker_id="w", inbox=queue.Queue(), outbox=outbox, hello=hello,
                  power=PowerLimits(settings or Settings(), may_defer=False), runner=runner)


def test_the_loop_steps_a_fake_role_without_a_process():
    sent = Sent()
    role = Queued("chunk", sent)
    worker = loop_over([role], {PrefillRequest: role}, sent)
    for msg in (request("a"), request("bad"), request("b"), Cancel("b"),
                WorkerLimits(3, "saver", max_batch=2, prefill_batch=1), None):
        worker.inbox.put(msg)
    worker.start_clock()
    worker.drain_inbox(block=False)  # as serve() does, one pass: the inbox, the units, the load
    worker.step()
    worker.update_load()
    assert [rid for rid, _, _ in role.ran] == ["a", "bad"]  # "b" cancelled before its unit
    assert [(m.request_id, m.status) for m in sent] == [("bad", 500)]  # the broken one fails alone
    assert role.batch == 2 and worker.hello.limits_version == 3 and worker.hello.max_batch == 2
    assert worker.hello.waiting == 0 and worker.stopping


def test_a_role_whose_work_is_paced_lets_the_loop_wait_on_the_inbox():
    class Paced(Queued):
        def units(self, busy_elsewhere):
            return iter(())  # its work waits for the pace

        def pause_s(self) -> float:
            return 0.05

    sent = Sent()
    paced = Paced("decode", sent)
    paced.queue = ["x"]
    worker = loop_over([paced], {}, sent)
    worker.inbox.put(Cancel("nobody"))
    worker.step()  # waits (at most the pace) and takes the message meanwhile
    assert worker.inbox.empty() and paced.ran == []


def test_rank_0s_units_are_replayed_on_a_follower_loop_that_knows_no_group(tmp_path):
    """Rank 0's loop runs through a Leader, which records each message and
    unit (with what rank 0 decided by time) before it runs; a Follower
    hands the same messages to its own loop and runs the units of the names
    rank 0 ran: both roles do the same work, in the same order."""
    settings = Settings(run_dir=str(tmp_path))
    spec = RankSpec("g", 0, 2, str(tmp_path / "g.hosts.json"))
    ctx = zmq.Context()
    try:
        lead_out = Sent()
        leader_role = Queued("step", lead_out, Costs(5))
        hello = WorkerHello(worker_id="g", roles=["fake"], pid=0, state="loading")
        leader = Leader(settings, ctx, hello, group=None, spec=spec)
        outbox = leader.wrap_outbox(lead_out)
        stream = RecordStream(ctx, lockstep_address(spec, settings.run_dir, 1))
        rank0 = loop_over([leader_role], {PrefillRequest: leader_role}, outbox, runner=leader, settings=settings)
        leader.loaded()
        for msg in (request("a"), request("bad"), request("b")):
            rank0.inbox.put(msg)
        rank0.drain_inbox(block=False)
        rank0.step()
        leader.close()  # its last record: stop

        follow_role = Queued("step", Sent(), Costs(1))  # its own timing would draft otherwise
        follower = Follower(loop_over([follow_role], {PrefillRequest: follow_role}, Sent()), stream, settings)
        follower.serve()
        stream.close()
    finally:
        ctx.destroy(linger=0)
    assert leader_role.ran == follow_role.ran == [("a", True, 5), ("bad", True, 5), ("b", True, 5)]
    assert [m.request_id for m in lead_out if isinstance(m, RequestFailed)] == ["bad"]  # sent once the unit ended
    assert hello.kv_shard == "tensor 2" and follower.worker.stopping


def test_a_unit_rank_0_ran_that_a_follower_lacks_breaks_the_group():
    from workers.group.lockstep import GroupBroken

    follower = Follower(loop_over([], {}, Sent()), stream=None, settings=Settings())
    with pytest.raises(GroupBroken, match="a unit this rank has not"):
        follower.replay(("u", "decode", False))
