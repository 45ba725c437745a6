"""Requests outlive their workers: the dispatcher against scripted workers on
real ZeroMQ sockets. A worker that dies (replaced by a new process, or
silent) has its requests resumed elsewhere with the answer so far in the
prompt, the client's stream going on with no token lost or repeated; what a
dead or orphaned worker still sends is not taken, and is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from protos import transport
from protos.messages import (
    Cancel, DecodeRequest, KVHandoff, PrefillDone, PrefillRequest, TokenBatch, TokenUpdate,
)
from router.routing.engine_api import EngineError
from tests.support.dispatcher import request, run, wait_for


async def ready(*workers):
    """Each worker says hello, then keeps beating, as a live worker does."""
    async def beat(w):
        while True:
            await w.beat()
            await asyncio.sleep(0.05)

    for w in workers:
        await w.beat()
        asyncio.get_running_loop().create_task(beat(w))


async def restart(w):
    """The supervisor's restart: a new process says hello under the same id."""
    w.hello.pid += 100
    await w.beat()


def test_decode_worker_dies_mid_stream_and_the_request_resumes_with_its_answer_so_far():
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await ready(pre, dec)
        await wait_for(lambda: len(disp.workers) == 2)

        async def play():
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and msg.request_id == "r1" and msg.generated == 0
            await transport.asend(pre.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3), cached_tokens=2))
            msg = await dec.next()
            assert isinstance(msg, DecodeRequest) and msg.generated == 1
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1", 8)]))
            await wait_for(lambda: disp.requests["r1"].answer == [7, 8])
            await restart(dec)  # decode-0 died: its replacement knows nothing of r1
            # The dead process's last words (in flight before it died) are not taken.
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1", 666)]))
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest)
            assert msg.request_id == "r1~1" and msg.prompt_tokens == [1, 2, 3, 7, 8] and msg.generated == 2
            await transport.asend(pre.sock, PrefillDone("r1~1", 9, KVHandoff("r1~1", 5, 5), cached_tokens=4))
            msgs = [await dec.next(), await dec.next()]
            decode = next(m for m in msgs if isinstance(m, DecodeRequest))
            assert any(isinstance(m, Cancel) and m.request_id == "r1" for m in msgs)  # the stray tokens' id
            assert decode.request_id == "r1~1" and decode.prompt_tokens == [1, 2, 3, 7, 8]
            assert decode.first_token == 9 and decode.generated == 3
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1~1", 10, finish_reason="length")]))

        player = asyncio.create_task(play())
        events = [e async for e in disp.generate(request(n=4))]
        await player
        assert [(e.token, e.finish_reason) for e in events] == [(7, None), (8, None), (9, None), (10, "length")]
        assert [e.cached_tokens for e in events] == [2, 0, 0, 0]  # the resumed prefill's hit is not the client's
        assert disp.requests == {}
        text = await disp.metrics_text()
        assert 'tandem_request_moves_total{role="decode"} 1.0' in text
        assert 'tandem_requests_total{status="ok"} 1.0' in text

    run(body)


def test_a_decode_worker_that_dies_before_reading_its_handoff_has_it_given_back():
    """A decode worker (a group whose rank died) that dies with a handoff
    unread never frees its arena slot: the router gives it back as it moves
    the request (issue 40: they expired unfreed), not left to its TTL."""
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await ready(pre, dec)
        await wait_for(lambda: len(disp.workers) == 2)
        freed = []
        disp.kv.free = freed.append

        async def play():
            await pre.next()
            await transport.asend(pre.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3, arena="a", allocation=5)))
            assert isinstance(await dec.next(), DecodeRequest)
            await restart(dec)  # died before reading it
            msg = await pre.next()
            assert msg.request_id == "r1~1"
            await transport.asend(pre.sock, PrefillDone("r1~1", 8, KVHandoff("r1~1", 4, 4)))
            msg = await dec.next()
            while not isinstance(msg, DecodeRequest):  # the old id's Cancel first
                msg = await dec.next()
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1~1", 9, finish_reason="stop")]))

        player = asyncio.create_task(play())
        assert [e.token async for e in disp.generate(request())] == [7, 8, 9]
        await player
        assert [(h.request_id, h.allocation) for h in freed] == [("r1", 5)]

    run(body)


def test_prefill_worker_dies_and_the_prompt_goes_to_another():
    async def body(disp, worker):
        pre0, pre1, dec = worker("prefill-0", ["prefill"]), worker("prefill-1", ["prefill"]), worker("decode-0", ["decode"])
        await ready(pre0, dec)
        await wait_for(lambda: len(disp.workers) == 2)

        async def play():
            msg = await pre0.next()
            assert isinstance(msg, PrefillRequest) and msg.request_id == "r1"
            await ready(pre1)
            await wait_for(lambda: "prefill-1" in disp.workers)
            pre0.hello.state = "stopping"  # prefill-0 goes away without answering
            await pre0.beat()
            msg = await pre1.next()
            assert msg.request_id == "r1~1" and msg.prompt_tokens == [1, 2, 3] and msg.generated == 0
            await transport.asend(pre1.sock, PrefillDone("r1~1", 7, None))
            await transport.asend(pre1.sock, KVHandoff("r1~1", 3, 3))
            # prefill-0's late answer for the old id is freed, not taken.
            await transport.asend(pre0.sock, PrefillDone("r1", 99, KVHandoff("r1", 3, 3)))
            msg = await dec.next()
            assert isinstance(msg, DecodeRequest) and msg.request_id == "r1~1" and msg.first_token == 7
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1~1", 8, finish_reason="stop")]))

        player = asyncio.create_task(play())
        tokens = [e.token async for e in disp.generate(request())]
        await player
        assert tokens == [7, 8]

    run(body)


