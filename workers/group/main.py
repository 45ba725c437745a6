"""A tensor-parallel group's rank process main (the supervisor's `spawn`
target for every rank of a group): join the group, then rank 0 runs as a
worker (workers/main.py) and the others follow it (workers/group/members.py)."""

from __future__ import annotations

import functools
import logging
import os
import queue
import signal
from dataclasses import replace
from types import SimpleNamespace

import zmq

from environment.logs import setup_logging
from environment.settings import Settings
from protos.messages import WorkerHello
from workers.group.lockstep import GroupBroken
from workers.group.members import FollowerWorker, LeaderWorker
from protos.group_plan import RankSpec
from workers.group.ranks import join_group
from workers.models.loading import set_cuda_graphs

log = logging.getLogger(__name__)


def run(settings: Settings, roles: list[str], spec: RankSpec) -> None:
    """Process main for one rank of a group (a `spawn` target)."""
    set_cuda_graphs()  # before any GPU work: MLX reads it once
    setup_logging(settings.log_level, f"worker:{spec.name}")
    # Every rank drafts as rank 0 does (prompt lookup, or the whole draft model on each
    # rank: workers/group/members.py); prefill runs on MLX, not the Neural Engine (serve refuses it).
    settings = replace(settings, prefill_backend="mlx")
    group = join_group(spec)
    if spec.rank == 0:
        from workers.main import run as run_worker

        try:
            run_worker(settings, roles, spec.name, make_worker=functools.partial(LeaderWorker, group=group, spec=spec))
        except GroupBroken as exc:  # told the router it stops; the supervisor restarts the group
            log.error("worker %s stops: %s", spec.name, exc)
            raise SystemExit(1) from None
    else:
        follow(settings, roles, spec, group)


def follow(settings: Settings, roles: list[str], spec: RankSpec, group) -> None:
    """A follower's life: load and shard, replay rank 0's records until it
    stops; exit non-zero when rank 0 went silent (the supervisor then
    restarts the group)."""
    ctx = zmq.Context()
    hello = WorkerHello(worker_id=spec.name, roles=list(roles), pid=os.getpid(), state="loading",
                        model_id=settings.model_id)
    loop = SimpleNamespace(hello=hello, inbox=queue.Queue())  # no router socket: rank 0 has it
    # Its roles take rank 0's id: what they decide by it (a colocated prompt's
    # KV kept for its decode) must come out as on rank 0. Its logs say which rank.
    worker = FollowerWorker(settings, roles, spec.group, ctx, loop, group=group, spec=spec)

    def on_signal(signum, _frame):
        worker.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    broken = None
    try:
        worker.load()
        worker.serve()
    except GroupBroken as exc:
        broken = exc
        log.error("worker %s stops: %s", spec.name, exc)
    finally:
        worker.close()
        log.info("worker %s stopped", spec.name)
    if broken is not None:
        raise SystemExit(1)
