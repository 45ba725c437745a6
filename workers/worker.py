"""A worker process's loop over its roles (workers/role.py: prefill,
decode, vision, a deferred warm-up), after vLLM v1's EngineCore: `step`
runs one pass of every role's due units and knows nothing of sockets or
processes; `serve` is the process's busy loop around it, over the inbox the
socket loop thread fills (workers/socket_loop.py). The parts it steps are
built by workers/parts.py; the process main is workers/main.py.

Scheduling inside the process is simple and bounded: between any two units
of MLX work (one prefill chunk, one decode step) the inbox is drained, so a
cancel lands within one step, and with both roles prefill chunks and decode
steps alternate, so a long prompt never freezes the streams for its whole
prefill.

What the loop is handed rather than decides: the power policy's limits
(workers/power_limits.py), and how it takes each message and runs each
unit (`Alone`; a group's rank 0 records both for its followers first,
workers/group/members.py). It holds no group and no power reading.
"""

from __future__ import annotations

import logging
import queue
from typing import Callable, Optional

from protos.messages import Cancel, WorkerLimits
from workers.loop_clock import LoopClock
from workers.power_limits import PowerLimits
from workers.role import Role, Unit, request_failed

log = logging.getLogger(__name__)


class Alone:
    """How a worker alone stands to other processes: it takes each message
    and runs each unit as they come (`idle`: after every drain of the
    inbox), answers through its outbox as it is, has no group, and may
    wait for the power policy to warm up."""

    group = None

    def wrap_outbox(self, outbox):
        return outbox

    def loaded(self) -> None:
        pass

    def close(self) -> None:
        pass

    def take(self, msg):
        return msg

    def run(self, unit: Unit) -> None:
        unit()

    def idle(self) -> None:
        pass


class Worker:
    """The loop over `roles` (in order), `takes` saying which role takes
    each request type, answering through `outbox` (send()), its heartbeat
    `hello` (protos.messages.WorkerHello). `after_pass()`: the parts'
    housekeeping after every pass (workers/parts.py)."""

    def __init__(self, roles: list[Role], takes: dict, *, worker_id: str, inbox: queue.Queue, outbox, hello,
                 power: PowerLimits, runner=None, after_pass: Optional[Callable[[], None]] = None):
        self.roles = roles
        self.takes = takes
        self.worker_id = worker_id
        self.inbox = inbox
        self.outbox = outbox
        self.hello = hello
        self.power = power
        self.runner = runner or Alone()
        self.after_pass = after_pass or (lambda: None)
        self.stopping = False
        self.clock = LoopClock(f"worker {worker_id}")
        for role in roles:
            role.fail = self.fail  # a broken request is dropped from every role

    def start_clock(self) -> None:
        self.clock = LoopClock(f"worker {self.worker_id}")  # from here: loading is not the loop's time
        for role in self.roles:
            role.set_clock(self.clock)

    def serve(self) -> None:
        self.start_clock()
        while not self.stopping:
            self.drain_inbox(block=not self.has_work())
            if self.stopping:
                break
            self.step()
            self.update_load()
            self.after_pass()
            self.clock.maybe_report()

    def step(self) -> None:
        """One pass: each role's units due now, in order; a role whose work
        waits (the decode pace) lets the loop wait for messages meanwhile,
        unless another role has work."""
        for role in self.roles:
            def busy_elsewhere(role=role) -> bool:
                return any(r.has_work() for r in self.roles if r is not role)

            for unit in role.units(busy_elsewhere):
                self.runner.run(unit)
            pause = role.pause_s()
            if pause > 0 and not busy_elsewhere():
                self.drain_inbox(block=True, timeout=pause)

    def unit_kinds(self) -> dict[str, Unit]:
        """Every unit the roles may offer, by name (a group's followers replay rank 0's)."""
        return {unit.name: unit for role in self.roles for unit in role.unit_kinds()}

    def has_work(self) -> bool:
        return any(role.has_work() for role in self.roles)

    def drain_inbox(self, block: bool, timeout: float = 0.25) -> None:
        self._drain(block, timeout)
        self.runner.idle()

    def _drain(self, block: bool, timeout: float) -> None:
        timeout = timeout if block else None
        while True:
            try:
                with self.clock.phase("wait"):
                    msg = self.inbox.get(block=block, timeout=timeout) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if msg is None:  # stop signal from the socket loop or SIGTERM
                self.stopping = True
                return
            # Taking in a handoff (reading its KV from the arena) is timed here.
            with self.clock.phase(f"handle {type(msg).__name__}"):
                self.handle(msg)

    def handle(self, msg) -> None:
        msg = self.runner.take(msg)
        role = self.takes.get(type(msg))
        if role is not None:
            # A request whose message cannot be taken in (a handoff naming an
            # arena that is gone, say) fails alone, never the worker.
            try:
                role.handle(msg)
            except Exception as exc:  # noqa: BLE001
                self.fail(msg.request_id, exc)
        elif isinstance(msg, Cancel):
            self.cancel(msg.request_id)
        elif isinstance(msg, WorkerLimits):
            self.power.apply(msg, self.roles, self.hello, self.worker_id)
        else:
            log.error("worker %s (%s) ignores %s", self.worker_id, "+".join(self.hello.roles), type(msg).__name__)

    def fail(self, request_id: str, exc: Exception) -> None:
        """Drop a request that `exc` broke, and tell the router why."""
        log.error("request %s failed in worker %s", request_id, self.worker_id, exc_info=exc)
        self.cancel(request_id, save=False)
        self.outbox.send(request_failed(request_id, exc))

    def cancel(self, request_id: str, save: bool = True) -> None:
        """Drop a request wherever it is, in every role. A decoding request's
        KV goes to the prefix cache (unless `save` is False: its batch is suspect)."""
        for role in self.roles:
            role.cancel(request_id, save=save)

    def update_load(self) -> None:
        self.hello.running = sum(role.running for role in self.roles)
        self.hello.waiting = sum(role.waiting for role in self.roles)
        for role in self.roles:
            role.report(self.hello)
