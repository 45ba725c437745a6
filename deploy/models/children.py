"""A child process of `tandem serve` as the supervisor runs it (deploy/supervisor.py):
its record (`Child`), its entry (`child_main`), and the two ways children are
stopped: `stop_all` waits (shutdown, a group's restart), `Retiring` does not
(a model unloaded or failed while the rest keep serving: deploy/models/slots.py)."""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)

KILL_WAIT_S = 2.0  # after SIGKILL, how long a child is waited for


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(1)


def child_main(target: str, args: tuple, env: dict | None = None) -> None:
    """Entry of every child: its environment (`env`, before anything imports
    MLX), own process group, parent watchdog, then the role's main."""
    os.environ.update(env or {})
    os.setpgrp()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    module, func = target.rsplit(":", 1)
    getattr(importlib.import_module(module), func)(*args)


def stop_all(procs: list, grace_s: float, warn: bool = False) -> None:
    """SIGTERM to every live one of `procs`, then SIGKILL to those still
    alive `grace_s` later; every wait bounded."""
    procs = [p for p in procs if p is not None and p.is_alive()]
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            if warn:
                log.warning("%s (pid %d) did not stop in %.0fs; killing", p.name, p.pid, grace_s)
            p.kill()
            p.join(timeout=KILL_WAIT_S)


@dataclass(eq=False)  # one record per child: compared by identity
class Child:
    name: str  # "cache", "router", "prefill-0", "decode-1", "worker-0" (colocated), "m1.decode-0" (a model's)
    target: str  # "module:function"
    args_fn: object  # () -> args tuple; called at every (re)start so settings are current
    process: mp.Process | None = None
    restarts: list = field(default_factory=list)
    group: str | None = None  # a tensor-parallel group's name (its rank 0's): its ranks live and die together
    env: dict = field(default_factory=dict)  # set in the child before its main is imported
    slot: str | None = None  # a model worker's model slot ("": the --model one); None: the cache or router
    restart_at: float | None = None  # died: started again at this monotonic time


@dataclass
class _Batch:
    procs: list
    kill_at: float
    then: Callable[[], None] | None
    killed: bool = False


class Retiring:
    """Children being stopped without holding up the supervisor's loop:
    SIGTERM now, SIGKILL once the grace is up, `then` once all of one batch
    are gone (or, killed, still not gone KILL_WAIT_S later). The loop waits
    on `sentinels()` at most `next_s()` and calls `tick()`."""

    def __init__(self) -> None:
        self._batches: list[_Batch] = []

    def add(self, procs: list, grace_s: float, then: Callable[[], None] | None = None) -> None:
        procs = [p for p in procs if p is not None and p.is_alive()]
        for p in procs:
            p.terminate()
        self._batches.append(_Batch(procs, time.monotonic() + grace_s, then))
        self.tick()

    def tick(self) -> None:
        now = time.monotonic()
        for batch in list(self._batches):
            alive = [p for p in batch.procs if p.is_alive()]
            if alive and now >= batch.kill_at:
                if batch.killed:
                    log.error("%s did not exit after SIGKILL", ", ".join(f"{p.name} (pid {p.pid})" for p in alive))
                    alive = []
                else:
                    for p in alive:
                        log.warning("%s (pid %d) did not stop in its grace; killing", p.name, p.pid)
                        p.kill()
                    batch.killed, batch.kill_at = True, now + KILL_WAIT_S
            if alive:
                continue
            self._batches.remove(batch)
            for p in batch.procs:
                p.join(timeout=0)
            if batch.then is not None:
                try:
                    batch.then()
                except Exception:  # noqa: BLE001 - a callback's bug must not stop the supervisor
                    log.exception("after stopping %s", ", ".join(p.name for p in batch.procs))

    def sentinels(self) -> list:
        return [p.sentinel for b in self._batches for p in b.procs if p.is_alive()]

    def next_s(self) -> float | None:
        """Seconds until the next SIGKILL is due (None: nothing retiring)."""
        if not self._batches:
            return None
        return max(0.0, min(b.kill_at for b in self._batches) - time.monotonic())

    def processes(self) -> list:
        return [p for b in self._batches for p in b.procs]
