"""A group across hosts (deploy/hosts_flags.py, deploy/group_plan.py): the
hostfile's checks, each group start's plan, and rank 0's lockstep to a rank
of another host over real tcp sockets with CURVE (keys from `tandem keys`):
records arrive, a stranger's key is refused and the rank says it cannot
reach rank 0 by its deadline."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import zmq

from deploy import keys_cmd
from deploy.group_plan import is_remote, local_index, write_group_plan
from deploy.hosts_flags import HostsError, hosts_settings, jaccl_problem, read_hosts
from protos import transport
from protos.group_plan import RankSpec, jaccl_plan, read_plan
from tests.support.server import free_port
from workers.group import lockstep
from workers.group.lockstep import GroupBroken, Recorder, RecordStream
from workers.group.ranks import group_environment

THIS = {"ssh": "localhost", "ips": ["127.0.0.1"]}
OTHER = {"ssh": "mac2", "ips": ["10.0.0.2"]}


def hostfile(tmp_path, data) -> str:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_mlx_launch_hostfiles_are_read_in_both_forms(tmp_path):
    hosts, envs, backend = read_hosts(hostfile(tmp_path, [THIS, OTHER]), 2)
    assert hosts == (("localhost", ("127.0.0.1",), ()), ("mac2", ("10.0.0.2",), ()))
    assert envs == () and backend == ""
    hosts, envs, backend = read_hosts(hostfile(tmp_path, {"backend": "ring", "envs": ["MLX_METAL_FAST_SYNCH=1"],
                                                          "hosts": [THIS, {**OTHER, "rdma": [None]}]}), 2)
    assert [h.ssh for h in hosts] == ["localhost", "mac2"] and envs == ("MLX_METAL_FAST_SYNCH=1",)
    assert backend == "ring"


@pytest.mark.parametrize("data, size, says", [
    ([THIS], 2, "lists 1 hosts for a group of 2 ranks"),
    ([THIS, OTHER, OTHER], 2, "lists 3 hosts for a group of 2 ranks"),
    ([OTHER, THIS], 2, "entry 0 (mac2) must be this host"),
    ([THIS, {"ssh": "mac2"}], 2, 'entry 1 (mac2) has no "ips"'),
    ([THIS, {"ssh": "mac2", "ips": ["mac2.local"]}], 2, "not an IPv4 address"),
    ([THIS, {"ips": ["10.0.0.2"]}], 2, 'entry 1 has no "ssh"'),
    ([THIS, {"ssh": "mac2", "ips": ["10.0.0.2", "10.0.1.2"]}], 2, "every entry needs as many ips"),
    ({"backend": "mpi", "hosts": [THIS, OTHER]}, 2, "backend 'mpi' is not built"),
    # JACCL: mlx.launch's checks of the RDMA devices.
    ({"backend": "jaccl", "hosts": [THIS, OTHER]}, 2, 'needs "rdma" on every entry, one device (or null) per rank'),
    ({"backend": "jaccl", "hosts": [{**THIS, "rdma": ["rdma_en2", "rdma_en3"]}, {**OTHER, "rdma": ["rdma_en2", None]}]},
     2, "own place in its \"rdma\" list must be null"),
    ({"backend": "jaccl", "hosts": [{**THIS, "rdma": [None, None]}, {**OTHER, "rdma": ["rdma_en2", None]}]},
     2, "no RDMA device is listed for localhost to mac2"),
    ({"backend": "jaccl", "hosts": [{**THIS, "rdma": [None, 5]}, {**OTHER, "rdma": ["rdma_en2", None]}]},
     2, '"rdma" must list a device name'),
    ({"hosts": "mac2"}, 2, "expected mlx.launch's hostfile"),
])
def test_a_hostfile_that_cannot_run_the_group_is_refused_saying_why(tmp_path, data, size, says):
    with pytest.raises(HostsError) as err:
        read_hosts(hostfile(tmp_path, data), size)
    assert says in str(err.value)


def jaccl_file(tmp_path, backend="jaccl") -> str:
    """Four Macs on Thunderbolt 5: entry i's rdma[j] reaches rank j."""
    macs = [THIS, OTHER, {"ssh": "mac3", "ips": ["10.0.0.3"]}, {"ssh": "mac4", "ips": ["10.0.0.4"]}]
    return hostfile(tmp_path, {"backend": backend, "hosts": [
        {**m, "rdma": [None if j == i else f"rdma_en{j + 2}" for j in range(4)]} for i, m in enumerate(macs)]})


