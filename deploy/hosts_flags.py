"""`tandem serve`'s flags for a worker group across hosts (--hosts FILE),
checked before anything starts; each start's plan from them is
deploy/group_plan.py.

The file is mlx.launch's: a JSON list of {"ssh": NAME, "ips": [IP, ...]}, or
{"hosts": [...], "backend": ..., "envs": ["KEY=VALUE", ...]}. Rank i runs on
entry i; entry 0 is this host (rank 0 faces the router). With the backend
"jaccl" (RDMA over Thunderbolt 5, macOS 26.2+) or "jaccl-ring", each entry's
"rdma" lists, per rank, the RDMA device that reaches it (null for itself),
checked as mlx.launch checks it; the group then meets through JACCL, with
rank 0's first ip as its coordinator, and the ips still carry rank 0's
lockstep records. A rank whose entry names the same `ssh` host as entry 0
runs here, as any group's rank does; the others are started on their host
over --ssh-command (deploy/remote_rank.py), as mlx.launch does.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import socket
import sys

from deploy.group_plan import HostEntry, is_remote
from environment.settings import Settings
from protos.transport import KeysError, router_keys

# What join_group runs (workers/group/ranks.py): "" is ring, or nccl on CUDA. MPI is not built.
BACKENDS = ("", "ring", "nccl", "jaccl", "jaccl-ring")


class HostsError(ValueError):
    """A hostfile that cannot run the group asked for; the message says why."""


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


def jaccl_problem(backend: str, platform: str = sys.platform) -> None:
    """Raises ValueError when this host cannot run a JACCL group: JACCL is
    RDMA over Thunderbolt 5, in MLX's macOS builds (macOS 26.2 or later)."""
    if platform != "darwin":
        raise ValueError(f"--hosts asks for backend {backend}: JACCL (RDMA over Thunderbolt 5) runs between Macs "
                         f"only (macOS 26.2 or later), and this host is {platform}; leave \"backend\" out for "
                         "ring over the listed ips")
    import mlx.core as mx

    if not mx.distributed.is_available("jaccl"):
        raise ValueError(f"--hosts asks for backend {backend}, but this MLX ({mx.__version__}) has no JACCL: "
                         "it needs macOS 26.2 or later and an MLX built with it (pip install -U mlx); "
                         "leave \"backend\" out for ring over the listed ips")


def add_hosts_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--hosts", default=None, metavar="FILE",
                   help="run each group's ranks on several hosts: mlx.launch's hostfile (a JSON list of "
                        '{"ssh": HOST, "ips": [IP]}, or {"backend": "jaccl", "hosts": [... with "rdma"]} '
                        "between Macs), rank i on entry i, entry 0 this host; ranks of other "
                        "hosts start there over --ssh-command (with --tensor-parallel or --pipeline-parallel N)")
    p.add_argument("--ssh-command", default=d.ssh_command, metavar="CMD",
                   help="how a rank on another host is started: CMD HOST COMMAND (default: %(default)s)")
    p.add_argument("--group-keys", default="", metavar="DIR",
                   help="--hosts: this host's CURVE folder for the ranks' lockstep over tcp: its pair and the "
                        "other hosts' ranks' public keys (`tandem keys`' router folder)")
    p.add_argument("--rank-keys", default="", metavar="DIR",
                   help="--hosts: the folder of each other host's rank from `tandem keys` (its pair and this "
                        "host's public key), at this path on every other host")


def hosts_settings(args: argparse.Namespace, size: int) -> dict:
    """The Settings fields --hosts and its flags give (none without --hosts).
    Raises ValueError saying what is wrong."""
    if not args.hosts:
        if args.group_keys or args.rank_keys:
            raise ValueError("--group-keys and --rank-keys are for a group across hosts: give --hosts FILE")
        return {}
    if size <= 1:
        raise ValueError("--hosts runs a group's ranks on several hosts: give --tensor-parallel N or "
                         "--pipeline-parallel N (N: the hosts in the file)")
    try:
        hosts, envs, backend = read_hosts(args.hosts, size)
    except HostsError as exc:
        raise ValueError(f"--hosts {exc}") from None
    if backend.startswith("jaccl"):
        jaccl_problem(backend)
    if not shlex.split(args.ssh_command):
        raise ValueError("--ssh-command is empty")
    if any(is_remote(hosts, r) for r in range(size)):
        if not args.group_keys or not args.rank_keys:
            raise ValueError("--hosts with ranks on other hosts needs --group-keys DIR and --rank-keys DIR: "
                             "rank 0's records (prompts included) go to them over tcp with CURVE only "
                             "(`tandem keys --out DIR --name NAME` makes both folders)")
        try:
            router_keys(args.group_keys)
        except (KeysError, OSError) as exc:
            raise ValueError(f"--group-keys: {exc}") from None
    return {"group_hosts": hosts, "group_envs": envs, "group_backend": backend, "ssh_command": args.ssh_command,
            "group_keys": os.path.abspath(args.group_keys) if args.group_keys else "", "rank_keys": args.rank_keys}
