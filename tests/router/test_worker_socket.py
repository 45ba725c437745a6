"""The router's worker socket with --worker-listen (router/routing/worker_socket.py):
ipc stays plain, tcp takes only CURVE clients whose keys are in --worker-keys;
and routing by kv_host (router/routing/worker_table.py): a prompt's KV never goes to
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
from router.routing import worker_socket
from protos.messages import Cancel, DecodeRequest, KVHandoff, PrefillDone, PrefillRequest, TokenBatch, TokenUpdate, WorkerHello
from tests.support.dispatcher import request, run, wait_for
from tests.support.server import free_port


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Two key sets: ours (router + workers "w1", "w2") and another router's ("stranger")."""
    base = tmp_path_factory.mktemp("keys")
    assert keys_cmd.run(argparse.Namespace(out=str(base / "ours"), name=["w1", "w2"], force=False)) == 0
    assert keys_cmd.run(argparse.Namespace(out=str(base / "theirs"), name=["stranger"], force=False)) == 0
    return base


class TcpWorker:
    """A colocated worker's heartbeat over tcp, CURVE when `curve` (a worker's
    keys) is given; ZeroMQ picks its routing id, as for workers/socket_loop.py's,
    unless `identity` names one."""

    def __init__(self, ctx, address, wid, curve=None, identity=None):
        self.hello = WorkerHello(wid, ["prefill", "decode"], pid=4242, state="ready", kv_host="far")
        self.sock = transport.make_socket(ctx, zmq.DEALER, identity=identity)
        if curve is not None:
            transport.curve_client(self.sock, *curve)
        self.sock.connect(address)

    def beat(self):
        try:  # a DEALER whose handshake failed has no peer: a send would wait for ever
            transport.send(self.sock, self.hello, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def received(self, timeout_s=5.0):
        """The next message from the router, or None within `timeout_s`."""
        return transport.recv(self.sock) if self.sock.poll(int(timeout_s * 1000)) else None


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
        assert disp._socks.key_check.refused >= 1  # the unknown key; the others never got as far as the check

    with caplog.at_level(logging.WARNING, logger="router.routing.dispatcher"):
        run(body, worker_listen=address, worker_keys=os.path.join(ours, "router"))
    refusals = [r.getMessage() for r in caplog.records if "refused a remote worker" in r.getMessage()]
    stranger_key = transport.worker_keys(os.path.join(theirs, "stranger"))[0].decode()
    assert len(refusals) == 1 and stranger_key in refusals[0], refusals  # logged once per key


def test_without_worker_listen_there_is_no_tcp_endpoint_and_no_key_check():
    async def body(disp, worker):
        assert disp._socks.key_check is None and disp._socks.remote is None
        assert disp._socks.local.getsockopt(zmq.LAST_ENDPOINT).startswith(b"ipc://")
        assert disp._socks.local.getsockopt(zmq.CURVE_SERVER) == 0

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

    with caplog.at_level(logging.ERROR, logger="router.routing.dispatcher"):
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
    tcp peer calling itself "decode-0" (the id of a live local worker) must
    not take that worker's id, nor its pipe: what the router sends decode-0
    still reaches this host's decode-0. One saying its KV is on this host
    would be handed KV it cannot read. Their messages are dropped (and
    logged once each)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    ours = str(keys / "ours")
    good = transport.worker_keys(os.path.join(ours, "w1"))
    worker_socket._spoofs_logged.clear()  # logged once a minute per name: this test wants each logged

    async def body(disp, worker):
        ctx = zmq.Context()
        try:
            local = worker("decode-0", ["decode"])
            spoof = TcpWorker(ctx, address, "decode-0", good, identity="decode-0")  # a live local worker's id
            spoof.hello.pid = 9999
            here = TcpWorker(ctx, address, "remote-here", good)
            here.hello.kv_host = ""  # claims this host's arena
            honest = TcpWorker(ctx, address, "remote-good", good)
            def settled():  # the honest one joined, both impostors heard and ignored
                said = caplog.text
                return ({"decode-0", "remote-good"} <= set(disp.workers) and "ignored worker 'decode-0'" in said
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
            for i in range(3):  # the impostor was heard (its pipe is up): decode-0's pipe is still the local one's
                assert await disp._send("decode-0", Cancel(f"r{i}"))
                assert await local.next() == Cancel(f"r{i}")
                spoof.beat()
                await asyncio.sleep(0.05)
        finally:
            ctx.destroy(linger=0)

    with caplog.at_level(logging.WARNING, logger="router.routing.dispatcher"):
        run(body, worker_listen=address, worker_keys=os.path.join(ours, "router"))
    said = caplog.text
    assert "ignored worker 'decode-0' (key 'w1')" in said
    assert "ignored worker 'remote-here' (key 'w1')" in said


def test_remote_workers_add_their_decode_rows_to_admission(keys):
    """A remote worker's decode batch is room this host's settings do not
    count: admission grows by its rows while it is ready, and shrinks back
    when it goes."""
    from router.guards.admission import Admission

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


def test_a_remote_name_belongs_to_the_key_that_said_it_first(keys, caplog):
    """Over tcp a worker is known by its hello's name, bound to its key: a
    peer with another allowed key saying that name is ignored and what the
    router sends that name still reaches its worker; a new connection with
    the same key (the worker restarted) takes the name over at once."""
    address = f"tcp://127.0.0.1:{free_port()}"
    ours = str(keys / "ours")
    w1, w2 = (transport.worker_keys(os.path.join(ours, n)) for n in ("w1", "w2"))
    worker_socket._spoofs_logged.clear()

    async def beat_until(peers, done):
        for _ in range(200):
            for p in peers:
                p.beat()
            await asyncio.sleep(0.05)
            if done():
                return
        raise AssertionError("not settled in 10 s")

    async def body(disp, worker):
        ctx = zmq.Context()
        try:
            first = TcpWorker(ctx, address, "remote-a-0", w1)
            first.hello.pid = 1
            await beat_until([first], lambda: "remote-a-0" in disp.workers)
            thief = TcpWorker(ctx, address, "remote-a-0", w2)
            thief.hello.pid = 2
            await beat_until([first, thief], lambda: "belongs to key 'w1'" in caplog.text)
            assert disp.workers["remote-a-0"].hello.pid == 1
            assert await disp._send("remote-a-0", Cancel("r1"))
            seen = first.received()
            while seen is not None and not isinstance(seen, Cancel):  # WorkerLimits come first
                seen = first.received()
            assert seen == Cancel("r1")
            assert thief.received(0.2) is None  # never heard as a worker: sent nothing at all

            first.sock.close(linger=0)  # the worker died; its restart connects anew, same key
            again = TcpWorker(ctx, address, "remote-a-0", w1)
            again.hello.pid = 3
            await beat_until([again, thief], lambda: disp.workers.get("remote-a-0") is not None
                             and disp.workers["remote-a-0"].hello.pid == 3)
            assert await disp._send("remote-a-0", Cancel("r2"))
            seen = again.received()
            while seen is not None and not isinstance(seen, Cancel):
                seen = again.received()
            assert seen == Cancel("r2")
        finally:
            ctx.destroy(linger=0)

    with caplog.at_level(logging.WARNING, logger="router.routing.dispatcher"):
        run(body, worker_listen=address, worker_keys=os.path.join(ours, "router"))