def test_a_jaccl_hostfile_plans_what_mlx_launch_would_set_and_is_refused_off_a_mac(tmp_path):
    """JACCL (RDMA over Thunderbolt 5) runs between Macs only: everything up
    to MLX's init is checked here (the devices, the plan a group start
    writes, the environment each rank joins with, as mlx.launch sets it:
    MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR, MLX_JACCL_RING); `tandem serve`
    refuses it on this Linux box, and on a Mac whose MLX lacks it."""
    hosts, _, backend = read_hosts(jaccl_file(tmp_path), 4)
    assert backend == "jaccl" and hosts[1].rdma == ("rdma_en2", None, "rdma_en4", "rdma_en5")
    path = str(tmp_path / "g.hosts.json")
    write_group_plan(path, hosts, backend)
    plan = jaccl_plan(path)
    assert plan["coordinator"].startswith("127.0.0.1:") and plan["ring"] is False  # rank 0's first ip
    for rank in (0, 3):
        chosen, env = group_environment(RankSpec("worker-0", rank, 4, path), cuda=False)
        assert chosen == "jaccl" and env["MLX_RANK"] == str(rank) and "MLX_JACCL_RING" not in env
        assert env["MLX_JACCL_COORDINATOR"] == plan["coordinator"]
        assert json.loads(open(env["MLX_IBV_DEVICES"]).read()) == [[None if j == i else f"rdma_en{j + 2}"
                                                                   for j in range(4)] for i in range(4)]
    # jaccl-ring: each Mac needs devices to its two neighbours only.
    ring_file = json.loads(open(jaccl_file(tmp_path, "jaccl-ring")).read())
    ring_file["hosts"][0]["rdma"][2] = None  # 0 and 2 are not neighbours in a ring of 4
    hosts, _, backend = read_hosts(hostfile(tmp_path, ring_file), 4)
    write_group_plan(path, hosts, backend)
    assert group_environment(RankSpec("worker-0", 1, 4, path), cuda=True)[1]["MLX_JACCL_RING"] == "1"
    # A plan without JACCL: ring, or NCCL on CUDA, as before.
    write_group_plan(path, hosts[:2])
    assert [group_environment(RankSpec("worker-0", 0, 2, path), cuda)[0] for cuda in (False, True)] == ["ring", "nccl"]
    with pytest.raises(ValueError, match="runs between Macs only .* and this host is linux"):
        jaccl_problem("jaccl", "linux")
    with pytest.raises(ValueError, match="has no JACCL"):  # this MLX (Linux's) has none: as an old Mac's
        jaccl_problem("jaccl", "darwin")
    args = argparse.Namespace(hosts=jaccl_file(tmp_path), ssh_command="ssh", group_keys="", rank_keys="")
    with pytest.raises(ValueError, match="JACCL"):
        hosts_settings(args, 4)


