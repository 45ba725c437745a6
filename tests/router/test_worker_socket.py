"""The router's worker socket with --worker-listen (router/worker_socket.py):
ipc stays plain, tcp takes only CURVE clients whose keys are in --worker-keys;
and routing by kv_host (router/worker_table.py): a prompt's KV never goes to
a decode worker of another host. Real ZeroMQ sockets, scripted workers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import pytest
import zmq

from deploy import keys_cmd
from protos import transport
from router import worker_socket
from protos.messages import DecodeRequest, KVHandoff, PrefillDone, PrefillRequest, TokenBatch, TokenUpdate, WorkerHello
from tests.support.dispatcher import request, run, wait_for
from tests.support.server import free_port


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two key sets: ours (router + workers "w1") and another router's ("stranger")."""
    base = tmp_path_factory.mktemp("keys")
    assert keys_cmd.run(argparse.Namespace(out=str(base / "ours"), name=["w1"], force=False)) == 0
    assert keys_cmd.run(argparse.Namespace(out=str(base / "theirs"), name=["stranger"], force=False)) == 0
    return base


class TcpWorker:
    """A colocated worker's heartbeat over tcp, CURVE when `curve` (a worker's keys) is given."""

    def __init__(self, ctx, address, wid, curve=None):
        self.hello = WorkerHello(wid, ["prefill", "decode"], pid=4242, state="ready", kv_host="far")
        self.sock = transport.make_socket(ctx, zmq.DEALER, identity=wid)
        if curve is not None:
            transport.curve_client(self.sock, *curve)
        self.sock.connect(address)

    def beat(self):
        try:  # a DEALER whose handshake failed has no peer: a send would wait for ever
            transport.send(self.sock, self.hello, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass


def test_ipc_stays_plain_and_tcp_takes_only_known_curve_keys(keys, caplog):
    address = f"tcp://127.0.0.1:{free_port()}"
    ours, theirs = str(keys / "ours"), str(keys / "theirs")
    good = transport.worker_keys(os.path.join(ours, "w1"))
    stranger = transport.worker_keys(os.path.join(theirs, "stranger"))
    unknown = (*stranger[:2], good[2])  # the right router, a key not in its --worker-keys
    wrong_router = (*good[:2], stranger[2])  # a known key, but another router's public key

    async def body(disp, worker):
        ctx = zmq.Context()  # not the dispatcher's: its end must not wait for these
        try:
            await check(ctx, disp, worker)
        finally:
            ctx.destroy(linger=0)

    async def check(ctx, disp, worker):
        local = worker("worker-0", ["prefill", "decode"])  # ipc, no keys: as every local worker
        peers = [TcpWorker(ctx, address, "remote-good", good), TcpWorker(ctx, address, "remote-plain"),
                 TcpWorker(ctx, address, "remote-unknown", unknown),
                 TcpWorker(ctx, address, "remote-wrong-router", wrong_router)]
        for _ in range(20):  # heartbeats for a second: the good one joins well within it
            await local.beat()
            for p in peers:
                p.beat()
            await asyncio.sleep(0.05)
        await wait_for(lambda: {"worker-0", "remote-good"} <= set(disp.workers))
        assert set(disp.workers) == {"worker-0", "remote-good"}
        assert disp.workers["remote-good"].hello.kv_host == "far"
        assert disp._key_check.refused >= 1  # the unknown key; the others never got as far as the check

    with caplog.at_level(logging.WARNING, logger="router.dispatcher"):
        run(body, worker_listen=address, worker_keys=os.path.join(ours, "router"))
    refusals = [r.getMessage() for r in caplog.records if "refused a remote worker" in r.getMessage()]
    stranger_key = transport.worker_keys(os.path.join(theirs, "stranger"))[0].decode()
    assert len(refusals) == 1 and stranger_key in refusals[0], refusals  # logged once per key


def test_without_worker_listen_there_is_no_tcp_endpoint_and_no_key_check():
    async def body(disp, worker):
        assert disp._key_check is None
        assert disp._sock.getsockopt(zmq.LAST_ENDPOINT).startswith(b"ipc://")
        assert disp._sock.getsockopt(zmq.CURVE_SERVER) == 0

    run(body)


def test_a_prompts_kv_goes_to_a_decode_worker_of_its_own_host():
    async def body(disp, worker):
        pre, near = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        far = worker("decode-far", ["decode"])
        far.hello.kv_host = "far"
        near.hello.running = 5  # busier: load alone would pick the far one
        for w in (pre, near, far):
            await w.beat()
        await wait_for(lambda: len(disp.workers) == 3)

        async def play():
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and msg.decode_worker == ""
            await transport.asend(pre.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3)))
            msg = await near.next()
            assert isinstance(msg, DecodeRequest)
            await transport.asend(near.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        player = asyncio.create_task(play())
        assert [e.token async for e in disp.generate(request())] == [7, 9]
        await player
        assert await far.silent_for(0.1)

    run(body)


def test_a_remote_colocated_worker_decodes_what_it_prefills_in_a_split_router():
    async def body(disp, worker):
        remote = worker("remote-h-0", ["prefill", "decode"])
        remote.hello.kv_host = "h"
        await remote.beat()
        await wait_for(lambda: len(disp.workers) == 1)

        async def play():
            msg = await remote.next()
            assert isinstance(msg, PrefillRequest) and msg.decode_worker == "remote-h-0"  # KV kept in the process
            await transport.asend(remote.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3, local=True)))
            assert isinstance(await remote.next(), DecodeRequest)
            await transport.asend(remote.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        player = asyncio.create_task(play())
        assert [e.token async for e in disp.generate(request())] == [7, 9]
        await player

    run(body)  # settings.colocate is False: the router's own workers would be split


def test_a_worker_of_another_model_is_refused(caplog):
    async def body(disp, worker):
        w = worker("remote-h-0", ["prefill", "decode"])
        w.hello.model_id, w.hello.kv_host = "another-model", "h"
        for _ in range(3):
            await w.beat()
        ok = worker("worker-0", ["prefill", "decode"])
        await ok.beat()
        await wait_for(lambda: "worker-0" in disp.workers)
        assert "remote-h-0" not in disp.workers

    with caplog.at_level(logging.ERROR, logger="router.dispatcher"):
        run(body)
    assert sum("serves 'another-model'" in r.getMessage() for r in caplog.records) == 1  # once, not per hello


def test_a_split_prefill_worker_whose_host_has_no_decoder_is_passed_over_for_a_remote_colocated_one():
    async def body(disp, worker):
        pre, remote = worker("prefill-0", ["prefill"]), worker("remote-h-0", ["prefill", "decode"])
        remote.hello.kv_host = "h"
        remote.hello.running = 3  # busier: load alone would pick the split one, whose KV could go nowhere
        for w in (pre, remote):
            await w.beat()
        await wait_for(lambda: len(disp.workers) == 2)

        async def play():
            msg = await remote.next()
            assert isinstance(msg, PrefillRequest) and msg.decode_worker == "remote-h-0"
            await transport.asend(remote.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3, local=True),
                                                           finish_reason="length"))

        player = asyncio.create_task(play())
        assert [e.token async for e in disp.generate(request())] == [7]
        await player
        assert await pre.silent_for(0.1)

    run(body)


