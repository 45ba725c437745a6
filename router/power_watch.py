"""The power policy in force, followed live (environment/power/).

Every --power-poll seconds the machine's power state is read (in a thread:
pmset is a subprocess) and the policy it calls for decided. A change is
logged with its reason, told to the listeners (admission: its cap, and
429 while the machine is critically hot) and, through the dispatcher, to
every model worker: each heartbeat that does not echo the current limits'
version gets a WorkerLimits, so a worker that restarted or missed one
catches up within a heartbeat. Nothing in flight is dropped: a smaller
batch lets its extra rows finish, and admission only refuses new requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from environment.power.policy import PowerPolicy, decide
from environment.power.readers import read_power
from environment.power.state import PowerState
from environment.settings import Settings
from protos.messages import WorkerHello, WorkerLimits

log = logging.getLogger("tandem.power")

READ_TIMEOUT_S = 5.0  # a reader bounds its own calls; this bounds the thread's wait
RESEND_S = 2.0  # a worker that has not echoed its limits gets them again after this
SENT_KEPT = 256


class PowerWatch:
    def __init__(self, settings: Settings, read: Callable[[Settings], PowerState] = read_power):
        self.settings = settings
        self.read = read
        self.state = PowerState(reader="none", error="not read yet")
        self.policy: PowerPolicy = decide(self.state, settings)
        self.version = 1
        self.changes = 0  # since start
        self.since = time.time()  # when the policy in force began
        self.listeners: list[Callable[[PowerPolicy], None]] = []
        self._sent: dict[tuple, tuple[int, float]] = {}  # (worker id, pid) -> (version, when) last sent

    def update(self, state: PowerState) -> bool:
        """Take a reading; True when the policy changed."""
        self.state = state
        policy = decide(state, self.settings)
        changed = policy.limits() != self.policy.limits() or policy.refuse_new != self.policy.refuse_new \
            or policy.max_admitted != self.policy.max_admitted
        if changed:
            log.warning("power policy %s -> %s: %s", self.policy.name, policy.name, policy.reason)
        self.policy = policy  # a new reason alone (the battery's percent) is shown, not logged
        if not changed:
            return False
        self.version += 1
        self.changes += 1
        self.since = time.time()
        for listener in self.listeners:
            listener(policy)
        return True

    async def run(self) -> None:
        """Poll until cancelled; a reading that fails or hangs keeps the last state."""
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for loses a
                # cancel that comes as the read ends, and this loop never ends.
                async with asyncio.timeout(READ_TIMEOUT_S):
                    state = await asyncio.to_thread(self.read, self.settings)
                self.update(state)
            except (TimeoutError, asyncio.TimeoutError):
                log.warning("power state: no reading within %.0f s; keeping %s", READ_TIMEOUT_S, self.policy.name)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a reader bug must not stop the router's policy loop
                log.exception("power state: reading failed; keeping %s", self.policy.name)
            await asyncio.sleep(self.settings.power_poll_s)

    def limits_for(self, hello: WorkerHello, now: float | None = None) -> WorkerLimits | None:
        """The WorkerLimits a model worker whose heartbeat is `hello` still needs, or None.
        Not again within RESEND_S for the same version: a worker loading its
        model or warming up takes its inbox in only afterwards."""
        if hello.limits_version == self.version or not ({"prefill", "decode"} & set(hello.roles)):
            return None
        now = time.monotonic() if now is None else now
        key = (hello.worker_id, hello.pid)
        if self._sent.get(key, (0, 0.0)) > (self.version, now - RESEND_S):
            return None
        if len(self._sent) > SENT_KEPT:  # workers that are gone; a few entries each restart
            self._sent.clear()
        self._sent[key] = (self.version, now)
        p = self.policy
        return WorkerLimits(self.version, p.name, p.max_batch, p.prefill_batch, p.pace_tokens_per_s, p.defer_warm_up,
                            p.prefill_on_ane)

    def health(self) -> dict:
        """/health's `power` object."""
        s, p = self.state, self.policy
        return {"source": s.source, "percent": s.percent, "low_power_mode": s.low_power, "thermal": s.thermal,
                "reader": s.reader, "error": s.error or None, "policy": p.name, "requested": self.settings.power_policy,
                "reason": p.reason, "since": round(self.since, 3), "decode_batch_limit": p.max_batch,
                "prefill_batch_limit": p.prefill_batch, "pace_tokens_per_s": p.pace_tokens_per_s or None,
                "admitted_limit": p.max_admitted, "refusing_new_requests": p.refuse_new}
