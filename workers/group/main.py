"""A tensor-parallel group's rank process main (the supervisor's `spawn`
target for every rank of a group): join the group, then rank 0 runs as a
worker (workers/main.py) leading the others, which follow it
(workers/group/members.py).

A rank's process ends itself (`end`), past the interpreter's finalization:
that runs MLX's distributed teardown, which waits on the other ranks. A
follower that gave up on a busy rank 0 took 2 s to exit on ring; on NCCL
(issue 40) it did not exit while rank 0 sat in the collective it had left,
so the supervisor never saw a rank die and the group stood until rank 0's
unit deadline (300 s). A rank's exit is what takes its group down (the
supervisor ends the other ranks at once, deploy/supervisor.py), so it must
come within seconds of the stop.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
from dataclasses import replace

import zmq

from environment.logs import setup_logging
from environment.settings import Settings
from protos import transport
from protos.group_plan import RankSpec
from protos.messages import WorkerHello
from workers.group.lockstep import GroupBroken, RecordStream
from workers.group.members import DiscardOutbox, Follower, Leader
from workers.group.ranks import join_group, lockstep_address
from workers.models.loading import set_cuda_graphs
from workers.parts import WorkerParts
from workers.power_limits import PowerLimits
from workers.worker import Worker

log = logging.getLogger(__name__)

# A follower's clean-up after it gave up on rank 0 (its stores, its cache
# clients) gets this many seconds before the process ends regardless.
CLOSE_DEADLINE_S = 2


def end(code: int):
    """End this process now with `code`, its logs flushed: no interpreter
    finalization, so no MLX teardown that waits on other ranks."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def run(settings: Settings, roles: list[str], spec: RankSpec) -> None:
    """Process main for one rank of a group (a `spawn` target): it serves,
    then the process ends at once (`end`), non-zero unless asked to stop."""
    code = 1
    try:
        code = serve(settings, roles, spec)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - logged; the exit below is what the group must see
        log.exception("worker %s failed", spec.name)
    finally:
        end(code)


def serve(settings: Settings, roles: list[str], spec: RankSpec) -> int:
    """One rank's life until it stops; its exit code (1: the group broke).
    The caller ends the process (`end`): deploy/rank_cmd.py cleans up first."""
    set_cuda_graphs()  # before any GPU work: MLX reads it once
    setup_logging(settings.log_level, f"worker:{spec.name}")
    # Every rank drafts as rank 0 does (prompt lookup, or the whole draft model on each
    # rank: workers/group/members.py); prefill runs on MLX, not the Neural Engine (serve refuses it).
    settings = replace(settings, prefill_backend="mlx")
    group = join_group(spec)
    if spec.rank == 0:
        from workers.main import run as run_worker

        try:
            run_worker(settings, roles, spec.name,
                       make_runner=lambda ctx, hello: Leader(settings, ctx, hello, group=group, spec=spec))
        except GroupBroken as exc:  # told the router it stops; the supervisor restarts the group
            log.error("worker %s stops: %s", spec.name, exc)
            return 1
        return 0
    return follow(settings, roles, spec, group)


def follow(settings: Settings, roles: list[str], spec: RankSpec, group) -> int:
    """A follower's life: load and shard, replay rank 0's records until it
    stops; 1 when rank 0 went silent (the supervisor then restarts the
    group), its clean-up bounded by CLOSE_DEADLINE_S."""
    ctx = zmq.Context()
    hello = WorkerHello(worker_id=spec.name, roles=list(roles), pid=os.getpid(), state="loading",
                        model_id=settings.model_id)
    address = lockstep_address(spec, settings.run_dir, spec.rank)
    # A rank on another host (tcp) has no cache service there (deploy/remote_rank.py).
    other_host = address.startswith("tcp://")
    stream = RecordStream(ctx, address, transport.worker_keys(settings.rank_keys) if other_host else None)
    # Its roles take rank 0's id: what they decide by it (a colocated prompt's
    # KV kept for its decode) must come out as on rank 0. Its logs say which rank.
    power = PowerLimits(settings, may_defer=False)
    parts = WorkerParts(settings, roles, spec.group, hello, DiscardOutbox(), power, group=group,
                        prefix_here=not other_host)
    follower = None

    def on_signal(signum, _frame):
        if follower is not None:
            follower.worker.stopping = True
        else:
            stopped.append(signum)

    stopped: list = []
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    broken = None
    try:
        parts.load()
        worker = Worker(parts.roles, parts.takes, worker_id=spec.group, inbox=queue.Queue(), outbox=parts.outbox,
                        hello=hello, power=power, after_pass=parts.after_pass)
        worker.stopping = bool(stopped)
        follower = Follower(worker, stream, settings, relieve=parts.relieve)
        follower.serve()
    except GroupBroken as exc:
        broken = exc
        log.error("worker %s stops: %s", spec.name, exc)
        # Rank 0 may sit in a collective this rank left, and what waits on it here may
        # hold the GIL: the kernel ends the clean-up if it runs long (SIGALRM's default).
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(CLOSE_DEADLINE_S)
    finally:
        stream.close()
        parts.close()
        log.info("worker %s stopped", spec.name)
    return 1 if broken is not None else 0
