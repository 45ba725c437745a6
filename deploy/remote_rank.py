"""A group's rank on another host, as the supervisor's child (`tandem serve
--hosts FILE`, deploy/hosts_flags.py): this process starts the rank there
over --ssh-command, as mlx.launch does, and lives exactly as long as the ssh
client, so the rank's death (or its host's, or the link's) is this child's
exit, and the supervisor restarts the group as for a rank on this host.

The rank runs `python -m deploy.cli rank` (deploy/rank_cmd.py) with the same
interpreter path, in the same folder if it exists there, and reads the
model from the same path: the same install on every host, as mlx.launch
assumes. What it needs (settings, its place in the group, the ring hostfile,
rank 0's lockstep address, a JACCL group's plan) goes as one JSON line on the ssh client's stdin,
not on a command line another user of that host could read; stdin then
stays open, and its end tells the rank that this side is gone.

A rank there has no cache service, so it runs without a prefix cache, and
with it the whole group (workers/group/prefix_agreement.py `group_prefix`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys

from environment.logs import setup_logging
from deploy.group_plan import local_index
from environment.settings import Settings
from protos.group_plan import RankSpec, jaccl_plan, read_plan, read_ring

log = logging.getLogger(__name__)


def rank_settings(settings: Settings) -> dict:
    """The settings a rank on another host gets, as JSON: no API keys (they
    never leave this host), none of this host's files (disk tier, test
    hooks); its run dir is made there. Its prefix cache is dropped there
    (workers/parts.py `prefix_here`: no cache service on its host)."""
    remote = dataclasses.replace(settings, api_keys=(), cache_dir=None, run_dir="", arena_name="",
                                 memory_pressure_file=None, power_state_file=None, group_keys="",
                                 slow_step_dir=None)
    return dataclasses.asdict(remote)


def payload(settings: Settings, roles: list[str], spec: RankSpec) -> bytes:
    ring = read_ring(spec.hostfile)
    lockstep, jaccl = read_plan(spec.hostfile)[spec.rank], jaccl_plan(spec.hostfile)
    body = {"settings": rank_settings(settings), "roles": list(roles), "group": spec.group, "rank": spec.rank,
            "size": spec.size, "ring": ring, "lockstep": lockstep, "jaccl": jaccl}
    return (json.dumps(body) + "\n").encode()


def remote_command(settings: Settings, rank: int) -> str:
    """The shell command the ssh client runs on the rank's host."""
    env = [f"CUDA_VISIBLE_DEVICES={local_index(settings.group_hosts, rank)}", *settings.group_envs]
    exports = " ".join(shlex.quote(e) for e in env if e.split("=", 1)[0].isidentifier())
    cwd = shlex.quote(os.getcwd())
    return (f"if [ -d {cwd} ]; then cd {cwd}; fi; "
            f"export {exports}; exec {shlex.quote(sys.executable)} -m deploy.cli rank")


def ssh_argv(settings: Settings, rank: int) -> list[str]:
    host = settings.group_hosts[rank][0]
    return [*shlex.split(settings.ssh_command), host, remote_command(settings, rank)]


def run(settings: Settings, roles: list[str], spec: RankSpec) -> None:
    """Process main (a `spawn` target): start rank `spec.rank` on its host, wait for its end."""
    setup_logging(settings.log_level, f"ssh:{spec.name}")
    argv = ssh_argv(settings, spec.rank)
    log.info("starting rank %d of %s on %s: %s", spec.rank, spec.group, argv[-2], shlex.join(argv[:-1]))
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE)

    def on_signal(signum, _frame):  # the ssh client's end closes the rank's stdin there: it stops
        if proc.poll() is None:
            proc.terminate()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        proc.stdin.write(payload(settings, roles, spec))
        proc.stdin.flush()
    except (BrokenPipeError, OSError) as exc:
        log.error("could not hand rank %d its settings over %s: %s", spec.rank, argv[0], exc)
    code = proc.wait()
    log.log(logging.INFO if code == 0 else logging.WARNING, "rank %d of %s on %s ended (%s exited with code %s)",
            spec.rank, spec.group, argv[-2], argv[0], code)
    raise SystemExit(code if code >= 0 else 1)  # negative: the ssh client itself was killed
