"""The ranks of a tensor-parallel worker group on one host, and their
mx.distributed set-up, without mlx.launch.

mlx.launch starts a ring rank by exporting MLX_RANK and MLX_HOSTFILE (the
path of a JSON list, one entry per rank, each a list of "ip:port" that rank
listens on) and running the program; an NCCL rank gets MLX_RANK,
MLX_WORLD_SIZE, NCCL_HOST_IP and NCCL_PORT (rank 0's address) instead.
The supervisor does the same for local ranks: it writes the hostfile with
fresh loopback ports at every (re)start of a group (`write_hostfile`) and
spawns each rank like any other child; the rank sets its environment and
joins the group (`join_group`) before it loads anything.

The backend follows MLX's: `nccl` on its CUDA backend (one GPU per rank),
`ring` elsewhere (the CPU, a Mac's GPU). A group across hosts (--hosts)
writes its hostfile from the file's ips instead, and its ranks on other
hosts follow rank 0 over tcp (workers/group/hosts.py, deploy/remote_rank.py);
its hostfile may ask for JACCL (RDMA over Thunderbolt 5 between Macs). MPI
is not built.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from dataclasses import dataclass

from protos import transport
from workers.group.hosts import free_ports, jaccl_plan, read_plan

log = logging.getLogger(__name__)

# A rank that has not met every other one by then dies (the supervisor
# restarts the group): ring's connect retries and NCCL's rendezvous would
# otherwise wait (ring still retried after 60 s) for a peer that died at start.
JOIN_DEADLINE_S = 60


@dataclass(frozen=True)
class RankSpec:
    """One rank of a group, as the supervisor hands it to the process."""

    group: str  # the group's name: its rank 0's worker id, e.g. "worker-0"
    rank: int
    size: int
    hostfile: str  # the JSON file of every rank's "ip:port" (write_hostfile)

    @property
    def name(self) -> str:
        """The process's name: the group's for rank 0 (the one the router
        sees), "<group>.r<rank>" for the followers."""
        return self.group if self.rank == 0 else f"{self.group}.r{self.rank}"


def rank_names(group: str, size: int) -> list[str]:
    return [RankSpec(group, r, size, "").name for r in range(size)]


def write_hostfile(path: str, size: int) -> None:
    """mlx.launch's ring hostfile for `size` ranks on 127.0.0.1, each on a
    port free now (fresh at every group start: a restarted group never
    waits for its dead predecessor's sockets)."""
    with open(path, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in free_ports(size)], f)


def rank_environment(rank: int, parent_env) -> dict:
    """What a rank's process must see before it loads MLX: on CUDA, its own
    GPU alone (the r-th of those the server may use, all by default), as
    mlx.launch does. A stream mlx-lm makes at import (its generation stream)
    lands on the process's first GPU: with every GPU visible and the rank's
    chosen later, rank 1's steps failed with "invalid resource handle".
    Harmless where there is no CUDA."""
    visible = [d.strip() for d in parent_env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {"CUDA_VISIBLE_DEVICES": visible[rank % len(visible)] if visible else str(rank)}


def lockstep_address_name(group: str, rank: int) -> str:
    """The ipc name (in the run dir) of rank 0's record stream to `rank`."""
    return f"{group}.lockstep.r{rank}"


def lockstep_address(spec: RankSpec, run_dir: str, rank: int) -> str:
    """Where rank 0's record stream to `rank` is: tcp for a rank on another
    host (the group's plan, workers/group/hosts.py), else ipc in the run dir."""
    return read_plan(spec.hostfile).get(rank) or transport.ipc_address(run_dir, lockstep_address_name(spec.group, rank))


def group_environment(spec: RankSpec, cuda: bool) -> tuple[str, dict]:
    """(backend, environment) a rank joins with, as mlx.launch would set
    them: the ring's hostfile (and NCCL's rank 0 address, from its first
    entry); with a JACCL plan (workers/group/hosts.py, --hosts) its
    coordinator, the RDMA device matrix (in a file beside the hostfile, as
    mlx.launch writes one) and the ring flag. Writes that file."""
    env = {"MLX_RANK": str(spec.rank), "MLX_WORLD_SIZE": str(spec.size), "MLX_HOSTFILE": spec.hostfile}
    with open(spec.hostfile) as f:
        first = json.load(f)[0][0]
    env["NCCL_HOST_IP"], env["NCCL_PORT"] = first.rsplit(":", 1)
    jaccl = jaccl_plan(spec.hostfile)
    if jaccl is None:
        return ("nccl" if cuda else "ring"), env  # on CUDA each rank sees its own GPU alone (rank_environment)
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
