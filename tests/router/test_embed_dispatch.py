"""The dispatcher's `embed` against scripted embed workers on real ZeroMQ
sockets: the call and its answer, a worker's refusal, a worker that dies
under it (sent again to another), none alive (503), and the deadline (504,
the work cancelled on the worker)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from protos import transport
from protos.messages import Cancel, EmbedRequest, EmbedResult, RequestFailed
from router.routing.engine_api import EngineError
from tests.support.dispatcher import run, wait_for

VECTORS = np.arange(6, dtype=np.float32).reshape(2, 3)


async def ready(disp, worker, *wids):
    workers = [worker(wid, ["embed"]) for wid in wids]
    for w in workers:
        await w.beat()
    await wait_for(lambda: len(disp.table.ready_with("embed")) == len(wids))
    return workers


def test_an_embed_call_goes_to_an_embed_worker_and_returns_its_vectors():
    async def body(disp, worker):
        (emb,) = await ready(disp, worker, "embed-0")

        async def play():
            msg = await emb.next()
            assert isinstance(msg, EmbedRequest) and msg.inputs == [[1, 2], [3]] and msg.dimensions == 2
            assert disp.workers["embed-0"].load() == 1  # counted while it runs
            await transport.asend(emb.sock, EmbedResult(msg.request_id, VECTORS, 3, 1))

        player = asyncio.create_task(play())
        vectors, tokens = await disp.embed([[1, 2], [3]], 2, time.monotonic() + 5)
        await player
        np.testing.assert_array_equal(vectors, VECTORS)
        assert tokens == 3 and disp.workers["embed-0"].load() == 0 and disp._embeds == {}

    run(body)


def test_a_workers_refusal_is_the_callers_error_with_its_status():
    async def body(disp, worker):
        (emb,) = await ready(disp, worker, "embed-0")

        async def play():
            msg = await emb.next()
            await transport.asend(emb.sock, RequestFailed(msg.request_id, "this model does not support 'dimensions'",
                                                          400))

        player = asyncio.create_task(play())
        with pytest.raises(EngineError) as err:
            await disp.embed([[1]], 8, time.monotonic() + 5)
        await player
        assert err.value.status == 400 and "dimensions" in err.value.message

    run(body)


def test_a_worker_that_dies_under_a_call_hands_it_to_another():
    async def body(disp, worker):
        (dying,) = await ready(disp, worker, "embed-0")

        async def play():
            msg = await dying.next()
            (other,) = await ready(disp, worker, "embed-1")
            dying.hello.state = "stopping"
            await dying.beat()
            again = await other.next()
            assert isinstance(again, EmbedRequest) and again.inputs == msg.inputs and again.request_id != msg.request_id
            await transport.asend(dying.sock, EmbedResult(msg.request_id, VECTORS * 0, 3))  # too late: not taken
            await transport.asend(other.sock, EmbedResult(again.request_id, VECTORS, 3))

        player = asyncio.create_task(play())
        vectors, _ = await disp.embed([[1, 2], [3]], 0, time.monotonic() + 5)
        await player
        np.testing.assert_array_equal(vectors, VECTORS)

    run(body)


def test_no_embed_worker_is_a_503_at_once_and_a_silent_one_a_504_that_cancels_the_work():
    async def body(disp, worker):
        t0 = time.monotonic()
        with pytest.raises(EngineError) as err:
            await disp.embed([[1]], 0, time.monotonic() + 5)
        assert err.value.status == 503 and time.monotonic() - t0 < 2  # no embed worker was ever ready

        (emb,) = await ready(disp, worker, "embed-0")
        with pytest.raises(EngineError) as err:
            await disp.embed([[1]], 0, time.monotonic() + 0.3)
        assert err.value.status == 504
        sent = await emb.next()
        assert isinstance(sent, EmbedRequest)
        cancel = await emb.next()
        assert isinstance(cancel, Cancel) and cancel.request_id == sent.request_id

    run(body)