def test_a_request_that_keeps_killing_its_worker_fails_after_max_migrations():
    """A poison request: every worker that runs it dies before it gains a
    token. After max_migrations such deaths it fails instead of taking the
    server down restart after restart."""
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await ready(pre, dec)
        await wait_for(lambda: len(disp.workers) == 2)

        async def play():
            for move in range(3):
                msg = await pre.next()
                while isinstance(msg, Cancel):  # the dead process's copy, sent to its id
                    msg = await pre.next()
                assert isinstance(msg, PrefillRequest) and msg.request_id == ("r1~%d" % move if move else "r1")
                await restart(pre)  # every prefill of it kills the worker

        player = asyncio.create_task(play())
        with pytest.raises(EngineError) as e:
            async for _ in disp.generate(request()):
                pass
        await player
        assert e.value.status == 502 and "3 workers died running this request" in str(e.value)

    run(body, max_migrations=2)


def test_deaths_between_which_the_request_gained_tokens_do_not_add_up():
    """Chaos, not poison: the decode worker dies again and again, but the
    request gains a token on each worker, so it is moved every time."""
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await ready(pre, dec)
        await wait_for(lambda: len(disp.workers) == 2)

        async def next_of(w, kind):
            msg = await w.next()
            while not isinstance(msg, kind):
                msg = await w.next()
            return msg

        async def play():
            token = 7
            for move in range(4):
                msg = await next_of(pre, PrefillRequest)
                await transport.asend(pre.sock, PrefillDone(msg.request_id, token, KVHandoff(msg.request_id, 3, 3)))
                msg = await next_of(dec, DecodeRequest)
                await transport.asend(dec.sock, TokenBatch([TokenUpdate(msg.request_id, token + 1)]))
                await wait_for(lambda: len(disp.requests[msg.request_id].answer) == 2 * (move + 1))
                token += 2
                await restart(dec)
            msg = await next_of(pre, PrefillRequest)
            await transport.asend(pre.sock, PrefillDone(msg.request_id, token, None, finish_reason="length"))

        player = asyncio.create_task(play())
        tokens = [e.token async for e in disp.generate(request(n=9))]
        await player
        assert tokens == list(range(7, 16))

    run(body, max_migrations=2)


def test_tokens_for_requests_nobody_waits_for_are_cancelled_once():
    """A restarted router's workers keep decoding what the old one sent them:
    the new one cancels each such request once, however many tokens come."""
    async def body(disp, worker):
        dec = worker("decode-0", ["decode"])
        await ready(dec)
        await wait_for(lambda: len(disp.workers) == 1)
        for token in range(3):
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("ghost", token), TokenUpdate("spook", token)]))
        got = [await dec.next(), await dec.next()]
        assert sorted(m.request_id for m in got if isinstance(m, Cancel)) == ["ghost", "spook"]
        assert await dec.silent_for(0.3), "cancelled more than once"

    run(body)


def test_a_new_request_waits_for_a_restarting_worker_instead_of_a_503():
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await ready(pre, dec)
        await wait_for(lambda: len(disp.workers) == 2)
        pre.hello.state = "stopping"
        await pre.beat()
        await wait_for(lambda: "prefill-0" not in disp.workers)

        async def play():
            await asyncio.sleep(0.3)
            pre.hello.state, pre.hello.pid = "ready", pre.hello.pid + 1
            await pre.beat()
            msg = await pre.next()
            await transport.asend(pre.sock, PrefillDone(msg.request_id, 7, None, finish_reason="stop"))

        player = asyncio.create_task(play())
        tokens = [e.token async for e in disp.generate(request())]
        await player
        assert tokens == [7]

    run(body)


def test_a_colocated_prefill_nobody_waits_for_is_cancelled():
    """With --colocate the worker keeps a prompt's KV for the decode that
    follows; for a request the router no longer has, it must be told to drop it."""
    async def body(disp, worker):
        w = worker("worker-0", ["prefill", "decode"])
        await ready(w)
        await wait_for(lambda: len(disp.workers) == 1)
        await transport.asend(w.sock, PrefillDone("gone", 7, KVHandoff("gone", 3, 3, local=True)))
        msg = await w.next()
        assert isinstance(msg, Cancel) and msg.request_id == "gone"

    run(body, colocate=True)


def test_the_vision_worker_dies_and_prefill_encodes_the_picture_itself():
    from protos.messages import ImageInput, VisionRequest

    async def body(disp, worker):
        vis, pre = worker("vision-0", ["vision"]), worker("prefill-0", ["prefill", "decode"])
        await ready(vis, pre)
        await wait_for(lambda: len(disp.workers) == 2)
        req = request("r1", n=1)
        req.images = [ImageInput("h1", None, 0, 1)]

        async def play():
            assert isinstance(await vis.next(), VisionRequest)
            vis.hello.state = "stopping"  # it goes away without answering
            await vis.beat()
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and msg.request_id == "r1" and msg.images[0].content_hash == "h1"
            await transport.asend(pre.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3, local=True),
                                                        finish_reason="length"))

        player = asyncio.create_task(play())
        assert [e.token async for e in disp.generate(req)] == [7]
        await player

    run(body, colocate=True)
