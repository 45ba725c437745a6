"""A rank's side of a tensor-parallel worker group: joining it (MLX's
distributed environment from the plan the supervisor wrote,
protos/group_plan.py; the planning itself is deploy/group_plan.py), where
rank 0's lockstep records reach it, and the deadline of each unit of work.

The backend follows MLX's: `nccl` on its CUDA backend (one GPU per rank),
`ring` elsewhere (the CPU, a Mac's GPU); a plan across hosts (--hosts) may
ask for JACCL (RDMA over Thunderbolt 5 between Macs). mlx.launch sets the
same environment: MLX_RANK and MLX_HOSTFILE for a ring rank, MLX_WORLD_SIZE,
NCCL_HOST_IP and NCCL_PORT (rank 0's address) for an NCCL one. MPI is not
built.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal

from protos import transport
from protos.group_plan import RankSpec, jaccl_plan, lockstep_address_name, read_plan, read_ring

log = logging.getLogger(__name__)

# A rank that has not met every other one by then dies (the supervisor
# restarts the group): ring's connect retries and NCCL's rendezvous would
# otherwise wait (ring still retried after 60 s) for a peer that died at start.
JOIN_DEADLINE_S = 60


def lockstep_address(spec: RankSpec, run_dir: str, rank: int) -> str:
    """Where rank 0's record stream to `rank` is: tcp for a rank on another
    host (the group's plan), else ipc in the run dir."""
    return read_plan(spec.hostfile).get(rank) or transport.ipc_address(run_dir, lockstep_address_name(spec.group, rank))


def group_environment(spec: RankSpec, cuda: bool) -> tuple[str, dict]:
    """(backend, environment) a rank joins with, as mlx.launch would set
    them: the ring's hostfile (and NCCL's rank 0 address, from its first
    entry); with a JACCL plan (--hosts) its coordinator, the RDMA device matrix (in a file beside the hostfile, as
    mlx.launch writes one) and the ring flag. Writes that file."""
    env = {"MLX_RANK": str(spec.rank), "MLX_WORLD_SIZE": str(spec.size), "MLX_HOSTFILE": spec.hostfile}
    first = read_ring(spec.hostfile)[0][0]
    env["NCCL_HOST_IP"], env["NCCL_PORT"] = first.rsplit(":", 1)
    jaccl = jaccl_plan(spec.hostfile)
    if jaccl is None:
        return ("nccl" if cuda else "ring"), env  # on CUDA each rank sees its own GPU alone (deploy/group_plan.py)
    devices = os.path.splitext(spec.hostfile)[0] + ".ibv.json"
    with open(devices, "w") as f:
        json.dump(jaccl["devices"], f)
    env.update(MLX_IBV_DEVICES=devices, MLX_JACCL_COORDINATOR=jaccl["coordinator"])
    if jaccl["ring"]:
        env["MLX_JACCL_RING"] = "1"
    return "jaccl", env


def join_group(spec: RankSpec, deadline_s: int = JOIN_DEADLINE_S):
    """Set this process's distributed environment and join the group; returns
    the mx.distributed.Group. A rank that cannot join within `deadline_s`
    seconds (a peer that never came) is killed by SIGALRM. Main thread only."""
    from environment.backend import on_cuda

    backend, env = group_environment(spec, on_cuda())
    os.environ.update(env)

    import mlx.core as mx

    # The backend's connect holds the GIL while it retries: no Python thread or
    # handler could end it, so the kernel does (SIGALRM's default action).
    log.info("rank %d of %s joining (%s, %d s at most)", spec.rank, spec.group, backend, deadline_s)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(deadline_s)))
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    finally:
        signal.alarm(0)
    if (group.rank(), group.size()) != (spec.rank, spec.size):
        raise RuntimeError(f"{backend} made rank {group.rank()} of {group.size()}, "
                           f"not {spec.rank} of {spec.size}")
    log.info("rank %d of %d in %s (%s)", spec.rank, spec.size, spec.group, backend)
    return group


@contextlib.contextmanager
def unit_deadline(seconds: float):
    """A unit of work that must end within `seconds`, or the process dies
    (SIGALRM's default action): a rank blocked in a collective (a peer
    stuck, or ranks whose steps went apart) waits in MLX for ever, where no
    Python code and no message can reach it, and the supervisor's restart
    of the group, with the router moving its requests, is the way out.
    Main thread only; a no-op for seconds <= 0."""
    if seconds <= 0:
        yield
        return
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
