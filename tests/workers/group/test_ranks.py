"""A group's ranks set up without mlx.launch (deploy/group_plan.py,
workers/group/ranks.py): the hostfile the supervisor writes, the names, and a rank whose peers never
come exiting instead of waiting for ever."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

from deploy.group_plan import rank_environment, write_hostfile
from protos.group_plan import RankSpec, rank_names


def test_hostfile_gives_each_rank_its_own_loopback_port(tmp_path):
    path = tmp_path / "g.hosts.json"
    write_hostfile(str(path), 3)
    hosts = json.loads(path.read_text())
    assert len(hosts) == 3 and all(len(h) == 1 and h[0].startswith("127.0.0.1:") for h in hosts)
    assert len({h[0] for h in hosts}) == 3


def test_rank_0_takes_the_group_name_the_router_knows():
    assert rank_names("worker-0", 3) == ["worker-0", "worker-0.r1", "worker-0.r2"]
    assert RankSpec("worker-1", 1, 2, "h").name == "worker-1.r1"


def test_a_rank_whose_peer_never_comes_exits(tmp_path):
    hostfile = tmp_path / "g.hosts.json"
    write_hostfile(str(hostfile), 2)
    script = textwrap.dedent(f"""
        from protos.group_plan import RankSpec
        from workers.group.ranks import join_group
        join_group(RankSpec("g", 0, 2, {str(hostfile)!r}), deadline_s=1)
        print("joined")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "joined" not in done.stdout
    assert done.returncode == -signal.SIGALRM, done.stderr  # the deadline (ring itself still retried after 60 s)


def test_each_rank_sees_its_own_gpu_alone():
    """On CUDA a rank must see one GPU before MLX loads (mlx-lm makes a stream
    on the first visible GPU at import): the r-th of those the server may use."""
    assert rank_environment(0, {}) == {"CUDA_VISIBLE_DEVICES": "0"}
    assert rank_environment(1, {}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert rank_environment(1, {"CUDA_VISIBLE_DEVICES": "2,3"}) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert rank_environment(2, {"CUDA_VISIBLE_DEVICES": "2, 3"}) == {"CUDA_VISIBLE_DEVICES": "2"}


def test_a_unit_past_its_deadline_ends_the_process_and_one_within_it_does_not():
    """A collective that never returns cannot be interrupted from Python: the
    unit's deadline ends the process (the supervisor restarts the group)."""
    script = textwrap.dedent("""
        import time
        from workers.group.ranks import unit_deadline
        with unit_deadline(2):
            time.sleep(0.1)
        print("quick unit done", flush=True)
        with unit_deadline(1):
            time.sleep(30)  # stands for a rank waiting on a stuck peer
        print("never")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "quick unit done" in done.stdout and "never" not in done.stdout
    assert done.returncode == -signal.SIGALRM, done.stderr
