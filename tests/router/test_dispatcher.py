"""The router's dispatcher against scripted workers on real ZeroMQ sockets:
routing prefill -> decode, garbage on the wire, dead workers, admission."""

from __future__ import annotations

import asyncio
import time

import pytest

from protos import transport
from protos.messages import (
    Cancel, DecodeRequest, KVHandoff, PrefillDone, PrefillRequest, SamplingParams, TokenBatch, TokenUpdate,
)
from router.routing.engine_api import EngineError, EngineEvent, GenerationRequest
from tests.support.dispatcher import request, run, wait_for


def test_request_goes_prefill_then_decode_and_streams_tokens():
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await pre.beat()
        await dec.beat()
        await wait_for(lambda: len(disp.workers) == 2)

        async def play():
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and msg.decode_worker == ""  # split: any decoder
            await transport.asend(pre.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3)))
            msg = await dec.next()
            assert isinstance(msg, DecodeRequest) and msg.first_token == 7 and msg.prompt_tokens == [1, 2, 3]
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1", 8), TokenUpdate("other", 1)]))
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        player = asyncio.create_task(play())
        tokens = [(e.token, e.finish_reason) async for e in disp.generate(request())]
        await player
        assert tokens == [(7, None), (8, None), (9, "length")]
        assert disp.requests == {}

    run(body)


def test_the_deadline_is_on_progress_a_slow_long_answer_goes_on_and_a_stall_fails():
    """request_timeout_s bounds the wait for the next token, not the whole
    answer: tokens 0.1 s apart for over twice the deadline all arrive (a
    deadline 6x the gap: a loaded box's late wake-up is no stall); then a
    decode worker that stops sending fails the request with a 504 (which the
    HTTP layer turns into what was generated, ended "length") and the
    request is cancelled on it."""
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await pre.beat()
        await dec.beat()
        await wait_for(lambda: len(disp.workers) == 2)

        async def play(rid, tokens, then_stall):
            assert isinstance(await pre.next(), PrefillRequest)
            await transport.asend(pre.sock, PrefillDone(rid, 7, KVHandoff(rid, 3, 3)))
            assert isinstance(await dec.next(), DecodeRequest)
            for i in range(tokens):
                await asyncio.sleep(0.1)
                last = i + 1 == tokens and not then_stall
                await transport.asend(dec.sock, TokenBatch([TokenUpdate(rid, 10 + i, finish_reason="length" if last else None)]))
            if then_stall:
                assert isinstance(await dec.next(timeout=5), Cancel)

        player = asyncio.create_task(play("r1", 14, then_stall=False))
        tokens = [e.token async for e in disp.generate(request("r1", n=15))]
        await player
        assert tokens == [7, *range(10, 24)]  # 1.4 s of answer against a 0.6 s deadline

        player = asyncio.create_task(play("r2", 2, then_stall=True))
        got = []
        with pytest.raises(EngineError) as caught:
            async for e in disp.generate(request("r2", n=9)):
                got.append(e.token)
        await player
        assert got == [7, 10, 11] and caught.value.status == 504

    run(body, request_timeout_s=0.6)


def test_garbage_on_the_wire_is_dropped_and_the_router_keeps_serving():
    async def body(disp, worker):
        w = worker("prefill-0", ["prefill", "decode"])
        await w.sock.send_multipart([b"\x00garbage"])
        await w.sock.send_multipart([b'\x83\xa1v\x63\xa1t\xa6Cancel\xa1b\x80'])  # version 99
        await w.beat()
        await wait_for(lambda: "prefill-0" in disp.workers)

    run(body)


def test_silent_worker_is_dropped_and_its_request_fails_when_none_comes_back():
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await pre.beat()
        await dec.beat()
        await wait_for(lambda: len(disp.workers) == 2)

        async def keep_decoder_alive():
            while True:
                await dec.beat()
                await asyncio.sleep(0.05)

        alive = asyncio.create_task(keep_decoder_alive())
        t0 = time.monotonic()
        with pytest.raises(EngineError) as e:
            async for _ in disp.generate(request()):
                pass
        alive.cancel()
        # The request waited migrate_timeout_s for a prefill worker to come back.
        assert e.value.status == 503 and "missed heartbeats" in str(e.value) and "no worker took its place" in str(e.value)
        # Expected ~1.5 s (1 s of silence, then 0.5 s); without the migrate wait
        # it would be run()'s 30 s cap or the 60 s default.
        assert time.monotonic() - t0 < 5.0
        assert "prefill-0" not in disp.workers and "decode-0" in disp.workers

    # Silence is what this test is about: a short heartbeat timeout (run()'s is
    # 5 s), long enough that the beating decoder survives a stalled loop.
    run(body, migrate_timeout_s=0.5, heartbeat_timeout_s=1.0)


