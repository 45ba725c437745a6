"""`tandem rank`: one rank of a worker group on a host other than rank 0's,
started there over ssh by rank 0's supervisor (deploy/remote_rank.py); not
a command for people to run.

It reads its one JSON line (settings, its place in the group, the ring
hostfile, rank 0's lockstep address) from stdin within STDIN_DEADLINE_S,
makes a run dir of its own, writes the hostfile and the group's plan there,
and runs as any follower (workers/group/main.py). Its stdin's end means the
ssh session is gone (rank 0's side stopped or died): it stops. Once the
rank has run, the process ends at once after removing its run dir
(workers/group/main.py `end`: no MLX teardown waiting on other ranks), so
the ssh client here, and with it rank 0's supervisor, sees the rank's end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import sys
import tempfile
import threading
import time

from environment.logs import setup_logging
from environment.settings import Settings
from protos.group_plan import RankSpec, plan_path, write_plan, write_ring
from protos.transport import KeysError, worker_keys
from workers.group.ranks import JOIN_DEADLINE_S

log = logging.getLogger(__name__)

STDIN_DEADLINE_S = 30.0
STOP_GRACE_S = 5.0  # after the SIGTERM its stdin's end sends, before it exits regardless


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(run=run)


def read_line(fd: int, deadline_s: float) -> bytes:
    """One line from `fd` within `deadline_s`; raises TimeoutError or EOFError."""
    data, deadline = b"", time.monotonic() + deadline_s
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"nothing on stdin within {deadline_s:.0f} s")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError("stdin ended before the rank's settings")
        data += chunk
    return data.split(b"\n", 1)[0]


def watch_stdin(fd: int) -> None:
    """Stop this process when `fd` ends: the ssh session that started it is gone."""
    while os.read(fd, 1 << 16):
        pass
    log.warning("rank 0's side is gone (stdin ended): stopping")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(STOP_GRACE_S)
    os._exit(1)


def settings_from(fields: dict, run_dir: str) -> Settings:
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"settings this host's Tandem does not know ({', '.join(unknown)}): "
                         "install the same version as rank 0's host")
    return Settings(**{**fields, "run_dir": run_dir})  # TypeError: a field of the wrong kind


def _fail(message: str) -> int:
    log.error("tandem rank: %s", message)
    return 2


def run(args: argparse.Namespace) -> int:
    setup_logging("info", "rank")
    fd = sys.stdin.fileno()
    try:
        body = json.loads(read_line(fd, STDIN_DEADLINE_S))
        settings = settings_from(body["settings"], "")
        group, rank, size = body["group"], int(body["rank"]), int(body["size"])
    except (TimeoutError, EOFError, ValueError, KeyError, TypeError) as exc:
        return _fail(f"no usable settings from rank 0's side: {exc}")
    run_dir = tempfile.mkdtemp(prefix="tandem-rank-")
    ran = False
    code = 1
    try:
        spec = RankSpec(group, rank, size, os.path.join(run_dir, "group.hosts.json"))
        code, ran = _run_rank(dataclasses.replace(settings, run_dir=run_dir), body, spec, fd)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if ran:
            from workers.group.main import end

            end(code)
    return code


def _run_rank(settings: Settings, body: dict, spec: RankSpec, fd: int) -> tuple[int, bool]:
    """(exit code, whether the rank ran: joined MLX's group, so its process must `end`)."""
    try:
        worker_keys(settings.rank_keys)
    except KeysError as exc:
        return _fail(f"--rank-keys on this host: {exc}"), False
    if not os.path.isdir(settings.model_dir):
        return _fail(f"no model folder at {settings.model_dir} on this host "
                     "(every host needs it at rank 0's path)"), False
    write_ring(spec.hostfile, body["ring"])
    write_plan(plan_path(spec.hostfile), {str(spec.rank): body["lockstep"]}, body.get("jaccl"))
    threading.Thread(target=watch_stdin, args=(fd,), daemon=True, name="stdin-watch").start()
    log.info("tandem rank %s (pid %d): joining rank 0 at %s within %d s, then following it over %s", spec.name,
             os.getpid(), body["ring"][0][0], JOIN_DEADLINE_S, body["lockstep"])
    from workers.group.main import serve as serve_rank

    try:
        return serve_rank(settings, body["roles"], spec), True
    except SystemExit as exc:
        return (exc.code if isinstance(exc.code, int) else 1), True
    except BaseException:  # noqa: BLE001 - logged; the process must still end
        log.exception("tandem rank %s failed", spec.name)
        return 1, True
