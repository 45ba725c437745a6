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

Models (deploy/models/): the --model one is slot "", started with the
server; the router asks for others on the control socket (control.py, a
thread that hands commands to this loop), and each gets its own workers
(slots.py). A model loaded on demand whose workers keep dying fails alone
(its slot says why); the cache service, the router and the --model one's
workers dying too often still stop the server.

Exit codes, for launchd's KeepAlive and systemd's Restart=on-failure: 0 only
after a requested stop (SIGTERM, Ctrl-C, SIGHUP); 1 whenever it gives up (the
port in use, a child dying too often).

The run dir (the sockets) and the shared-memory arena are removed on every
normal or signalled exit; what a server killed whole left behind is swept at
the next start (deploy/run_dir.py).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import replace

from cache_service.arena import unlink_arena
from deploy.blas import calm_blas_threads
from deploy.run_dir import RunDir, sweep_leftovers
from deploy.service.listen_socket import Listeners, ListenError, open_listeners
from deploy.group_plan import write_group_plan, write_hostfile
from deploy.models.children import KILL_WAIT_S, Child, Retiring, child_main, stop_all
from deploy.models.control import ModelControl
from deploy.models.slots import WORKER_TARGET, GROUP_TARGET, Slots, hostfile_path
from environment.settings import Settings
from protos.model_messages import LoadModel, ModelRefused, UnloadModel

log = logging.getLogger(__name__)

# A child that dies this often within the window is broken, not unlucky.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
# Stopping: the router gets the drain plus STOP_GRACE_S, the rest STOP_GRACE_S;
# a child still alive then is killed and waited for KILL_WAIT_S more.
STOP_GRACE_S = 5.0
GROUP_STOP_GRACE_S = 1.0  # the rest of a group that lost a rank, before SIGKILL
EXIT_STOPPED = 0  # a requested stop
EXIT_GAVE_UP = 1  # launchd and systemd restart the service on it


def longest_stop_s(drain_timeout_s: float) -> float:
    """The longest `shutdown` can take: what a service manager must wait
    (launchd's ExitTimeOut, systemd's TimeoutStopSec) before killing it."""
    return (drain_timeout_s + STOP_GRACE_S + KILL_WAIT_S) + (STOP_GRACE_S + KILL_WAIT_S)


