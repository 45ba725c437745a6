"""The two kinds of rank in a tensor-parallel worker group, as Workers.

`LeaderWorker` (rank 0) is an ordinary Worker (workers/worker.py) that
talks to the router, with a Recorder (workers/group/lockstep.py) that
sends each follower what its loop did, before doing it. `FollowerWorker`
(ranks 1..N-1) builds the same roles over its own shard, sends nothing
anywhere (its outbox discards: rank 0 answers the router), and replays
rank 0's records through the same Worker methods, so every rank issues
the same collectives in the same order.

A collective that fails because another rank died must not fail requests
(the router would answer the client with an error): it takes the group
down, and the router moves the requests as for any dead worker. So rank 0
holds the RequestFailed its units produce until the unit ends, and drops
them and stops if a follower's connection went away meanwhile.
"""

from __future__ import annotations

import logging
import time

import zmq

from protos.messages import RequestFailed
from workers.group.lockstep import GroupBroken, Recorder, RecordStream, pin_seed
from protos import transport
from protos.group_plan import RankSpec
from workers.group.ranks import lockstep_address, unit_deadline
from workers.memory_relief import relieve_memory
from workers.socket_loop import Outbox
from workers.worker import Worker

log = logging.getLogger(__name__)

# How long a follower waits for rank 0's first record: rank 0 may still be
# loading (every rank loads the whole model before its shard is cut).
FIRST_RECORD_S = 600.0
# After a unit that failed requests: how long rank 0 waits to hear whether a
# follower died (the likelier cause when a collective fails).
LOST_CHECK_S = 1.0


class HoldingOutbox:
    """Rank 0's outbox: RequestFailed held while `held` is a list (during a unit)."""

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self.held: list | None = None

    def send(self, msg, wait_s: float | None = None) -> None:
        if self.held is not None and isinstance(msg, RequestFailed):
            self.held.append(msg)
            return
        self.outbox.send(msg, wait_s=wait_s)

    def close(self) -> None:
        self.outbox.close()


class DiscardOutbox:
    """A follower's outbox: rank 0 sends the group's answers."""

    def send(self, msg, wait_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class LeaderWorker(Worker):
    """Rank 0: the router's worker, recording its loop for the followers."""

    def __init__(self, settings, roles: list[str], worker_id: str, ctx: zmq.Context, loop, *, group,
                 spec: RankSpec):
        super().__init__(settings, roles, worker_id, ctx, loop, group=group)
        addresses = [lockstep_address(spec, settings.run_dir, r) for r in range(1, spec.size)]
        # Followers on other hosts (tcp): CURVE, with this host's pair and their public keys.
        keys = transport.router_keys(settings.group_keys) if settings.group_keys else None
        self.recorder = Recorder(ctx, addresses, beat_s=settings.heartbeat_interval_s, keys=keys)
        # Its handoffs go only to a decode group of the same split (router/routing/handoff_route.py).
        self.hello.kv_shard = f"{'pipeline' if settings.pipeline_parallel > 1 else 'tensor'} {spec.size}"

    def make_outbox(self):
        return HoldingOutbox(Outbox(self.ctx))

    def load(self) -> None:
        super().load()
        self.recorder.send_op("ready")

    def handle(self, msg) -> None:
        msg = pin_seed(msg)
        self.recorder.message(msg)
        super().handle(msg)

    def run_unit(self, unit: str, wait: bool = False) -> None:
        self.recorder.unit(unit, wait, self.step_costs(unit))
        self.outbox.held = []
        try:
            with unit_deadline(self.settings.group_unit_timeout_s):
                super().run_unit(unit, wait)
        finally:
            held, self.outbox.held = self.outbox.held, None
        if held and self.recorder.follower_lost(LOST_CHECK_S):
            raise GroupBroken(f"a follower of {self.worker_id} died: {len(held)} requests left to the router to move")
        for msg in held:
            self.outbox.send(msg)

    def step_costs(self, unit: str) -> list | None:
        """What rank 0's steps cost, for a decode step that may speculate: how
        many tokens a row drafts follows it (workers/decode/speculation.py
        StepCosts, timed per rank), and every rank must draft alike."""
        spec = self.decode.engine.speculation if unit == "decode" and self.decode is not None else None
        return spec.costs.state() if spec is not None else None

    def drain_inbox(self, block: bool, timeout: float = 0.25) -> None:
        super().drain_inbox(block, timeout)
        self.recorder.beat()

    def close(self) -> None:
        try:
            self.recorder.send_op("stop", wait=False)
        finally:
            self.recorder.close()
            super().close()


class FollowerWorker(Worker):
    """Ranks 1..N-1: the same roles over their shard, replaying rank 0's records."""

    def __init__(self, settings, roles: list[str], worker_id: str, ctx: zmq.Context, loop, *, group,
                 spec: RankSpec):
        super().__init__(settings, roles, worker_id, ctx, loop, group=group)
        address = lockstep_address(spec, settings.run_dir, spec.rank)
        # A rank on another host (tcp) has no cache service there (deploy/remote_rank.py).
        self.other_host = address.startswith("tcp://")
        self.stream = RecordStream(ctx, address, transport.worker_keys(settings.rank_keys) if self.other_host else None)
        # Rank 0 beats every heartbeat interval when idle; a few missed: it is gone.
        self.silence_s = max(settings.heartbeat_timeout_s, 6 * settings.heartbeat_interval_s)

    def make_outbox(self):
        return DiscardOutbox()

    def make_prefix(self, model):
        """Built as on every rank (its probe runs the model, the same
        collectives as rank 0's), then dropped on another host, which has no
        cache service: `group_prefix` then turns the group's cache off."""
        prefix = super().make_prefix(model)
        if prefix is not None and self.other_host:
            log.info("prefix caching off on rank %d: no cache service on its host", self.group.rank())
            return None
        return prefix

    def serve(self) -> None:
        self.start_clock()
        wait_s, t0 = FIRST_RECORD_S, time.monotonic()
        while not self.stopping:
            ops = self.stream.next(wait_s, stopping=lambda: self.stopping)
            if ops is None:
                break
            if wait_s == FIRST_RECORD_S:
                log.info("worker %s following rank 0 (first record after %.1f s)", self.worker_id,
                         time.monotonic() - t0)
                wait_s = self.silence_s
            for op in ops:
                self.replay(op)
            relieve_memory(self.settings, self.prefix, self.hello)
            self.clock.maybe_report()

    def replay(self, op: tuple) -> None:
        kind = op[0]
        if kind == "m":
            self.handle(op[1])
        elif kind == "u":
            if len(op) > 3:  # rank 0's step costs: this rank drafts as rank 0 does
                self.decode.engine.speculation.costs.load(op[3])
            with unit_deadline(self.settings.group_unit_timeout_s):
                self.run_unit(op[1], wait=op[2])
        elif kind == "stop":
            self.stopping = True
        elif kind != "ready":
            raise GroupBroken(f"unknown record op {kind!r}")

    def close(self) -> None:
        self.stream.close()
        super().close()

