"""A worker group across hosts (`tandem serve --hosts FILE`): mlx.launch's
hostfile, read and checked at start, and each group start's plan.

The file is mlx.launch's: a JSON list of {"ssh": NAME, "ips": [IP, ...]}, or
{"hosts": [...], "backend": ..., "envs": ["KEY=VALUE", ...]}. Rank i runs on
entry i; entry 0 is this host (rank 0 faces the router). With the backend
"jaccl" (RDMA over Thunderbolt 5, macOS 26.2+) or "jaccl-ring", each entry's
"rdma" lists, per rank, the RDMA device that reaches it (null for itself),
checked as mlx.launch checks it; the group then meets through JACCL, with
rank 0's first ip as its coordinator (`jaccl_plan`), and the ips still
carry rank 0's lockstep records. A rank whose entry names the same `ssh` host as entry 0
runs here, as any group's rank does; the others are started on their host
over --ssh-command (deploy/remote_rank.py), as mlx.launch does.

At every (re)start of a group the supervisor writes its plan
(`write_group_plan`): the ring hostfile MLX reads (each rank's "ip:port"
from its entry's ips) and, for each rank on another host, the tcp address
rank 0 sends its lockstep records to (workers/group/lockstep.py, CURVE);
with JACCL also its coordinator's address and the RDMA devices.
Every port is chosen free on this host, fresh at each start, as for a group
on one host: a port that happens to be taken on another host fails that
rank's join (the ring's bind error in its log) and the group restarts with
other ports. mlx.launch instead numbers ports from a fixed one (32323)
that must be free on every host.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from typing import NamedTuple

# What join_group runs (workers/group/ranks.py): "" is ring, or nccl on CUDA. MPI is not built.
BACKENDS = ("", "ring", "nccl", "jaccl", "jaccl-ring")


class HostsError(ValueError):
    """A hostfile that cannot run the group asked for; the message says why."""


class HostEntry(NamedTuple):
    """One entry; a plain tuple, so settings carry it to every rank (pickled,
    and as JSON to other hosts, where it arrives as a list)."""

    ssh: str  # the name --ssh-command reaches it by
    ips: tuple  # the IPv4 addresses its rank listens on (the ring), reachable from the other hosts
    rdma: tuple = ()  # JACCL: per rank, the RDMA device (or devices) that reaches it; None for itself


def _entries(data, path: str) -> tuple[list, str, list]:
    backend, envs = "", []
    if isinstance(data, dict):
        backend, envs, data = data.get("backend", "") or "", data.get("envs", []) or [], data.get("hosts")
    if not isinstance(data, list) or not data:
        raise HostsError(f"{path}: expected mlx.launch's hostfile, a JSON list of "
                         '{"ssh": HOST, "ips": [IP, ...]} (or {"hosts": [...]})')
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise HostsError(f'{path}: "envs" must be a list of "KEY=VALUE"')
    return data, backend, envs


def _entry(item, i: int, path: str) -> HostEntry:
    if not isinstance(item, dict) or not isinstance(item.get("ssh"), str) or not item["ssh"].strip():
        raise HostsError(f'{path}: entry {i} has no "ssh" host name')
    ips = item.get("ips") or []
    if not isinstance(ips, list) or not ips:
        raise HostsError(f'{path}: entry {i} ({item["ssh"]}) has no "ips": the ranks of a group meet over '
                         "the addresses listed there (MLX's ring backend needs IPs, not host names)")
    for ip in ips:
        try:
            ipaddress.IPv4Address(ip)
        except (ValueError, TypeError):  # MLX's ring reads "ip:port" up to the first colon: IPv4 only
            raise HostsError(f"{path}: entry {i} ({item['ssh']}): {ip!r} is not an IPv4 address") from None
    rdma = item.get("rdma") or []
    if not isinstance(rdma, list) or not all(d is None or isinstance(d, str) or (
            isinstance(d, list) and all(isinstance(x, str) for x in d)) for d in rdma):
        raise HostsError(f'{path}: entry {i} ({item["ssh"]}): "rdma" must list a device name (or names, '
                         "or null) per rank")
    return HostEntry(item["ssh"].strip(), tuple(ips), tuple(tuple(d) if isinstance(d, list) else d for d in rdma))


def _check_rdma(hosts: tuple, backend: str, path: str) -> None:
    """mlx.launch's checks of a JACCL hostfile: a device per rank on every
    entry, none for itself, one for every peer it talks to (every other
    rank; with jaccl-ring, its two neighbours)."""
    n = len(hosts)
    if any(len(h.rdma) != n for h in hosts):
        raise HostsError(f'{path}: backend {backend} needs "rdma" on every entry, one device (or null) per rank '
                         f"({n}): the RDMA device that reaches that rank")
    if any(h.rdma[i] is not None for i, h in enumerate(hosts)):
        raise HostsError(f'{path}: an entry\'s own place in its "rdma" list must be null')
    ring = backend == "jaccl-ring"
    missing = [(i, j) for i, h in enumerate(hosts) for j in (((i - 1) % n, (i + 1) % n) if ring else range(n))
               if i != j and h.rdma[j] is None]
    if missing:
        pairs = ", ".join(f"{hosts[i].ssh} to {hosts[j].ssh}" for i, j in missing[:3])
        raise HostsError(f"{path}: no RDMA device is listed for {pairs}")


def read_hosts(path: str, size: int) -> tuple[tuple, tuple, str]:
    """(entries, envs, backend) of the hostfile at `path` for a group of
    `size` ranks. Raises HostsError saying what is wrong: not mlx.launch's
    format, another count of hosts, entry 0 not this host, a backend not
    built, JACCL devices missing."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise HostsError(f"{path}: {exc}") from None
    items, backend, envs = _entries(data, path)
    if backend not in BACKENDS:
        raise HostsError(f"{path}: backend {backend!r} is not built for Tandem's groups (ring on the CPU and "
                         "Metal, nccl on CUDA, as on one host); leave it out")
    hosts = tuple(_entry(item, i, path) for i, item in enumerate(items))
    if len(hosts) != size:
        raise HostsError(f"{path} lists {len(hosts)} hosts for a group of {size} ranks: rank i runs on entry i, "
                         "so give one entry per rank")
    if len({len(h.ips) for h in hosts}) != 1:
        raise HostsError(f"{path}: every entry needs as many ips (MLX's ring connects each rank to its "
                         "neighbours once per ip, as many on each side)")
    foreign = [ip for ip in hosts[0].ips if not is_local_address(ip)]
    if foreign:
        raise HostsError(f"{path}: entry 0 ({hosts[0].ssh}) must be this host, where rank 0 runs and listens, "
                         f"but {', '.join(foreign)} is not an address of this host")
    if backend.startswith("jaccl"):
        _check_rdma(hosts, backend, path)
    return hosts, tuple(envs), backend