def test_restarted_worker_replaces_the_old_one_at_once():
    async def body(disp, worker):
        w = worker("decode-0", ["decode"])
        await w.beat()
        await wait_for(lambda: "decode-0" in disp.workers)
        w.hello.pid += 1
        await w.beat()
        await wait_for(lambda: disp.workers["decode-0"].hello.pid == w.hello.pid)

    run(body)


def test_no_worker_is_503():
    """Never a ready worker of the role (the server is starting): 503 at once,
    with Retry-After. (A full server is refused before the dispatcher:
    router/guards/admission.py, tests/router/test_admission.py.)"""
    async def body(disp, worker):
        with pytest.raises(EngineError) as e:
            async for _ in disp.generate(request()):
                pass
        assert e.value.status == 503 and e.value.retry_after

    run(body)


def test_metrics_count_what_happened():
    async def body(disp, worker):
        with pytest.raises(EngineError):
            async for _ in disp.generate(request("refused")):
                pass
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await pre.beat()
        await dec.beat()
        await wait_for(lambda: len(disp.workers) == 2)

        async def play():
            await pre.next()
            await transport.asend(pre.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3), cached_tokens=2))
            await dec.next()
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        player = asyncio.create_task(play())
        events = [e async for e in disp.generate(request())]
        await player
        assert events[0].cached_tokens == 2
        text = await disp.metrics_text()
        for line in ('tandem_requests_total{status="ok"} 1.0', 'tandem_requests_total{status="503"} 1.0',
                     "tandem_prompt_tokens_total 3.0", "tandem_generation_tokens_total 2.0",
                     "tandem_prefix_cache_queries_total 1.0", "tandem_prefix_cache_hit_tokens_total 2.0",
                     "tandem_time_to_first_token_seconds_count 1.0", "tandem_inter_token_latency_seconds_count 1.0",
                     'tandem_worker_requests_running{pid="1009",role="prefill"} 0.0',
                     'tandem_cache_bytes{tier="memory"} 0.0'):
            assert line in text, line

    run(body)


def test_prefill_routing_follows_the_prefix_unless_that_worker_is_swamped():
    async def body(disp, worker):
        a, b = worker("prefill-a", ["prefill"]), worker("prefill-b", ["prefill"])
        await a.beat()
        await b.beat()
        await wait_for(lambda: len(disp.workers) == 2)
        bs = disp.settings.block_size
        shared = list(range(1, 4 * bs + 1))

        def req(rid, tail):
            return GenerationRequest(rid, shared + tail, SamplingParams(max_tokens=4, temperature=0.0))

        gens = []

        async def start(r):
            g = disp.generate(r)
            gens.append((g, asyncio.create_task(g.__anext__())))
            await wait_for(lambda: r.request_id in disp.requests)
            return disp.requests[r.request_id].prefill_worker

        first = await start(req("r0", [7]))
        # Same system prompt, different questions: all follow the first one...
        assert [await start(req(f"r{i}", [8 + i])) for i in range(1, 3)] == [first, first]
        # ...until that worker is AFFINITY_SLACK requests busier than the other.
        assert await start(req("r3", [20])) != first
        # An unrelated prompt goes to the least-loaded worker.
        assert await start(GenerationRequest("x", [9] * (2 * bs), SamplingParams())) != first
        for g, t in gens:
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)
            await g.aclose()

    run(body)