class Supervisor:
    def __init__(self, settings: Settings, worker_targets: tuple[str, str] = (WORKER_TARGET, GROUP_TARGET)):
        self.settings = settings
        self.ctx = mp.get_context("spawn")
        self.children: list[Child] = []
        self.stopping = threading.Event()
        self.failed: str | None = None
        self.run_dir: RunDir | None = None  # the one this supervisor made (settings.run_dir unset)
        self.listeners: Listeners | None = None  # the HTTP port, handed to every router
        self._new_arena_name()
        # The models (deploy/models/): slot "" is the --model one; the router asks for others.
        self.slots = Slots(lambda: self.settings, worker_targets)
        self.control: ModelControl | None = None
        self.retiring = Retiring()  # an unloaded or failed model's workers, stopping

    def _new_arena_name(self) -> None:
        # A fresh name per cache-service start: stale handles can never read new data.
        self.settings = replace(self.settings, arena_name=f"tandem-{os.getpid()}-{uuid.uuid4().hex[:8]}")

    def _plan(self) -> None:
        self.children.append(Child("cache", "cache_service.main:run", lambda: (self.settings,)))
        self.children += self.slots.startup()
        self.children.append(Child("router", "router.main:run", lambda: (self.settings, self.listeners.sockets)))

    def _spawn(self, child: Child) -> None:
        if child.name == "cache":
            self._cleanup_arena()
            self._new_arena_name()
            if self.run_dir is not None:
                self.run_dir.record_arena(self.settings.arena_name)
        if child.group is not None and child.name == child.group:  # a group's start: fresh ports for its ranks
            hostfile = hostfile_path(self.settings.run_dir, child.group)
            if self.settings.group_hosts:
                write_group_plan(hostfile, self.settings.group_hosts, self.settings.group_backend)
            else:
                write_hostfile(hostfile, self.settings.group_size)
        child.process = self.ctx.Process(target=child_main, args=(child.target, child.args_fn(), child.env),
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
            self.control = ModelControl(self.settings.run_dir, self.slots)  # the router's: models loaded on demand
            self.control.start()
            if calm_blas_threads():
                log.info("OpenBLAS: idle threads sleep at once (OPENBLAS_THREAD_TIMEOUT=4)")
            for child in self.children:
                self._spawn(child)
            self._announce()
            while not self.stopping.is_set():
                self._step()
        finally:
            self.shutdown()
        return EXIT_GAVE_UP if self.failed else EXIT_STOPPED

    def _step(self) -> None:
        """One turn of the loop: the children that died, the restarts due, the
        models' workers stopping, the control socket's commands; waits 0.5 s at most."""
        now = time.monotonic()
        due = [c.restart_at - now for c in self.children if c.restart_at is not None]
        sentinels = {c.process.sentinel: c for c in self.children if c.process is not None and c.restart_at is None}
        retiring = self.retiring.next_s()
        timeout = min([0.5, *due] + ([] if retiring is None else [retiring]))
        ready = mp.connection.wait([*sentinels, self.control.wakeup, *self.retiring.sentinels()], max(0.0, timeout))
        for obj in ready:
            if self.stopping.is_set():
                return
            child = sentinels.get(obj) if isinstance(obj, int) else None
            if child is not None and child.restart_at is None and any(c is child for c in self.children):
                self._on_exit(child)  # (a slot that failed just now took its other children away)
        for child in self.children:
            if child.restart_at is not None and child.restart_at <= time.monotonic() and not self.stopping.is_set():
                child.restart_at = None
                self._spawn(child)
        self.retiring.tick()
        for cmd in self.control.take():
            self._command(cmd)

    def _command(self, cmd) -> None:
        """A control socket command (deploy/models/control.py), carried out here,
        the one thread that touches children; an unload is answered once its
        workers are gone, without holding up the loop."""
        if isinstance(cmd.msg, (LoadModel, UnloadModel)):
            load = isinstance(cmd.msg, LoadModel)
            changed = (self.slots.load(cmd.msg.name, cmd.resolved) if load else self.slots.unload(cmd.msg.name))
            if isinstance(changed, ModelRefused):
                cmd.answer(changed)
                return
            if load:
                for child in changed:
                    self.children.append(child)
                    self._spawn(child)
            else:
                self._retire(changed, then=lambda: cmd.answer(self.slots.state()))
                return
        cmd.answer(self.slots.state())

    def _retire(self, children: list, then=None) -> None:
        """Stop these children (SIGTERM, SIGKILL after the grace) and forget them."""
        self.children = [c for c in self.children if not any(c is x for x in children)]
        self.retiring.add([c.process for c in children], STOP_GRACE_S, then)

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
        if self._gave_up(child, [child], lambda n: f"{child.name} died {n} times in {RESTART_WINDOW_S:.0f}s "
                                                   f"(last exit code {code})"):
            return
        log.warning("%s (pid %d) exited with code %s; restarting", child.name, child.process.pid, code)

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
        stop_all([c.process for c in members], GROUP_STOP_GRACE_S)
        if self._gave_up(members[0], members, lambda n: f"group {dead.group} lost a rank {n} times in "
                                                        f"{RESTART_WINDOW_S:.0f}s (last: {dead.name}, exit code {code})"):
            return
        # How each rank ended: a rank 0 ended here, not by its unit deadline (-14), went within the grace.
        log.warning("%s (pid %d) exited with code %s; restarting group %s (%s)", dead.name, dead.process.pid, code,
                    dead.group, ", ".join(f"{c.name}: {c.process.exitcode}" for c in members))

    def _gave_up(self, record: Child, members: list, why) -> bool:
        """Counts a death on `record`: `members` start again after a back-off
        (the loop goes on meanwhile), or, past MAX_RESTARTS in the window, a
        model loaded on demand fails alone (its workers stopped; the router
        tells its requests) while any other child stops the server."""
        now = time.monotonic()
        record.restarts = [t for t in record.restarts if now - t < RESTART_WINDOW_S] + [now]
        if len(record.restarts) <= MAX_RESTARTS:
            for c in members:
                c.restart_at = now + min(0.2 * 2 ** (len(record.restarts) - 1), 5.0)
            return False
        if record.slot:  # "m1", ...: the --model one (slot "") gives up the server as before
            self._retire(self.slots.fail(record.slot, why(len(record.restarts))))
            return True
        self.failed = why(len(record.restarts))
        log.error("%s; stopping", self.failed)
        self.stopping.set()
        return True

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
        if self.control is not None:
            self.control.close()  # a command waiting is told the server stops
        rest = [c.process for c in self.children if c.name != "router"] + self.retiring.processes()
        stop_all([c.process for c in router], drain + STOP_GRACE_S, warn=True)
        stop_all(rest, STOP_GRACE_S, warn=True)
        self._cleanup_arena()
        if self.run_dir is not None:
            self.run_dir.remove()
        elif self.settings.run_dir:
            shutil.rmtree(self.settings.run_dir, ignore_errors=True)
        log.info("tandem stopped")