def is_local_address(ip: str) -> bool:
    """Whether `ip` is an address of this host (one a socket can bind)."""
    with socket.socket() as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


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


def plan_path(hostfile: str) -> str:
    """Where a group's plan (lockstep addresses) sits, beside its ring hostfile."""
    return os.path.splitext(hostfile)[0] + ".plan.json"


def write_group_plan(hostfile: str, hosts, backend: str = "") -> None:
    """A group start's ring hostfile (MLX's: each rank's "ip:port" list) at
    `hostfile`, and its plan beside it: rank 0's tcp lockstep address for
    each rank on another host, and with JACCL its coordinator and devices.
    Fresh ports (see the module's note)."""
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
    with open(hostfile, "w") as f:
        json.dump(ring, f)
    write_plan(plan_path(hostfile), lockstep, plan)


def write_plan(path: str, lockstep: dict, jaccl: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"lockstep": lockstep, **({"jaccl": jaccl} if jaccl else {})}, f)


def jaccl_plan(hostfile: str) -> dict | None:
    """A JACCL group start's {"coordinator", "ring", "devices"}; None otherwise."""
    try:
        with open(plan_path(hostfile)) as f:
            return json.load(f).get("jaccl")
    except FileNotFoundError:
        return None


def read_plan(hostfile: str) -> dict[int, str]:
    """{rank: rank 0's tcp lockstep address for it}: the ranks of other
    hosts; {} for a group on one host (no plan)."""
    try:
        with open(plan_path(hostfile)) as f:
            return {int(r): a for r, a in json.load(f)["lockstep"].items()}
    except FileNotFoundError:
        return {}
