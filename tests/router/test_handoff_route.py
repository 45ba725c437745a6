"""The way a prompt's KV takes between hosts (router/routing/handoff_route.py): the
router asks a prefill worker for its KV by value exactly when no decode
worker is on that worker's host, and relays the payload to a decode worker
of another host as it came. Real ZeroMQ sockets: this host's scripted
workers on ipc, remote ones over tcp with CURVE (router/routing/worker_socket.py)."""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import pytest
import zmq
import zmq.asyncio

from deploy import keys_cmd
from protos import transport
from protos.messages import (ArenaSlice, DecodeRequest, KVHandoff, KVShard, PrefillDone, PrefillRequest, TokenBatch,
                             TokenUpdate, WorkerHello, WorkerLimits)
from tests.support.dispatcher import request, run, wait_for
from tests.support.server import free_port

PAYLOAD_BYTES = 3 << 20  # a few MB: more than one tcp read, one frame


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    assert keys_cmd.run(argparse.Namespace(out=str(base), name=["p", "d"], force=False)) == 0
    return base


class RemoteScripted:
    """A split worker of another host, over tcp with CURVE, that the test scripts."""

    def __init__(self, ctx, address, keys_dir, wid, roles):
        self.hello = WorkerHello(wid, roles, pid=5000 + len(wid), state="ready", kv_host=wid)
        self.sock = transport.make_socket(ctx, zmq.DEALER)
        transport.curve_client(self.sock, *transport.worker_keys(keys_dir))
        self.sock.connect(address)

    async def beat(self):
        await transport.asend(self.sock, self.hello)

    async def next(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            assert await self.sock.poll(int(left * 1000)), "nothing arrived"
            msg = await transport.arecv(self.sock)
            if isinstance(msg, WorkerLimits):
                self.hello.limits_version = msg.version
                continue
            return msg


async def joined(disp, workers, names):
    """Beat until the router knows every one of `names` (a CURVE handshake
    takes its time); then a task beats on for `workers` (a list: take one out
    to silence it) until the test's end, as live workers do."""
    for _ in range(200):
        for w in workers:
            await w.beat()
        if set(names) <= set(disp.workers):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError(f"never joined: {set(names) - set(disp.workers)}")

    async def beating():
        while True:
            for w in list(workers):
                await w.beat()
            await asyncio.sleep(0.1)

    return asyncio.create_task(beating())


async def served(disp, rid, play) -> list[int]:
    """The tokens of request `rid` while `play()` scripts the workers; a
    failure of the script fails at once, not at the request's deadline."""
    async def tokens():
        return [e.token async for e in disp.generate(request(rid))]

    got, _ = await asyncio.gather(tokens(), play())
    return got


async def next_of(worker, kind):
    """The next message of type `kind` to `worker` (a moved request's Cancel may come first)."""
    while True:
        msg = await worker.next()
        if isinstance(msg, kind):
            return msg


def by_value(rid, payload):
    """A handoff by value as a prefill worker writes it: layers are offsets into the payload."""
    layers = [[ArenaSlice(0, 64, "float32", [1, 1, 4, 4]), ArenaSlice(64, 64, "float32", [1, 1, 4, 4])]]
    return KVHandoff(rid, 3, 3, layers=layers, kv_dtype="float32", bytes_moved=payload.nbytes, payload=payload)


def remote_run(keys, body):
    address = f"tcp://127.0.0.1:{free_port()}"

    async def wrapped(disp, worker):
        ctx = zmq.asyncio.Context()
        try:
            await body(disp, worker, lambda name, wid, roles: RemoteScripted(ctx, address, str(keys / name), wid,
                                                                               roles))
        finally:
            ctx.destroy(linger=0)

    run(wrapped, worker_listen=address, worker_keys=str(keys / "router"))


def test_a_remote_prefill_workers_kv_comes_by_value_and_reaches_this_hosts_decoder(keys):
    payload = np.random.default_rng(0).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)

    async def body(disp, worker, remote):
        far = remote("p", "remote-p-0", ["prefill"])
        near_pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        near_pre.hello.state = "loading"  # not ready yet: the remote one is the only prefill worker
        beats = await joined(disp, [far, near_pre, dec], ["remote-p-0", "prefill-0", "decode-0"])

        async def play_far():
            msg = await far.next()
            assert isinstance(msg, PrefillRequest) and msg.kv_by_value and msg.decode_worker == ""
            await transport.asend(far.sock, PrefillDone("r1", 7, None))
            await transport.asend(far.sock, by_value("r1", payload))
            msg = await dec.next()
            assert isinstance(msg, DecodeRequest) and msg.first_token == 7
            assert msg.handoff.payload is not None and np.array_equal(msg.handoff.payload, payload)
            assert msg.handoff.layers == by_value("r1", payload).layers
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        assert await served(disp, "r1", play_far) == [7, 9]
        sent = disp.metrics.handoff_tokens.labels("sent")._value.get()
        assert sent == 3

        near_pre.hello.state = "ready"  # now a prefill worker whose KV stays on its host: by reference
        await near_pre.beat()
        await wait_for(lambda: disp.workers["prefill-0"].ready)

        async def play_near():
            msg = await near_pre.next()
            assert isinstance(msg, PrefillRequest) and not msg.kv_by_value
            await transport.asend(near_pre.sock, PrefillDone("r2", 7, KVHandoff("r2", 3, 3, arena="a", allocation=1)))
            msg = await dec.next()
            assert isinstance(msg, DecodeRequest) and msg.handoff.payload is None and msg.handoff.arena == "a"
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r2", 9, finish_reason="length")]))

        assert await served(disp, "r2", play_near) == [7, 9]
        beats.cancel()

    remote_run(keys, body)


