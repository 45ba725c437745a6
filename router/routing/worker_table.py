"""The workers the router has heard from: their state, health and load, and
the choice of one for a request.

A worker says hello when it connects and then as its heartbeat; one silent for
`heartbeat_timeout_s`, or replaced by a new process under its id, is dropped
(router/routing/dispatcher.py moves its requests elsewhere).

A hello's `kv_host` says where the worker's KV lives ("": this host's arena; a
remote worker's host otherwise): a prompt's KV goes by reference (through
the arena) only to a decode worker of the same kv_host; to another host's,
it goes by value, in the message (router/routing/handoff_route.py). Its `kv_shard`
says how a worker group splits the model: a group's KV goes only to a
decode group of the same split on its host, never by value.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from environment.settings import Settings
from protos.messages import WorkerHello
from router.routing.engine_api import EngineError
from router.routing.prefix_affinity import PrefixAffinity

log = logging.getLogger("router.routing.dispatcher")

# How many more in-flight requests the affine prefill worker may have than the
# least-loaded one before routing ignores affinity.
AFFINITY_SLACK = 2
READY_POLL_S = 0.05  # how often a request waiting for a worker looks again


@dataclass
class WorkerState:
    hello: WorkerHello
    last_seen: float
    assigned: set = field(default_factory=set)  # wire ids of the requests this worker holds now

    @property
    def ready(self) -> bool:
        return self.hello.state == "ready"

    def load(self) -> int:
        return len(self.assigned)


class WorkerTable:
    """Workers by id, what /health reports, and routing among the ready ones."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.workers: dict[str, WorkerState] = {}
        self.affinity = PrefixAffinity()
        self.expected = self._expected()  # fixed by the settings: read the model's config once
        self.seen_ready: set[str] = set()  # roles some worker was ready for: their absence is a restart
        self._wrong_model: set[tuple[str, int]] = set()  # (id, pid) of workers refused for another model, logged

    def _expected(self) -> dict[str, int]:
        """Live workers per role the settings ask for (what /health waits for)."""
        expected: dict[str, int] = {}
        for _, roles in self.settings.worker_plan():
            for role in roles:
                expected[role] = expected.get(role, 0) + 1
        return expected

    def ready_with(self, role: str) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.ready and role in w.hello.roles]

    def all_ready(self) -> bool:
        return all(len(self.ready_with(r)) >= n for r, n in self.expected.items())

    def health(self, model_id: str, cache_ok: bool, cache_stats: dict, in_flight: int) -> tuple[bool, dict]:
        """(ready?, the /health body): every expected worker and the cache service."""
        ready = cache_ok and self.all_ready()
        now = time.monotonic()
        workers = [
            {
                "id": wid,
                "role": "+".join(w.hello.roles),
                "pid": w.hello.pid,
                "state": w.hello.state,
                "running": w.hello.running,
                "waiting": w.hello.waiting,
                "last_seen_s": round(now - w.last_seen, 3),
                **({"kv_host": w.hello.kv_host} if w.hello.kv_host else {}),
                **({"kv_shard": w.hello.kv_shard} if w.hello.kv_shard else {}),  # a group's split
            }
            for wid, w in sorted(self.workers.items())
        ]
        cache = {"role": "cache", "state": "ready" if cache_ok else "unavailable", **cache_stats}
        return ready, {"status": "ok" if ready else "unavailable", "model": model_id, "workers": workers,
                       "cache_service": cache, "expected": self.expected, "requests_in_flight": in_flight}

    # ------------------------------------------------------------ routing --
    def remote_rows(self) -> int:
        """Decode rows of the ready workers on other hosts: admission room
        they add to this host's (router/guards/admission.py)."""
        return sum(w.hello.max_batch for w in self.workers.values()
                   if w.ready and w.hello.kv_host and "decode" in w.hello.roles)

    def least(self, role: str, kv_host: str | None = None, kv_shard: str | None = None) -> WorkerState | None:
        """The least-loaded ready worker of a role (of that `kv_host` and
        `kv_shard` where given), or None."""
        ready = [w for w in self.ready_with(role) if (kv_host is None or w.hello.kv_host == kv_host)
                 and (kv_shard is None or w.hello.kv_shard == kv_shard)]
        return min(ready, key=_busyness, default=None)

    def decoder_near(self, prefill: WorkerState) -> WorkerState | None:
        """The least-loaded ready decode worker that can read `prefill`'s KV
        where it is: on its host, of its split (a group's: rank by rank)."""
        return self.least("decode", prefill.hello.kv_host, prefill.hello.kv_shard)

    def decoder_far(self) -> WorkerState | None:
        """The least-loaded ready decode worker that can take KV by value: not
        a group (its ranks each read their own shard from this host's arena)."""
        return self.least("decode", kv_shard="")

    def decodes_own(self, w: WorkerState) -> bool:
        """Whether `w` decodes what it prefills, its KV kept in the process:
        a colocated worker, on this host or a remote one."""
        return "decode" in w.hello.roles and (self.settings.colocate or bool(w.hello.kv_host))

    def pick(self, role: str) -> WorkerState:
        """The least-loaded ready worker of a role; 503 when none is."""
        w = self.least(role)
        if w is None:
            raise EngineError(503, f"no {role} worker is alive; retry shortly", retry_after=1.0)
        return w

    def pick_prefill(self, keys: list[bytes]) -> WorkerState:
        """Cache-aware: the worker that last prefilled the longest part of this
        prompt, unless it is busier than the least-loaded one by more than
        AFFINITY_SLACK requests (then reuse is not worth the wait). A worker
        whose KV would have to leave its host (by value: no decoder there)
        gives way to one whose KV stays, unless that one is busier by more
        than AFFINITY_SLACK too; with no decoder anywhere, all are alike."""
        self.pick("prefill")  # 503 when none is ready
        ready_all = self.ready_with("prefill")
        near = [w for w in ready_all if self.decodes_own(w) or self.decoder_near(w)]
        # By value: a group's KV never (workers/group/handoff_shards.py), and only to a decoder alone.
        far = [w for w in ready_all if w not in near and not w.hello.kv_shard] if self.decoder_far() else []
        ready = {w.hello.worker_id: w for w in (near + far) or ready_all}
        least = min(ready.values(), key=_busyness)
        matched = self.affinity.matched_blocks(keys)
        best = max((wid for wid in matched if wid in ready), key=lambda wid: matched[wid], default=None)
        if best is not None and ready[best].load() - least.load() <= AFFINITY_SLACK:
            return ready[best]
        nearest = min(near, key=_busyness, default=None)
        if least in far and nearest is not None and nearest.load() - least.load() <= AFFINITY_SLACK:
            return nearest
        return least

    async def wait_ready(self, roles: tuple[str, ...], deadline: float, gone=lambda: False) -> bool:
        """Wait until a worker of each role is ready (a crashed one restarting),
        until `deadline` (monotonic) or `gone()`; whether they are. A role no
        worker was ever ready for is not waited for (the server is starting,
        or misconfigured): the caller answers 503 at once."""
        while not all(self.ready_with(r) for r in roles):
            if gone() or time.monotonic() >= deadline or not all(r in self.seen_ready for r in roles):
                return False
            await asyncio.sleep(READY_POLL_S)
        return True

    # ------------------------------------------------------------ updates --
    def on_hello(self, wid: str, hello: WorkerHello) -> tuple[WorkerState | None, str]:
        """Record a hello; (the state dropped by it, why) or (None, ""). A hello
        from a new pid under a known id means the old process died. One that
        makes no sense (an unknown role or state, negative load) is refused:
        it would steer routing."""
        if not _sane(hello):
            log.warning("worker %s: refused a hello with roles %r, state %r, load %r/%r", wid, hello.roles,
                        hello.state, hello.running, hello.waiting)
            return None, ""
        if hello.model_id and self.settings.model_id and hello.model_id != self.settings.model_id:
            if (wid, hello.pid) not in self._wrong_model:  # once per process: it says hello twice a second
                self._wrong_model.add((wid, hello.pid))
                log.error("worker %s (pid %d%s) refused: it serves %r, this router %r", wid, hello.pid,
                          f" on {hello.kv_host}" if hello.kv_host else "", hello.model_id, self.settings.model_id)
            return None, ""
        w = self.workers.get(wid)
        if hello.state == "ready":
            self.seen_ready.update(hello.roles)
        if w is not None and w.hello.pid == hello.pid:
            if w.hello.state != hello.state:
                log.info("worker %s (pid %d): %s -> %s", wid, hello.pid, w.hello.state, hello.state)
            w.hello, w.last_seen = hello, time.monotonic()
            return (self.drop(wid), "is stopping") if hello.state == "stopping" else (None, "")
        dropped = self.drop(wid) if w is not None else None
        if hello.state != "stopping":
            log.info("worker %s (%s, pid %d) connected: %s", wid, "+".join(hello.roles), hello.pid, hello.state)
            self.workers[wid] = WorkerState(hello, time.monotonic())
        return dropped, "was replaced by a new process"

    def drop(self, wid: str) -> WorkerState | None:
        w = self.workers.pop(wid, None)
        if w is not None:
            self.affinity.forget(wid)
        return w

    def silent(self) -> list[str]:
        """Workers that missed their heartbeats."""
        now = time.monotonic()
        return [wid for wid, w in self.workers.items() if now - w.last_seen > self.settings.heartbeat_timeout_s]

    def unassign(self, wire_id: str, *wids: str) -> None:
        for wid in wids:
            w = self.workers.get(wid)
            if w is not None:
                w.assigned.discard(wire_id)


ROLES = frozenset({"prefill", "decode", "vision", "embed"})  # embed: an embedding model's (workers/embed/)
STATES = frozenset({"loading", "ready", "stopping"})


def _busyness(w: WorkerState) -> tuple[int, int]:
    """How busy a worker is, for picking the least: what the router gave it,
    then what it says it runs and queues."""
    return w.load(), w.hello.running + w.hello.waiting


def _sane(hello: WorkerHello) -> bool:
    return (bool(hello.roles) and set(hello.roles) <= ROLES and hello.state in STATES and hello.pid > 0
            and min(hello.running, hello.waiting, hello.kv_bytes) >= 0)
