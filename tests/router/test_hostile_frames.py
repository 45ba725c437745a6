"""The attack on the router's worker socket: a peer on it (a broken worker, or
anything that can reach the socket) sends malformed frames, messages with
hostile values, and messages about requests that are not its own.

What must not happen: the receive loop dying (one array descriptor without
"d" used to raise KeyError there and leave the router deaf for good), a
forged message reaching a client's stream, a flood of bad frames filling the
log, or a legitimate worker being dropped for one bad frame of its own."""

from __future__ import annotations

import asyncio
import logging
import os

import msgpack

from protos import transport
from protos.messages import (
    VERSION, Cancel, DecodeRequest, KVHandoff, PrefillDone, PrefillRequest, RequestFailed, SamplingParams, TokenBatch,
    TokenUpdate, VisionDone, WorkerHello,
)
from tests.support.dispatcher import request, run, wait_for


def _raw(name, body, *frames):
    return [msgpack.packb({"v": VERSION, "t": name, "b": body}), *frames]


_DEEP = []
for _ in range(500):
    _DEEP = [_DEEP]

MALFORMED = [
    [b"\x00garbage"],
    [b""],
    [os.urandom(4096)],
    [b"\x91" * 100_000 + b"\xc0"],  # nested past msgpack's own limit
    [msgpack.packb({"v": VERSION + 1, "t": "TokenBatch", "b": {"updates": []}})],
    [msgpack.packb({"v": VERSION, "t": "TokenBatch"})],  # no body
    [msgpack.packb({"v": VERSION, "t": "NoSuchMessage", "b": {}})],
    # Array descriptors without "d" or "s", where the old codec indexed them blindly.
    _raw("PrefillDone", {"request_id": "r", "first_token": 1, "handoff": {"~a": 0, "s": [4]}}, b"abcd"),
    _raw("TokenBatch", {"updates": [{"~a": 0, "d": "|u1"}]}, b"x"),
    _raw("KVHandoff", {"request_id": "r", "num_tokens": 1, "rope_offset": 1, "layers": [[{"~a": 0}]]}, b"x"),
    # An object array: what would unpickle, if anything did.
    _raw("TokenBatch", {"updates": [{"~a": 0, "d": "O", "s": [1]}]}, b"\x80\x04N."),
    _raw("KVHandoff", {"request_id": "r", "num_tokens": 1, "rope_offset": 1, "cache_meta": [{"x": _DEEP}]}),
    _raw("TokenBatch", {"updates": [{"~t": "TokenUpdate", "request_id": "r", "token": "7"}]}),
    _raw("TokenBatch", {"updates": [{"~t": "NoSuchMessage"}]}),
    _raw("WorkerHello", {"worker_id": "attacker", "roles": [1, None], "pid": 1, "state": "ready"}),
    _raw("WorkerHello", {"worker_id": "attacker", "roles": ["decode"], "pid": 1.5, "state": "ready"}),
    _raw("PrefillRequest", {"request_id": "r", "prompt_tokens": [1], "decode_worker": "",
                            "sampling": {"~t": "SamplingParams", "stop_token_ids": ["a", None]}}),
    [msgpack.packb({"v": VERSION, "t": "Cancel", "b": {"request_id": msgpack.ExtType(1, b"x")}})],
]

# Well-formed, with hostile values or about requests that do not exist.
HOSTILE_MESSAGES = [
    WorkerHello("attacker", ["\x00" * 64, "\U0001F642"], pid=2**63 - 1, state="ready", running=-1,
                waiting=-(2**63), kv_bytes=-1, max_context=-(2**31), hot_kv_bytes=2**64 - 1),
    WorkerHello("attacker", [], pid=-1, state="no such state"),
    TokenBatch([TokenUpdate("no-such-request", 1), TokenUpdate("", -1, finish_reason="x" * 1000)]),
    PrefillDone("no-such-request", 1, None),
    KVHandoff("no-such-request", 1, 1, local=True),
    RequestFailed("no-such-request", "forged", status=-1),
    VisionDone("no-such-request", encoded=-5),
    Cancel("no-such-request"),  # a message the router never takes
    PrefillRequest("r", [1, 2], SamplingParams(max_tokens=-1), ""),
]


def test_hostile_frames_leave_the_router_listening_and_serving(caplog, monkeypatch):
    monkeypatch.setattr(transport, "rejects", transport.RejectLog())  # a log budget of its own
    async def body(disp, worker):
        attacker = worker("attacker", ["vision"])  # a sane hello at the end: the hostile ones are refused
        for frames in MALFORMED:
            await attacker.sock.send_multipart(frames)
        for msg in HOSTILE_MESSAGES:
            await transport.asend(attacker.sock, msg)
        for _ in range(2000):  # a flood: dropped, and logged only a few times
            await attacker.sock.send_multipart([b"\xc1" * 8])
        # A peer's frames arrive in order: once its last hello is in, the loop
        # took every frame above, and still listens.
        attacker.hello.pid = 7
        await attacker.beat()
        await wait_for(lambda: "attacker" in disp.workers and disp.workers["attacker"].hello.pid == 7, timeout=10)
        assert disp.dead_loops() == []

        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await pre.beat()
        await dec.beat()
        await wait_for(lambda: "prefill-0" in disp.workers and "decode-0" in disp.workers)
        player = asyncio.create_task(_serve_while_the_attacker_forges(pre, dec, attacker))
        tokens = [(e.token, e.finish_reason) async for e in disp.generate(request())]
        await player
        assert tokens == [(7, None), (8, None), (9, "length")]  # nothing forged got in
        assert "decode-0" in disp.workers  # its own bad frame cost it nothing
        assert disp.dead_loops() == []

    with caplog.at_level(logging.INFO, logger="protos.transport"):
        run(body)
    rejected = [r for r in caplog.records if r.name == "protos.transport"]
    assert 0 < len(rejected) <= transport.rejects.limit + 1, [r.getMessage() for r in rejected]
    assert transport.rejects.total > 2000


async def _serve_while_the_attacker_forges(pre, dec, attacker):
    """The scripted workers' part of one request, while the attacker sends
    messages about it: every one must be ignored (only the worker the router
    chose speaks for a request)."""
    msg = await pre.next()
    assert isinstance(msg, PrefillRequest)
    rid = msg.request_id
    await transport.asend(attacker.sock, PrefillDone(rid, 666, None, finish_reason="stop"))
    await transport.asend(attacker.sock, RequestFailed(rid, "forged failure"))
    await transport.asend(pre.sock, PrefillDone(rid, 7, KVHandoff(rid, 3, 3)))
    msg = await dec.next()
    assert isinstance(msg, DecodeRequest) and msg.request_id == rid
    await transport.asend(attacker.sock, TokenBatch([TokenUpdate(rid, 666, finish_reason="stop")]))
    await dec.sock.send_multipart([b"\x00garbage"])
    await dec.sock.send_multipart(_raw("TokenBatch", {"updates": [{"~a": 0, "s": [1]}]}, b"x"))
    await transport.asend(dec.sock, TokenBatch([TokenUpdate(rid, 8)]))
    await transport.asend(dec.sock, TokenBatch([TokenUpdate(rid, 9, finish_reason="length")]))
