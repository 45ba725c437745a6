"""The two kinds of rank in a tensor-parallel worker group, as wrappers
around the one Worker loop (workers/worker.py), which knows nothing of groups.

`Leader` (rank 0) is how a worker's loop takes messages and runs units
when it leads a group: the loop talks to the router as a worker alone
does, and a Recorder (workers/group/lockstep.py) sends each follower every
message and unit first. `Follower` (ranks 1..N-1) drives a loop built over
the same roles on its own shard, which sends nothing anywhere (its outbox
discards: rank 0 answers the router): it hands the loop rank 0's messages
and runs the units of rank 0's names, so every rank issues the same
collectives in the same order.

A collective that fails because another rank died must not fail requests
(the router would answer the client with an error): it takes the group
down, and the router moves the requests as for any dead worker. So rank 0
holds the RequestFailed its units produce until the unit ends, and drops
them and stops if a follower's connection went away meanwhile.
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from protos import transport
from protos.group_plan import RankSpec
from protos.messages import RequestFailed
from workers.group.lockstep import GroupBroken, Recorder, RecordStream, pin_seed
from workers.group.ranks import lockstep_address, unit_deadline
from workers.role import Unit
from workers.socket_loop import Outbox
from workers.worker import Alone, Worker

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


class SlowStep:
    """Tests only (fault injection, Settings.slow_step_dir): a file named
    after this group in that folder, holding seconds, makes rank 0 sleep so
    long after its next unit, once: rank 0 alive but busy between records
    (as when it reads a burst of handoffs in), which its followers must
    wait for (its beats go on meanwhile)."""

    def __init__(self, folder: str | None, group: str):
        self.path = os.path.join(folder, group) if folder else None

    def __call__(self) -> None:
        if self.path is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path) as f:
                seconds = float(f.read())
            os.remove(self.path)
        except (OSError, ValueError):
            return
        log.warning("test fault: this unit of %s takes %.1f s longer", os.path.basename(self.path), seconds)
        time.sleep(seconds)


class DiscardOutbox:
    """A follower's outbox: rank 0 sends the group's answers."""

    def send(self, msg, wait_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class Leader(Alone):
    """Rank 0: each message the loop takes and each unit it runs recorded
    for the followers first, and its outbox holding RequestFailed while a
    unit runs."""

    def __init__(self, settings, ctx: zmq.Context, hello, *, group, spec: RankSpec):
        self.settings = settings
        self.group = group
        addresses = [lockstep_address(spec, settings.run_dir, r) for r in range(1, spec.size)]
        # Followers on other hosts (tcp): CURVE, with this host's pair and their public keys.
        keys = transport.router_keys(settings.group_keys) if settings.group_keys else None
        self.recorder = Recorder(ctx, addresses, beat_s=settings.heartbeat_interval_s, keys=keys)
        self.outbox: HoldingOutbox | None = None
        self.worker_id = spec.name
        self.slow_step = SlowStep(settings.slow_step_dir, spec.name)
        # Its handoffs go only to a decode group of the same split (router/routing/handoff_route.py).
        hello.kv_shard = f"{'pipeline' if settings.pipeline_parallel > 1 else 'tensor'} {spec.size}"

    def wrap_outbox(self, outbox) -> "HoldingOutbox":
        self.outbox = HoldingOutbox(outbox)
        return self.outbox

    def loaded(self) -> None:
        self.recorder.send_op("ready")
        # From here the followers count rank 0's silence: it beats while its loop lives.
        self.recorder.start_beats(self.settings.group_unit_timeout_s)

    def take(self, msg):
        msg = pin_seed(msg)
        self.recorder.message(msg)
        return msg

    def run(self, unit: Unit) -> None:
        """Recorded (with rank 0's speculative step costs, for a decode
        step: every rank must draft alike), then run within the unit
        deadline; the requests it failed are sent only if no follower died."""
        shared = unit.shared() if unit.shared is not None else None
        self.recorder.unit(unit.name, unit.wait, shared.state() if shared is not None else None)
        self.outbox.held = []
        try:
            with unit_deadline(self.settings.group_unit_timeout_s):
                unit()
        finally:
            held, self.outbox.held = self.outbox.held, None
            self.recorder.alive()
        self.slow_step()  # tests only: rank 0 busy past its unit, as when it reads a burst of handoffs in
        if held and self.recorder.follower_lost(LOST_CHECK_S):
            raise GroupBroken(f"a follower of {self.worker_id} died: {len(held)} requests left to the router to move")
        for msg in held:
            self.outbox.send(msg)

    def idle(self) -> None:
        self.recorder.beat()

    def close(self) -> None:
        try:
            self.recorder.send_op("stop", wait=False)
        finally:
            self.recorder.close()


class Follower:
    """Ranks 1..N-1: rank 0's records replayed on `worker`, a loop over the
    same roles on this rank's shard (built with a DiscardOutbox).
    `relieve()`: the parts' memory relief, after every record."""

    def __init__(self, worker: Worker, stream: RecordStream, settings, relieve=lambda: None):
        self.worker = worker
        self.stream = stream
        self.settings = settings
        self.relieve = relieve
        self.units = worker.unit_kinds()
        # Rank 0 beats every heartbeat interval, busy or idle, while its loop lives
        # (lockstep.py, `start_beats`): a few missed, it is gone or stuck.
        self.silence_s = max(settings.heartbeat_timeout_s, 6 * settings.heartbeat_interval_s)

    def serve(self) -> None:
        worker = self.worker
        worker.start_clock()
        wait_s, t0 = FIRST_RECORD_S, time.monotonic()
        while not worker.stopping:
            ops = self.stream.next(wait_s, stopping=lambda: worker.stopping)
            if ops is None:
                break
            if wait_s == FIRST_RECORD_S:
                log.info("worker %s following rank 0 (first record after %.1f s)", worker.worker_id,
                         time.monotonic() - t0)
                wait_s = self.silence_s
            for op in ops:
                self.replay(op)
            self.relieve()
            worker.clock.maybe_report()

    def replay(self, op: tuple) -> None:
        kind = op[0]
        if kind == "m":
            self.worker.handle(op[1])
        elif kind == "u":
            unit = self.units.get(op[1])
            if unit is None:
                raise GroupBroken(f"rank 0 ran a unit this rank has not: {op[1]!r}")
            if len(op) > 3:  # rank 0's step costs: this rank drafts as rank 0 does
                unit.shared().load(op[3])
            with unit_deadline(self.settings.group_unit_timeout_s):
                unit.waiting(op[2])()
        elif kind == "stop":
            self.worker.stopping = True
        elif kind != "ready":
            raise GroupBroken(f"unknown record op {kind!r}")
