"""A worker process's main (the supervisor's `spawn` target): the sockets,
the signals, its parts (workers/parts.py) and the Worker loop over them
(workers/worker.py), optionally under cProfile."""

from __future__ import annotations

import cProfile
import logging
import os
import signal

import zmq

from environment.logs import setup_logging
from environment.settings import Settings
from protos import transport
from protos.messages import WorkerHello
from workers.models.loading import set_cuda_graphs
from workers.parts import WorkerParts
from workers.power_limits import PowerLimits
from workers.socket_loop import Outbox, SocketLoop
from workers.worker import Alone, Worker

log = logging.getLogger(__name__)


def run(settings: Settings, roles: list[str], worker_id: str, make_runner=None) -> None:
    """Process main for a worker (a `spawn` target). `make_runner(ctx, hello)`:
    how the loop takes messages and runs units (workers/worker.py Alone, or
    a group's rank 0: workers/group/main.py)."""
    set_cuda_graphs()  # before any GPU work: MLX reads it once
    setup_logging(settings.log_level, f"worker:{worker_id}")
    ctx = zmq.Context()
    hello = WorkerHello(worker_id=worker_id, roles=list(roles), pid=os.getpid(), state="loading",
                        model_id=settings.model_id, kv_host=settings.kv_host)
    # A remote worker (`tandem worker`) joins over tcp with CURVE keys; the rest over this host's ipc socket.
    loop = SocketLoop(ctx, settings.router_address or transport.ipc_address(settings.run_dir, settings.router_socket), hello,
                      settings.heartbeat_interval_s, join_timeout_s=settings.router_join_timeout_s,
                      curve=transport.worker_keys(settings.router_keys) if settings.router_keys else None)
    runner = make_runner(ctx, hello) if make_runner else Alone()
    power = PowerLimits(settings, may_defer=runner.group is None)  # a group warms up at once, in step
    parts = WorkerParts(settings, roles, worker_id, hello, runner.wrap_outbox(Outbox(ctx)), power,
                        group=runner.group)
    worker = None

    def on_signal(signum, _frame):
        if worker is not None:
            worker.stopping = True
        loop.inbox.put(None)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    loop.start()
    try:
        parts.load()
        runner.loaded()
        worker = Worker(parts.roles, parts.takes, worker_id=worker_id, inbox=loop.inbox, outbox=parts.outbox,
                        hello=hello, power=power, runner=runner, after_pass=parts.after_pass)
        _serve_profiled(worker, os.environ.get("TANDEM_PROFILE_DIR"))
    finally:
        if parts.stores:
            parts.stores.close()  # while the socket loop runs: its queued handoffs still go out
        loop.stopping.set()
        loop.join(timeout=2)
        try:
            runner.close()
        finally:
            parts.close()
        ctx.term() if not loop.is_alive() else None
        log.info("worker %s stopped", worker_id)
    if loop.error is not None:  # its socket loop died: exit non-zero, the supervisor restarts us
        raise SystemExit(1)


def _serve_profiled(worker: Worker, profile_dir: str | None) -> None:
    """Serve; with TANDEM_PROFILE_DIR set, under cProfile, its stats written
    there at stop (worker-<id>-<pid>.pstats): where a slow loop's time goes,
    function by function, on a machine that has no other profiler."""
    if not profile_dir:
        worker.serve()
        return
    prof = cProfile.Profile()
    try:
        prof.runcall(worker.serve)
    finally:
        os.makedirs(profile_dir, exist_ok=True)
        path = os.path.join(profile_dir, f"worker-{worker.worker_id}-{os.getpid()}.pstats")
        prof.dump_stats(path)
        log.info("profile written to %s", path)
