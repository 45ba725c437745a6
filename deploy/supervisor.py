"""`tandem serve`'s parent process: starts every child with `spawn`, restarts
the ones that die, and on SIGTERM / Ctrl-C drains and stops them all.

Children run in their own process group, so Ctrl-C in a terminal reaches only
the supervisor, which then stops them in order: the router first (it drains
in-flight streams while the workers still run), then workers and the cache
service. Each child also watches its parent and stops itself if the
supervisor vanishes (kill -9), so no orphan outlives it.

The HTTP port is the supervisor's: it binds it once (or takes it from
launchd or systemd socket activation) and hands the socket to every router it
starts, so while a crashed router restarts, new connections wait in the
kernel's backlog instead of being refused (deploy/service/listen_socket.py).

Exit codes, for launchd's KeepAlive and systemd's Restart=on-failure: 0 only
after a requested stop (SIGTERM, Ctrl-C, SIGHUP); 1 whenever it gives up (the
port in use, a child dying too often).

The run dir (the sockets) and the shared-memory arena are removed on every
normal or signalled exit; what a server killed whole left behind is swept at
the next start (deploy/run_dir.py).
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from cache_service.arena import unlink_arena
from deploy.blas import calm_blas_threads
from deploy.run_dir import RunDir, sweep_leftovers
from deploy.service.listen_socket import Listeners, ListenError, open_listeners
from deploy.group_plan import is_remote, local_index, rank_environment, write_group_plan, write_hostfile
from environment.settings import Settings
from protos.group_plan import RankSpec

log = logging.getLogger(__name__)

# A child that dies this often within the window is broken, not unlucky.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# Stopping: the router gets the drain plus STOP_GRACE_S, the rest STOP_GRACE_S;
# a child still alive then is killed and waited for KILL_WAIT_S more.
STOP_GRACE_S = 5.0
KILL_WAIT_S = 2.0
GROUP_STOP_GRACE_S = 1.0  # the rest of a group that lost a rank, before SIGKILL
EXIT_STOPPED = 0  # a requested stop
EXIT_GAVE_UP = 1  # launchd and systemd restart the service on it


def longest_stop_s(drain_timeout_s: float) -> float:
    """The longest `shutdown` can take: what a service manager must wait
    (launchd's ExitTimeOut, systemd's TimeoutStopSec) before killing it."""
    return (drain_timeout_s + STOP_GRACE_S + KILL_WAIT_S) + (STOP_GRACE_S + KILL_WAIT_S)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(1)


def _child_main(target: str, args: tuple, env: dict | None = None) -> None:
    """Entry of every child: its environment (`env`, before anything imports
    MLX), own process group, parent watchdog, then the role's main."""
    os.environ.update(env or {})
    os.setpgrp()
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    module, func = target.rsplit(":", 1)
    getattr(importlib.import_module(module), func)(*args)


def _stop_all(procs: list, grace_s: float, warn: bool = False) -> None:
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


@dataclass
class Child:
    name: str  # "cache", "router", "prefill-0", "decode-1", "worker-0" (colocated)
    target: str  # "module:function"
    args_fn: object  # () -> args tuple; called at every (re)start so settings are current
    process: mp.Process | None = None
    restarts: list = field(default_factory=list)
    group: str | None = None  # a tensor-parallel group's name (its rank 0's): its ranks live and die together
    env: dict = field(default_factory=dict)  # set in the child before its main is imported


