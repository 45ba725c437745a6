"""The power policy as a worker's loop is handed it: the loop neither reads
the power state nor decides anything by it.

The router decides the policy from the machine's readings
(router/power_watch.py, environment/power/policy.py) and sends its limits
as WorkerLimits; `apply` hands them to every role, each of which knows its
own knobs (the decode batch and pace, the prefill batch, the deferred
warm-up), and echoes their version in the heartbeat. Before any arrive,
the process main asks once, at load, whether the warm-up waits
(`defers_warm_up`).
"""

from __future__ import annotations

import logging

from environment.power.policy import decide
from environment.power.readers import read_power
from protos.messages import WorkerLimits

log = logging.getLogger(__name__)


class PowerLimits:
    """`may_defer`: whether the warm-up may wait for a policy that allows it
    (a group's ranks warm up at once, every rank in step: workers/group/)."""

    def __init__(self, settings, may_defer: bool = True, read=read_power):
        self.settings = settings
        self.may_defer = may_defer
        self.read = read

    def defers_warm_up(self) -> bool:
        """Whether the policy in force now defers the warm-up (on battery in saver)."""
        return self.may_defer and decide(self.read(self.settings), self.settings).defer_warm_up

    def apply(self, limits: WorkerLimits, roles, hello, worker_id: str) -> None:
        """`limits` to every role; logged when their version is new."""
        said = [s for s in (role.limit(limits) for role in roles) if s]
        for role in roles:
            role.report(hello)
        if limits.version != hello.limits_version:
            log.info("worker %s: power policy %s (%s)", worker_id, limits.policy, ", ".join(said) or "nothing to limit")
        hello.limits_version = limits.version
