"""`tandem serve`'s flags for a worker group across hosts (--hosts FILE,
workers/group/hosts.py), checked before anything starts."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from environment.settings import Settings
from protos.transport import KeysError, router_keys
from workers.group.hosts import HostsError, is_remote, read_hosts


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