def test_a_tcp_worker_cannot_speak_as_a_local_worker(keys, caplog):
    """An allowed key is a worker on another host, not one of this host's: a
    tcp peer calling itself "decode-0" would take over that worker's id and
    its requests, and one saying its KV is on this host would be handed KV
    it cannot read. Their messages are dropped (and logged once each)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    ours = str(keys / "ours")
    good = transport.worker_keys(os.path.join(ours, "w1"))
    worker_socket._spoofs_logged.clear()  # logged once a minute per name: this test wants each logged

    async def body(disp, worker):
        ctx = zmq.Context()
        try:
            local = worker("decode-0", ["decode"])
            # Allowed key, a local worker's kind of name (not one in use here: ZeroMQ's handover of a
            # routing id in use is a race between the two peers, not what this test is about).
            spoof = TcpWorker(ctx, address, "decode-1", good)
            spoof.hello.pid = 9999
            here = TcpWorker(ctx, address, "remote-here", good)
            here.hello.kv_host = ""  # claims this host's arena
            honest = TcpWorker(ctx, address, "remote-good", good)
            def settled():  # the honest one joined, both impostors heard and ignored
                said = caplog.text
                return ({"decode-0", "remote-good"} <= set(disp.workers) and "ignored worker 'decode-1'" in said
                        and "ignored worker 'remote-here'" in said)

            for _ in range(200):  # beats (each peer's CURVE handshake takes its own time) until settled
                await local.beat()
                for p in (spoof, here, honest):
                    p.beat()
                await asyncio.sleep(0.05)
                if settled():
                    break
            assert set(disp.workers) == {"decode-0", "remote-good"}
            assert all(w.hello.pid != 9999 for w in disp.workers.values())
        finally:
            ctx.destroy(linger=0)

    with caplog.at_level(logging.WARNING, logger="router.dispatcher"):
        run(body, worker_listen=address, worker_keys=os.path.join(ours, "router"))
    said = caplog.text
    assert "ignored worker 'decode-1' (key 'w1')" in said
    assert "ignored worker 'remote-here' (key 'w1')" in said


def test_remote_workers_add_their_decode_rows_to_admission(keys):
    """A remote worker's decode batch is room this host's settings do not
    count: admission grows by its rows while it is ready, and shrinks back
    when it goes."""
    from router.admission import Admission

    address = f"tcp://127.0.0.1:{free_port()}"
    good = transport.worker_keys(os.path.join(str(keys / "ours"), "w1"))

    async def body(disp, worker):
        admission = Admission(2, timeout_s=5)
        admission.remote_rows = disp.table.remote_rows
        ctx = zmq.Context()
        try:
            remote = TcpWorker(ctx, address, "remote-good", good)
            remote.hello.max_batch = 3
            local = worker("decode-0", ["decode"])
            for _ in range(60):
                await local.beat()
                remote.beat()
                await asyncio.sleep(0.05)
                if disp.table.remote_rows():
                    break
            assert disp.table.remote_rows() == 3  # the local decode worker's rows are not "remote"
            tickets = [admission.admit(10) for _ in range(5)]  # 2 of this host's + 3 of the remote's
            with pytest.raises(Exception) as refused:
                admission.admit(10)
            assert getattr(refused.value, "status", None) == 429
            for t in tickets:
                t.release()
            disp.table.drop("remote-good")
            assert disp.table.remote_rows() == 0
        finally:
            ctx.destroy(linger=0)

    run(body, worker_listen=address, worker_keys=os.path.join(str(keys / "ours"), "router"))