def test_first_token_streams_before_the_kv_handoff_arrives():
    """PrefillDone without a handoff: the client has its first token while
    the prefill worker still writes the KV; KVHandoff then starts decode."""
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await pre.beat()
        await dec.beat()
        await wait_for(lambda: len(disp.workers) == 2)
        first_seen = asyncio.Event()

        async def play():
            await pre.next()
            await transport.asend(pre.sock, PrefillDone("r1", 7, None))
            await asyncio.wait_for(first_seen.wait(), 5)
            assert await dec.silent_for(0.1), "decode was asked before the KV was handed over"
            await transport.asend(pre.sock, KVHandoff("r1", 3, 3))
            msg = await dec.next()
            assert isinstance(msg, DecodeRequest) and msg.first_token == 7
            await transport.asend(dec.sock, TokenBatch([TokenUpdate("r1", 9, finish_reason="length")]))

        player = asyncio.create_task(play())
        tokens = []
        async for e in disp.generate(request()):
            tokens.append(e.token)
            first_seen.set()
        await player
        assert tokens == [7, 9]
        assert disp.requests == {}

    run(body)


def test_a_cancel_in_the_instant_a_token_arrives_reaches_the_decode_worker():
    """The client goes (its task is cancelled) just as the next token comes in.
    On Python 3.11 asyncio.wait_for then returned the token and dropped the
    cancel: the request decoded on, unseen, to max_tokens."""
    async def body(disp, worker):
        pre, dec = worker("prefill-0", ["prefill"]), worker("decode-0", ["decode"])
        await pre.beat()
        await dec.beat()
        await wait_for(lambda: len(disp.workers) == 2)
        tokens = []

        async def consume():
            async for e in disp.generate(request(n=1000)):
                tokens.append(e.token)

        consumer = asyncio.create_task(consume())
        await pre.next()
        await transport.asend(pre.sock, PrefillDone("r1", 7, KVHandoff("r1", 3, 3)))
        assert isinstance(await dec.next(), DecodeRequest)
        await wait_for(lambda: tokens == [7])
        disp.requests["r1"].events.put_nowait(EngineEvent(8, None, None))  # arrives...
        consumer.cancel()  # ...as the client goes
        done, _ = await asyncio.wait({consumer}, timeout=3)
        assert done and consumer.cancelled(), "the cancel was lost: the request goes on"
        msg = await dec.next()
        assert isinstance(msg, Cancel) and msg.request_id == "r1"
        assert disp.requests == {}

    run(body)


def test_pictures_a_vision_worker_stored_go_straight_to_prefill():
    from protos.messages import ImageInput, VisionDone, VisionRequest

    async def body(disp, worker):
        vis, pre = worker("vision-0", ["vision"]), worker("prefill-0", ["prefill", "decode"])
        await vis.beat()
        await pre.beat()
        await wait_for(lambda: len(disp.workers) == 2)

        def with_image(rid, h):
            r = request(rid, n=1)
            r.images = [ImageInput(h, None, 0, 1)]
            return r

        async def play(rid, h, expect_vision):
            if expect_vision:
                msg = await vis.next()
                assert isinstance(msg, VisionRequest) and msg.images[0].content_hash == h
                await transport.asend(vis.sock, VisionDone(rid, encoded=1))
            msg = await pre.next()
            assert isinstance(msg, PrefillRequest) and msg.request_id == rid
            await transport.asend(pre.sock, PrefillDone(rid, 7, KVHandoff(rid, 3, 3, local=True), finish_reason="length"))

        for rid, h, expect_vision in (("a", "h1", True), ("b", "h1", False), ("c", "h2", True)):
            player = asyncio.create_task(play(rid, h, expect_vision))
            assert [e.token async for e in disp.generate(with_image(rid, h))] == [7]
            await player
        assert not await vis.sock.poll(100)  # "b" never reached the vision worker

    run(body)


def test_a_hello_that_makes_no_sense_is_refused():
    """Negative load would make a worker everyone's first choice; unknown
    roles or states are no worker at all."""
    async def body(disp, worker):
        bad = [worker("w-neg", ["decode"]), worker("w-role", ["decode", "miner"]), worker("w-state", ["decode"])]
        bad[0].hello.running = -5
        bad[2].hello.state = "king"
        good = worker("w-good", ["decode"])
        for w in bad + [good]:
            await w.beat()
        await wait_for(lambda: "w-good" in disp.workers)
        await asyncio.sleep(0.1)
        assert sorted(disp.workers) == ["w-good"]

    run(body)