def test_serve_flags_refuse_hosts_without_a_group_or_without_keys(tmp_path):
    path = hostfile(tmp_path, [THIS, {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}])
    args = argparse.Namespace(hosts=path, ssh_command="ssh", group_keys="", rank_keys="")
    with pytest.raises(ValueError, match="give --tensor-parallel N"):
        hosts_settings(args, 1)
    with pytest.raises(ValueError, match="needs --group-keys DIR and --rank-keys DIR"):
        hosts_settings(args, 2)
    with pytest.raises(ValueError, match="give --hosts FILE"):
        hosts_settings(argparse.Namespace(hosts=None, ssh_command="ssh", group_keys="k", rank_keys=""), 2)
    # Every rank on this host (one ssh name): no ssh, no tcp, no keys needed.
    local = hostfile(tmp_path, [THIS, THIS])
    fields = hosts_settings(argparse.Namespace(hosts=local, ssh_command="ssh", group_keys="", rank_keys=""), 2)
    assert not any(is_remote(fields["group_hosts"], r) for r in range(2))


def test_each_start_plans_the_ring_from_the_ips_and_tcp_lockstep_for_other_hosts(tmp_path):
    hosts = (("localhost", ("127.0.0.1",)), ("localhost", ("127.0.0.1",)), ("mac2", ("10.0.0.2",)))
    path = str(tmp_path / "g.hosts.json")
    write_group_plan(path, hosts)
    ring = json.loads(open(path).read())
    assert [node[0].split(":")[0] for node in ring] == ["127.0.0.1", "127.0.0.1", "10.0.0.2"]
    assert len({node[0] for node in ring}) == 3
    plan = read_plan(path)
    assert list(plan) == [2] and plan[2].startswith("tcp://127.0.0.1:")  # rank 0's address, for rank 2 alone
    assert [local_index(hosts, r) for r in range(3)] == [0, 1, 0]  # rank 2 is its host's first (its GPU 0)
    write_group_plan(path, hosts)
    assert json.loads(open(path).read()) != ring  # fresh ports at every start


@pytest.fixture
def keys(tmp_path):
    for out, name in (("ours", "mac2"), ("theirs", "stranger")):
        assert keys_cmd.run(argparse.Namespace(out=str(tmp_path / out), name=[name], force=False)) == 0
    return tmp_path


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def test_records_go_to_another_host_over_tcp_with_curve(ctx, keys):
    address = f"tcp://127.0.0.1:{free_port()}"
    recorder = Recorder(ctx, [address], beat_s=0.05, keys=transport.router_keys(str(keys / "ours" / "router")))
    other = zmq.Context()  # the follower's process, as it were
    stream = RecordStream(other, address, transport.worker_keys(str(keys / "ours" / "mac2")))
    try:
        recorder.unit("prefill")  # waits (within its deadline) for the follower's CURVE handshake
        assert stream.next(10.0) == [("u", "prefill", False)]
        assert stream.connected
        assert recorder.socks[0].getsockopt(zmq.CURVE_SERVER) == 1
    finally:
        recorder.close()
        stream.close()
        other.destroy(linger=0)


def test_a_rank_with_a_key_rank_0_does_not_know_stops_saying_so(ctx, keys, monkeypatch):
    monkeypatch.setattr(lockstep, "CONNECT_DEADLINE_S", 1.0)
    address = f"tcp://127.0.0.1:{free_port()}"
    recorder = Recorder(ctx, [address], beat_s=0.05, keys=transport.router_keys(str(keys / "ours" / "router")))
    other = zmq.Context()
    stream = RecordStream(other, address, transport.worker_keys(str(keys / "theirs" / "stranger")))
    try:
        with pytest.raises(GroupBroken, match="cannot reach rank 0's lockstep at tcp://127.0.0.1:.*within 1 s"):
            stream.next(30.0)
    finally:
        stream.close()
        recorder.close()
        other.destroy(linger=0)


def test_a_tcp_follower_without_keys_is_refused_at_once(ctx):
    with pytest.raises(ValueError, match="CURVE keys"):
        Recorder(ctx, [f"tcp://127.0.0.1:{free_port()}"], beat_s=0.05)


def test_a_rank_whose_settings_never_come_exits_saying_so():
    """`tandem rank` (started over ssh) with its stdin closed at once: exit 2, a clear line."""
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "rank"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no usable settings from rank 0's side" in done.stderr, done.stderr