def test_with_only_a_remote_decoder_this_hosts_prefill_sends_the_kv_by_value_over_tcp(keys):
    payload = np.random.default_rng(1).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)

    async def body(disp, worker, remote):
        pre, far = worker("prefill-0", ["prefill"]), remote("d", "remote-d-0", ["decode"])
        beats = await joined(disp, [pre, far], ["prefill-0", "remote-d-0"])

        async def play():
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and msg.kv_by_value
            await transport.asend(pre.sock, PrefillDone("r1", 7, None))
            await transport.asend(pre.sock, by_value("r1", payload))
            msg = await far.next()
            assert isinstance(msg, DecodeRequest) and np.array_equal(msg.handoff.payload, payload)
            await transport.asend(far.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        assert await served(disp, "r1", play) == [7, 9]
        beats.cancel()

    remote_run(keys, body)


def test_a_handoff_by_reference_never_goes_to_another_hosts_decoder(keys):
    """A prefill worker asked for its KV by reference (a decoder was on its
    host) whose host's decoders all went meanwhile: its handoff is not sent
    to the remote decoder, which could not read it; the request is
    prefilled again, by value this time."""

    async def body(disp, worker, remote):
        pre, near, far = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"]), \
            remote("d", "remote-d-0", ["decode"])
        beating = [pre, near, far]
        beats = await joined(disp, beating, ["prefill-0", "decode-0", "remote-d-0"])

        async def play():
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and not msg.kv_by_value
            beating.remove(near)
            await asyncio.sleep(0.25)  # a beat under way when it left may land still
            assert disp.table.drop("decode-0") is not None  # gone before the handoff arrives
            await transport.asend(pre.sock, PrefillDone(msg.request_id, 7, KVHandoff(msg.request_id, 3, 3, arena="a",
                                                                                      allocation=1)))
            again = await next_of(pre, PrefillRequest)
            assert again.kv_by_value and again.request_id != msg.request_id and again.generated == 1
            await transport.asend(pre.sock, PrefillDone(again.request_id, 8, None))
            await transport.asend(pre.sock, by_value(again.request_id, np.zeros(128, np.uint8)))
            got = await far.next()
            assert isinstance(got, DecodeRequest) and got.handoff.payload is not None
            await transport.asend(far.sock, TokenBatch([TokenUpdate(again.request_id, 9, finish_reason="length")]))

        assert await served(disp, "r1", play) == [7, 8, 9]
        beats.cancel()
        assert await near.silent_for(0.1)  # the unreadable handoff never went anywhere

    remote_run(keys, body)


def test_a_groups_kv_goes_to_a_decode_group_of_its_split_and_never_by_value(keys):
    """A prefill group (split layout, workers/group/handoff_shards.py) hands
    each rank's KV shard through this host's arena to the same rank of a
    decode group: its handoff, every rank's part in it, goes to a decode
    group of the same split, not to a decoder alone (here or remote) that
    is less busy; and with no such group ready, it is not asked by value."""

    async def body(disp, worker, remote):
        pre, group, alone = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"]), \
            worker("decode-1", ["decode"])
        far = remote("d", "remote-d-0", ["decode"])
        pre.hello.kv_shard = group.hello.kv_shard = "tensor 2"
        group.hello.running = 5  # busier than the others: the split decides, not the load
        beats = await joined(disp, [pre, group, alone, far], ["prefill-0", "decode-0", "decode-1", "remote-d-0"])
        parts = [KVShard("a", 2, [[ArenaSlice(0, 64, "float32", [1, 1, 4, 4])] * 2])]

        async def play():
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and not msg.kv_by_value
            await transport.asend(pre.sock, PrefillDone("r1", 7, None))
            await transport.asend(pre.sock, KVHandoff("r1", 3, 3, arena="a", allocation=1, shards=parts))
            msg = await group.next()
            assert isinstance(msg, DecodeRequest) and msg.handoff.allocation == 1 and msg.handoff.shards == parts
            await transport.asend(group.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        assert await served(disp, "r1", play) == [7, 9]
        assert await alone.silent_for(0.1)
        state = disp.workers["prefill-0"]
        assert disp.table.decoder_near(state).hello.worker_id == "decode-0"
        assert disp.table.drop("decode-0") is not None
        assert not disp.kv.by_value(state) and disp.table.decoder_near(state) is None
        assert disp.table.decoder_far().hello.kv_shard == ""  # by value: a decoder alone
        beats.cancel()

    remote_run(keys, body)