class Supervisor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.ctx = mp.get_context("spawn")
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.failed: str | None = None
        self.run_dir: RunDir | None = None  # the one this supervisor made (settings.run_dir unset)
        self.listeners: Listeners | None = None  # the HTTP port, handed to every router
        self._new_arena_name()

    def _new_arena_name(self) -> None:
        # A fresh name per cache-service start: stale handles can never read new data.
        self.settings = replace(self.settings, arena_name=f"tandem-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def _plan(self) -> None:
        self.children.append(Child("cache", "cache_service.main:run", lambda: (self.settings,)))
        for name, roles in self.settings.worker_plan():
            self._worker(name, roles)
        self.children.append(Child("router", "router.main:run", lambda: (self.settings, self.listeners.sockets)))

    def _worker(self, name: str, roles: list[str]) -> None:
        size = self.settings.group_size
        if size <= 1:
            self.children.append(Child(name, "workers.main:run", lambda: (self.settings, roles, name)))
            return
        # A group (tensor or pipeline parallel): rank 0 takes the name the router knows,
        # the followers "<name>.r<rank>" (workers/group/). With --hosts, a rank on another
        # host is an ssh client here (deploy/remote_rank.py): its exit is that rank's death.
        hosts = self.settings.group_hosts
        for rank in range(size):
            spec = RankSpec(name, rank, size, os.path.join(self.settings.run_dir, f"{name}.hosts.json"))
            target = "deploy.remote_rank:run" if is_remote(hosts, rank) else "workers.group.main:run"
            env = {} if is_remote(hosts, rank) else {**rank_environment(local_index(hosts, rank), os.environ),
                                                     **dict(e.split("=", 1) for e in self.settings.group_envs)}
            self.children.append(Child(spec.name, target, lambda spec=spec: (self.settings, roles, spec),
                                       group=name, env=env))

    def _spawn(self, child: Child) -> None:
        if child.name == "cache":
            self._cleanup_arena()
            self._new_arena_name()
            if self.run_dir is not None:
                self.run_dir.record_arena(self.settings.arena_name)
        if child.group is not None and child.name == child.group:  # a group's start: fresh ports for its ranks
            hostfile = os.path.join(self.settings.run_dir, f"{child.group}.hosts.json")
            if self.settings.group_hosts:
                write_group_plan(hostfile, self.settings.group_hosts, self.settings.group_backend)
            else:
                write_hostfile(hostfile, self.settings.group_size)
        child.process = self.ctx.Process(target=_child_main, args=(child.target, child.args_fn(), child.env),
                                         name=f"tandem-{child.name}", daemon=False)
        child.process.start()
        log.info("started %s (pid %d)", child.name, child.process.pid)

    def _cleanup_arena(self) -> None:
        if self.settings.arena_name:
            unlink_arena(self.settings.arena_name)

    # -------------------------------------------------------------- run --
    def run(self) -> int:
        """Start everything, keep it alive until asked to stop. Returns an exit code."""
        if not self._listen():
            return EXIT_GAVE_UP
        left = sweep_leftovers()
        if left:
            log.info("removed %d run dirs and arenas left behind by servers that are gone: %s%s", len(left),
                     ", ".join(left[:8]), ", ..." if len(left) > 8 else "")
        self._make_run_dir()
        self._stop_on_hangup()
        try:
            self._plan()
            if calm_blas_threads():
                log.info("OpenBLAS: idle threads sleep at once (OPENBLAS_THREAD_TIMEOUT=4)")
            for child in self.children:
                self._spawn(child)
            self._announce()
            while not self.stopping.is_set():
                sentinels = {c.process.sentinel: c for c in self.children if c.process is not None}
                ready = mp.connection.wait(list(sentinels), timeout=0.5)
                for sentinel in ready:
                    if self.stopping.is_set():
                        break
                    self._on_exit(sentinels[sentinel])
        finally:
            self.shutdown()
        return EXIT_GAVE_UP if self.failed else EXIT_STOPPED

    def _announce(self) -> None:
        log.info("tandem serving %s on http://%s (%s; run dir %s)", self.settings.model_id,
                 self.listeners.addresses(), self.listeners.origin, self.settings.run_dir)

    def _listen(self) -> bool:
        """The HTTP port, before any child starts: one in use fails the start at
        once (a router bound to it would only die and restart until the
        restarts ran out)."""
        try:
            self.listeners = open_listeners(self.settings.host, self.settings.port)
        except ListenError as exc:
            self.failed = str(exc)
            log.error("%s", exc)
            return False
        if self.listeners.origin == "bound" and self.settings.port == 0:  # the port the kernel chose
            self.settings = replace(self.settings, port=self.listeners.port())
        return True

    def _make_run_dir(self) -> None:
        if self.settings.run_dir:  # given: used as it is
            os.makedirs(self.settings.run_dir, mode=0o700, exist_ok=True)
            return
        self.run_dir = RunDir.create()
        self.settings = replace(self.settings, run_dir=self.run_dir.path)

    def _stop_on_hangup(self) -> None:
        """A closed terminal (SIGHUP) stops the server as Ctrl-C does, clean-up
        included, instead of killing the supervisor outright. Left alone
        when ignored (nohup) or handled already."""
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:
            signal.signal(signal.SIGHUP, self.request_stop)

    def _on_exit(self, child: Child) -> None:
        if child.process.is_alive():  # its group's restart already replaced it
            return
        if child.group is not None:
            self._restart_group(child)
            return
        child.process.join(timeout=1)
        code = child.process.exitcode  # after join: negative is the signal that killed it
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(child.restarts) > MAX_RESTARTS:
            self.failed = f"{child.name} died {len(child.restarts)} times in {RESTART_WINDOW_S:.0f}s (last exit code {code})"
            log.error("%s; stopping", self.failed)
            self.stopping.set()
            return
        log.warning("%s (pid %d) exited with code %s; restarting", child.name, child.process.pid, code)
        time.sleep(min(0.2 * 2 ** (len(child.restarts) - 1), 5.0))
        self._spawn(child)

    def _restart_group(self, dead: Child) -> None:
        """One rank of a group died: the others would hang in their next
        collective, so all go and the group starts again as one. SIGTERM
        first (rank 0 then tells the router at once, which moves its
        requests as for a single worker), SIGKILL after GROUP_STOP_GRACE_S
        (a rank inside a collective cannot run a signal handler). The
        group's restarts count on rank 0's record."""
        members = [c for c in self.children if c.group == dead.group]
        dead.process.join(timeout=1)
        code = dead.process.exitcode
        _stop_all([c.process for c in members], GROUP_STOP_GRACE_S)
        leader = members[0]
        now = time.monotonic()
        leader.restarts = [t for t in leader.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(leader.restarts) > MAX_RESTARTS:
            self.failed = (f"group {dead.group} lost a rank {len(leader.restarts)} times in {RESTART_WINDOW_S:.0f}s "
                           f"(last: {dead.name}, exit code {code})")
            log.error("%s; stopping", self.failed)
            self.stopping.set()
            return
        # How each rank ended: a rank 0 ended here, not by its unit deadline (-14), went within the grace.
        log.warning("%s (pid %d) exited with code %s; restarting group %s (%s)", dead.name, dead.process.pid, code,
                    dead.group, ", ".join(f"{c.name}: {c.process.exitcode}" for c in members))
        time.sleep(min(0.2 * 2 ** (len(leader.restarts) - 1), 5.0))
        for c in members:
            self._spawn(c)

    def request_stop(self, *_args) -> None:
        self.stopping.set()

    def shutdown(self) -> None:
        """Router first (drains streams), then the rest. Every wait is bounded."""
        self.stopping.set()
        if self.listeners is not None:
            # Ours closed first: once the router closes its copy, connections
            # still queued are refused, not left waiting for a router that
            # never comes (a socket-activated port stays with launchd/systemd).
            self.listeners.close()
        drain = self.settings.drain_timeout_s
        router = [c for c in self.children if c.name == "router"]
        rest = [c for c in self.children if c.name != "router"]
        for group, grace in ((router, drain + STOP_GRACE_S), (rest, STOP_GRACE_S)):
            _stop_all([c.process for c in group], grace, warn=True)
        self._cleanup_arena()
        if self.run_dir is not None:
            self.run_dir.remove()
        elif self.settings.run_dir:
            shutil.rmtree(self.settings.run_dir, ignore_errors=True)
        log.info("tandem stopped")
