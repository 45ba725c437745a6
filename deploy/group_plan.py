"""What the supervisor plans for a worker group at each (re)start: where
each rank runs, the ring hostfile MLX reads, the plan beside it
(protos/group_plan.py, the format the ranks read) and each rank's
environment. A rank's own side, joining the group and following rank 0,
is workers/group/.

mlx.launch starts a ring rank by exporting MLX_RANK and MLX_HOSTFILE and
running the program; the supervisor does the same without it: it writes
the hostfile with fresh ports at every start of a group and spawns each
rank like any other child (workers/group/ranks.py then sets MLX's
environment from it and joins).

On one host (`write_hostfile`) every rank listens on a free loopback port.
Across hosts (--hosts, read and checked by deploy/hosts_flags.py;
`write_group_plan`) each rank's "ip:port" comes from its entry's ips, and
the plan names, for each rank on another host, the tcp address rank 0
sends its lockstep records to (workers/group/lockstep.py, CURVE); with
JACCL also its coordinator's address and the RDMA devices. Every port is
chosen free on this host, fresh at each start: a port that happens to be
taken on another host fails that rank's join (the ring's bind error in its
log) and the group restarts with other ports. mlx.launch instead numbers
ports from a fixed one (32323) that must be free on every host.
"""

from __future__ import annotations

import socket
from typing import NamedTuple

from protos.group_plan import plan_path, write_plan, write_ring


class HostEntry(NamedTuple):
    """One entry of --hosts; a plain tuple, so settings carry it to every rank
    (pickled, and as JSON to other hosts, where it arrives as a list)."""

    ssh: str  # the name --ssh-command reaches it by
    ips: tuple  # the IPv4 addresses its rank listens on (the ring), reachable from the other hosts
    rdma: tuple = ()  # JACCL: per rank, the RDMA device (or devices) that reaches it; None for itself


def is_remote(hosts, rank: int) -> bool:
    """Rank `rank` runs on another host than rank 0 (started over ssh)."""
    return bool(hosts) and hosts[rank][0] != hosts[0][0]


def local_index(hosts, rank: int) -> int:
    """Rank `rank`'s place among the ranks of its host (its GPU there, on CUDA)."""
    return rank if not hosts else sum(1 for r in range(rank) if hosts[r][0] == hosts[rank][0])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free on `host` ("": every address) now."""
    ports: set[int] = set()
    while len(ports) < n:
        with socket.socket() as s:
            s.bind((host, 0))
            ports.add(s.getsockname()[1])
    return sorted(ports)


def write_hostfile(path: str, size: int) -> None:
    """mlx.launch's ring hostfile for `size` ranks on 127.0.0.1, each on a
    port free now (fresh at every group start: a restarted group never
    waits for its dead predecessor's sockets)."""
    write_ring(path, [[f"127.0.0.1:{p}"] for p in free_ports(size)])


def write_group_plan(hostfile: str, hosts, backend: str = "") -> None:
    """A group start's ring hostfile at `hostfile` from the --hosts entries,
    and its plan beside it: rank 0's tcp lockstep address for each rank on
    another host, and with JACCL its coordinator and devices. Fresh ports
    (see the module's note)."""
    entries = [HostEntry(h[0], tuple(h[1]), tuple(h[2]) if len(h) > 2 else ()) for h in hosts]
    remote = [r for r in range(len(entries)) if is_remote(hosts, r)]
    jaccl = backend.startswith("jaccl")
    ports = iter(free_ports(sum(len(h.ips) for h in entries) + len(remote) + jaccl, host=""))
    ring = [[f"{ip}:{next(ports)}" for ip in h.ips] for h in entries]
    lockstep = {str(r): f"tcp://{entries[0].ips[0]}:{next(ports)}" for r in remote}
    plan = None
    if jaccl:  # mlx.launch's MLX_JACCL_COORDINATOR, MLX_IBV_DEVICES, MLX_JACCL_RING
        plan = {"coordinator": f"{entries[0].ips[0]}:{next(ports)}", "ring": backend == "jaccl-ring",
                "devices": [[list(d) if isinstance(d, tuple) else d for d in h.rdma] for h in entries]}
    write_ring(hostfile, ring)
    write_plan(plan_path(hostfile), lockstep, plan)


def rank_environment(rank: int, parent_env) -> dict:
    """What a rank's process must see before it loads MLX: on CUDA, its own
    GPU alone (the r-th of those the server may use, all by default), as
    mlx.launch does. A stream mlx-lm makes at import (its generation stream)
    lands on the process's first GPU: with every GPU visible and the rank's
    chosen later, rank 1's steps failed with "invalid resource handle".
    Harmless where there is no CUDA."""
    visible = [d.strip() for d in parent_env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return {"CUDA_VISIBLE_DEVICES": visible[rank % len(visible)] if visible else str(rank)}
