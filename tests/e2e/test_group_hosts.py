"""`tandem serve --colocate --tensor-parallel 2 --hosts FILE`: a group whose
rank 1 is on "another host", started over --ssh-command as mlx.launch does.

A real ssh to another host cannot run on this box (one machine, no sshd, no
second host): the ssh command is a shim that runs the command on this
machine (logging the host it was asked for), and both hosts' ips are
127.0.0.1 ("localhost" for rank 0, "127.0.0.1" for rank 1: another name,
so another host to Tandem). Everything past ssh is as between two hosts:
rank 1 runs `tandem rank` with its settings on stdin, its own run dir and
no cache service (so the group runs without a prefix cache), meets rank 0
over MLX's ring on the file's ips, and follows rank 0's records over tcp
with CURVE (keys from `tandem keys`). A tiny float32 random qwen3 gives
in-process mlx-lm's greedy tokens; rank 1's process killed mid-stream
restarts the group and the stream goes on. Hostfiles that cannot run are
refused before anything starts. Every wait has a deadline."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from deploy import keys_cmd
from tests.support.groups import PROMPTS, ask, ask_all_at_once, one_process, random_model, stream
from tests.support.server import module_server, pid_alive

# ssh HOST COMMAND, run on this machine (no second host here), the host logged. Not
# exec'd: like ssh, the client is a process of its own, which ends when the rank does.
SHIM = """#!/bin/sh
echo "$1" >> "{calls}"
shift
/bin/sh -c "$*"
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("hosts")
    assert keys_cmd.run(argparse.Namespace(out=str(base / "keys"), name=["mac2"], force=False)) == 0
    (base / "hosts.json").write_text(json.dumps([{"ssh": "localhost", "ips": ["127.0.0.1"]},
                                                 {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}]))
    shim = base / "ssh-shim"
    shim.write_text(SHIM.format(calls=base / "ssh-calls"))
    shim.chmod(0o755)
    return base


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, embedded_model_dir):
    """The session's float32 random tiny-qwen3 (tests/e2e/test_tensor_parallel.py serves it too)."""
    return random_model(tmp_path_factory, "tiny-qwen3", embedded_model_dir)


@pytest.fixture(scope="module")
def group(request, tmp_path_factory, setup, qwen3):
    return module_server(request, tmp_path_factory, "--model", str(qwen3), "--colocate",
                         "--no-disk-cache", "--tensor-parallel", "2", "--tensor-parallel-timeout", "6",
                         "--hosts", str(setup / "hosts.json"), "--ssh-command", str(setup / "ssh-shim"),
                         "--group-keys", str(setup / "keys" / "router"), "--rank-keys", str(setup / "keys" / "mac2"))


def remote_pids(srv) -> list[int]:
    """The pids of rank 1's `tandem rank` processes, oldest first."""
    return [int(p) for p in re.findall(r"tandem rank worker-0\.r1 \(pid (\d+)\)", srv.log_path.read_text())]


def test_a_rank_on_another_host_gives_one_process_greedy_tokens(group, setup, qwen3):
    expected = one_process(str(qwen3))
    assert ask_all_at_once(group) == expected
    log = group.log_path.read_text()
    assert (setup / "ssh-calls").read_text().split() == ["127.0.0.1"]  # rank 1 alone went over "ssh"
    assert len(remote_pids(group)) == 1 and pid_alive(remote_pids(group)[0])
    assert re.search(r"lockstep records to tcp://127\.0\.0\.1:\d+ over tcp with CURVE", log)
    assert re.search(r"following rank 0 over tcp://127\.0\.0\.1:\d+ \(CURVE handshake done\)", log)
    # rank 1 has no cache service on its host: the group runs without a prefix cache
    assert "prefix caching off: another rank of the group has none" in log
    assert len(group.health()[1]["workers"]) == 1


def test_killing_the_remote_rank_restarts_the_group_and_the_stream_goes_on(group):
    expected, _ = ask(group, PROMPTS[0], 60)
    leader, remote = group.worker_pid("prefill+decode"), remote_pids(group)[-1]
    pieces = stream(group, PROMPTS[0], 60)
    got = [next(pieces) for _ in range(3)]
    os.kill(remote, signal.SIGKILL)
    got += list(pieces)
    assert "".join(got) == expected
    group.wait_healthy(timeout=90)
    assert not pid_alive(leader) and not pid_alive(remote)
    assert "restarting group worker-0" in group.log_path.read_text()
    assert len(remote_pids(group)) == 2 and pid_alive(remote_pids(group)[-1])
    assert ask(group, PROMPTS[1], 9)[1] == 9


def test_hostfiles_that_cannot_run_are_refused_before_anything_starts(qwen3, tmp_path):
    this, other = {"ssh": "localhost", "ips": ["127.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}
    cases = {"three.json": ([this, other, other], "lists 3 hosts for a group of 2 ranks"),
             "first.json": ([other, this], "entry 0 (mac2) must be this host")}
    procs = {}
    for name, (data, _) in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "--port", "1", "--model", str(qwen3),
             "--colocate", "--tensor-parallel", "2", "--hosts", str(tmp_path / name)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and cases[name][1] in err and "Traceback" not in err, (name, err)
