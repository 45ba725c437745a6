"""Admission (router/guards/admission.py), written as the attack: a client floods the
router past what it may hold. Past capacity a request is refused with 429 and
Retry-After, in the endpoint's error shape, before its JSON is decoded, its
media fetched, its template applied or its prompt tokenized; and however an
admitted request ends, its place comes back (no leak that would shut the
server to everyone). A real uvicorn on 127.0.0.1 over the scripted engine."""

from __future__ import annotations

import asyncio
import io
import json
import re
import socket
import threading
import time

import httpx
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper

import router.app
from environment.settings import Settings
from router.guards.admission import Admission, capacity
from router.routing.engine_api import EngineError
from router.api.errors import ApiError
from tests.support.fake_engine import FakeEngine
from tests.support.media import MediaHost
from tests.support.router_server import serve_app, wait_for
from tests.support.tiny_vlms import synthetic_image, tiny_vlm

SMALL = dict(max_batch=1, decode_workers=1, max_queue=1, request_timeout_s=30)  # 1 decode row + 1 queued
CHAT = {"model": "tandem-test", "messages": [{"role": "user", "content": "Say hello"}]}
ANTHROPIC = {"model": "tandem-test", "max_tokens": 16, "messages": [{"role": "user", "content": "Say hello"}]}
# Every endpoint that takes a place, with a valid body and whether its errors are Anthropic's.
ENDPOINTS = [
    ("/v1/chat/completions", CHAT, False),
    ("/v1/completions", {"model": "tandem-test", "prompt": "Say hello"}, False),
    ("/v1/responses", {"model": "tandem-test", "input": "Say hello"}, False),
    ("/v1/messages", ANTHROPIC, True),
    ("/v1/messages/count_tokens", {"model": "tandem-test", "messages": ANTHROPIC["messages"]}, True),
]


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    with serve_app(engine, tokenizer, **SMALL) as running:
        yield running


@pytest.fixture(autouse=True)
def every_place_comes_back(engine, server):
    engine.reset()
    engine.say("Hello world.")
    yield
    wait_for(lambda: metric(server, "tandem_requests_admitted") == 0, 5, "an ended request kept its place")


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def send_raw(server, path: str, body: dict) -> socket.socket:
    """A request whose client never reads the answer; closing the socket is the client going away."""
    data = json.dumps(body)
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return conn


class HeavyWork:
    """Counts JSON decoding, chat templates and tokenization in the router."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        monkeypatch.setattr(TokenizerWrapper, "apply_chat_template",
                            self._counted("template", TokenizerWrapper.apply_chat_template))
        monkeypatch.setattr(TokenizerWrapper, "encode",  # else the wrapped tokenizer's
                            self._counted("encode", lambda tok, *a, **k: tok._tokenizer.encode(*a, **k)), raising=False)
        monkeypatch.setattr(router.app, "parse_json", self._counted("parse_json", router.app.parse_json))

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)
        return counted


# --------------------------------------------------------------------------- #
# Past capacity: 429, and nothing heavy
# --------------------------------------------------------------------------- #


def test_capacity_is_the_decode_batches_rows_plus_max_queue():
    assert capacity(Settings(max_batch=4, decode_workers=2, prefill_workers=3, max_queue=5)) == 4 * 2 + 5
    assert capacity(Settings(max_batch=4, colocate=True, prefill_workers=3, max_queue=5)) == 4 * 3 + 5


def test_past_capacity_every_endpoint_is_429_with_retry_after_and_nothing_heavy_runs(server, engine, monkeypatch):
    engine.first_token_delay_s = 30  # the admitted requests sit in a long prefill
    held = [send_raw(server, "/v1/chat/completions", CHAT) for _ in range(2)]
    try:
        wait_for(lambda: len(engine.requests) == 2, 5, "the first two requests were not admitted")
        assert metric(server, "tandem_requests_admitted") == 2
        refused_before = metric(server, "tandem_requests_refused_total")
        work = HeavyWork(monkeypatch)
        for path, body, anthropic in ENDPOINTS:
            response = httpx.post(server.url + path, json=body, timeout=10)
            assert response.status_code == 429, path
            assert response.headers["retry-after"] == "1"
            error = response.json()
            if anthropic:
                assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error", path
            else:
                assert error["error"]["type"] == "rate_limit_error" and error["error"]["code"] == "queue_full", path
        assert work.calls == []  # no JSON decoded, no template, no tokens
        assert len(engine.requests) == 2
        assert metric(server, "tandem_requests_refused_total") == refused_before + len(ENDPOINTS)
        assert metric(server, "tandem_requests_admitted_limit") == 2
    finally:
        for conn in held:
            conn.close()
    wait_for(lambda: metric(server, "tandem_requests_admitted") == 0, 5, "the clients' places did not come back")
    engine.first_token_delay_s = 0
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200


def test_count_tokens_holds_a_place_only_while_it_counts(server, engine):
    engine.first_token_delay_s = 30
    with send_raw(server, "/v1/chat/completions", CHAT):
        wait_for(lambda: len(engine.requests) == 1, 5, "the request was not admitted")
        body = {"model": "tandem-test", "messages": ANTHROPIC["messages"]}
        for _ in range(3):  # one place left: each count takes it and gives it back
            assert httpx.post(server.url + "/v1/messages/count_tokens", json=body, timeout=10).status_code == 200
        assert metric(server, "tandem_requests_admitted") == 1


def test_admitted_bodies_are_bounded_in_bytes():
    admission = Admission(10, timeout_s=5, body_budget=1000)
    first = admission.admit(600)
    with pytest.raises(ApiError) as busy:
        admission.admit(600)  # places are left, bytes are not
    assert busy.value.status == 429 and busy.value.headers["Retry-After"] == "1"
    with pytest.raises(ApiError) as never:
        admission.admit(1001)  # would not fit even alone
    assert never.value.status == 413 and never.value.code == "request_too_large"
    second = admission.admit(400)
    assert admission.body_bytes == 1000 and admission.admitted == 2
    first.release()
    second.release()
    assert admission.body_bytes == 0 and admission.admitted == 0 and admission.admit(1000)


def test_past_the_body_budget_a_request_is_429_in_the_apis_shape(engine, tokenizer):
    with serve_app(engine, tokenizer, **(SMALL | {"max_queue": 3, "admitted_body_bytes": 4000})) as server:
        engine.first_token_delay_s = 30
        big = CHAT | {"user": "u" * 3000}  # ~3 KB of body, few tokens
        with send_raw(server, "/v1/chat/completions", big):
            wait_for(lambda: len(engine.requests) == 1, 5, "the request was not admitted")
            assert metric(server, "tandem_admitted_body_bytes") == len(json.dumps(big))
            response = _post(server, "/v1/messages", ANTHROPIC | {"metadata": {"user_id": "u" * 1000}}, status=429)
            assert response.json()["error"]["type"] == "rate_limit_error" and response.headers["retry-after"] == "1"
            huge = CHAT | {"user": "u" * 5000}
            assert _post(server, body=huge, status=413).json()["error"]["code"] == "request_too_large"
            assert len(engine.requests) == 1 and _post(server, "/v1/messages/count_tokens", ENDPOINTS[4][1])
        wait_for(lambda: metric(server, "tandem_admitted_body_bytes") == 0, 5, "the bytes did not come back")
        wait_for(lambda: metric(server, "tandem_requests_admitted") == 0, 5, "the place did not come back")


# --------------------------------------------------------------------------- #
# However a request ends, its place comes back (checked after every test)
# --------------------------------------------------------------------------- #


def _post(server, path="/v1/chat/completions", body=CHAT, status=200, **kwargs) -> httpx.Response:
    response = httpx.post(server.url + path, timeout=10, **({"json": body} | kwargs))
    assert response.status_code == status, response.text
    return response


def _stream_and_leave(server, engine):
    engine.say("the quick brown fox " * 30)
    engine.token_delay_s = 0.02
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=CHAT | {"stream": True}, timeout=10) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 3:
                break
    wait_for(lambda: engine.cancelled, 5, "the request was not cancelled")


def _leave_while_silent(server, engine):
    engine.first_token_delay_s = 30
    with send_raw(server, "/v1/chat/completions", CHAT):
        wait_for(lambda: engine.requests, 5, "the request was not admitted")
    wait_for(lambda: engine.cancelled, 5, "the request was not cancelled")


def _leave_while_tokenized(server, engine, monkeypatch):
    """The client goes while its prompt is in a thread: the place comes back once the thread is done."""
    original = TokenizerWrapper.apply_chat_template
    started, go = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        started.set()
        go.wait(10)  # held until the test has looked (the timeout only bounds a failed test)
        return original(*args, **kwargs)

    monkeypatch.setattr(TokenizerWrapper, "apply_chat_template", slow)
    try:
        with send_raw(server, "/v1/chat/completions", CHAT):
            assert started.wait(5)
        assert metric(server, "tandem_requests_admitted") == 1  # the thread still works for it
    finally:
        go.set()  # the thread ends: the caller waits for the place to come back


def _template_crashes(server, engine, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("a bug in the template code")

    monkeypatch.setattr(TokenizerWrapper, "apply_chat_template", crash)
    assert _post(server, status=500).json()["error"]["message"] == "Internal server error"


ENDINGS = {
    "answered": lambda s, e, m: _post(s),
    "streamed": lambda s, e, m: _post(s, body=CHAT | {"stream": True}),
    "cut by a stop string": lambda s, e, m: (e.say("Hello world. STOP and more"),
                                             _post(s, body=CHAT | {"stop": "STOP"})),
    "completion": lambda s, e, m: _post(s, "/v1/completions", ENDPOINTS[1][1]),
    "response": lambda s, e, m: _post(s, "/v1/responses", ENDPOINTS[2][1]),
    "message": lambda s, e, m: _post(s, "/v1/messages", ANTHROPIC),
    "tokens counted": lambda s, e, m: _post(s, "/v1/messages/count_tokens", ENDPOINTS[4][1]),
    "invalid JSON": lambda s, e, m: _post(s, status=400, content=b"{", headers={"content-type": "application/json"}),
    "not an object": lambda s, e, m: _post(s, body=[1], status=400),
    "bad value": lambda s, e, m: _post(s, body=CHAT | {"temperature": 5}, status=400),
    "wrong type": lambda s, e, m: _post(s, body=CHAT | {"messages": "hi"}, status=422),
    "unknown model": lambda s, e, m: _post(s, body=CHAT | {"model": "other"}, status=404),
    "prompt too long": lambda s, e, m: _post(s, body={**CHAT, "messages": [{"role": "user", "content": "fox " * 600}]},
                                             status=400),
    "completion refused": lambda s, e, m: _post(s, "/v1/completions", {"model": "tandem-test"}, status=422),
    "message refused": lambda s, e, m: _post(s, "/v1/messages", ANTHROPIC | {"max_tokens": "x"}, status=400),
    "count refused": lambda s, e, m: _post(s, "/v1/messages/count_tokens", {"model": "tandem-test"}, status=400),
    "response refused": lambda s, e, m: _post(s, "/v1/responses", {"model": "tandem-test", "input": 3}, status=422),
    "engine refuses": lambda s, e, m: (setattr(e, "error_before", EngineError(503, "no worker")), _post(s, status=503)),
    "engine fails mid-stream": lambda s, e, m: (setattr(e, "error_after", (2, EngineError(502, "worker died"))),
                                                _post(s, body=CHAT | {"stream": True})),
    "client gone mid-stream": lambda s, e, m: _stream_and_leave(s, e),
    "client gone while the engine is silent": lambda s, e, m: _leave_while_silent(s, e),
    "client gone while its prompt is tokenized": _leave_while_tokenized,
    "template crashes": _template_crashes,
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_every_ending_gives_the_place_back(server, engine, monkeypatch, ending):
    ENDINGS[ending](server, engine, monkeypatch)
    wait_for(lambda: metric(server, "tandem_requests_admitted") == 0, 5, f"{ending}: the place did not come back")


# --------------------------------------------------------------------------- #
# The threads
# --------------------------------------------------------------------------- #


async def _until(predicate, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def _held(started, go):
    """Work for a lane thread that runs until the test sets `go` (the timeout only bounds a failed test)."""
    def work():
        started.release()
        go.wait(10)
    return work


def test_a_thread_still_working_keeps_the_place_of_a_request_that_gave_up():
    async def main():
        admission = Admission(1, timeout_s=5)
        ticket = admission.admit(10)
        started, go = threading.Semaphore(0), threading.Event()
        work = asyncio.ensure_future(ticket.off_loop(_held(started, go)))
        try:
            await _until(lambda: started.acquire(blocking=False))  # its thread runs
            work.cancel()  # the request is gone; its thread is not
            with pytest.raises(asyncio.CancelledError):
                with ticket:
                    await work
            ticket.release()  # twice: still once
            assert admission.admitted == 1
            with pytest.raises(ApiError):
                admission.admit(10)
        finally:
            go.set()
        await _until(lambda: admission.admitted == 0)  # the thread ended: the place is back

    asyncio.run(main())


def test_a_request_waiting_for_a_thread_past_its_deadline_is_504_and_frees_its_place():
    async def main():
        admission = Admission(3, timeout_s=0.2)
        busy = [admission.admit(10) for _ in range(2)]
        started, go = threading.Semaphore(0), threading.Event()
        blockers = [asyncio.ensure_future(t.off_loop(_held(started, go))) for t in busy]
        try:
            for _ in busy:  # both small-lane threads busy
                await _until(lambda: started.acquire(blocking=False))
            late = admission.admit(10)
            with pytest.raises(ApiError) as caught:
                with late:
                    await late.off_loop(lambda: None)
            assert caught.value.status == 504
            assert admission.admitted == 2  # the late one never ran: its place is back at once
            await asyncio.gather(*blockers, return_exceptions=True)  # past their deadline too, their threads held
            for ticket in busy:
                ticket.release()
            assert admission.admitted == 2
        finally:
            go.set()
        await _until(lambda: admission.admitted == 0)  # their threads ended: the places are back

    asyncio.run(main())


def test_many_requests_at_once_each_get_their_own_prompt(tokenizer):
    """Templates and tokenization of concurrent requests share the tokenizer across threads."""
    engine = FakeEngine(tokenizer)
    with serve_app(engine, tokenizer) as server:
        def ask(i: int) -> None:
            body = {**CHAT, "messages": [{"role": "user", "content": f"the cat {i} sat on the mat " * 20}]}
            _post(server, body=body)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(24)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert len(engine.requests) == 24
    for request in engine.requests:
        i = int(tokenizer.decode(request.prompt_tokens).split("the cat ")[1].split()[0])
        messages = [{"role": "user", "content": f"the cat {i} sat on the mat " * 20}]
        assert request.prompt_tokens == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# --------------------------------------------------------------------------- #
# Media come after admission
# --------------------------------------------------------------------------- #


def _png() -> bytes:
    out = io.BytesIO()
    synthetic_image(32, 48, 1).save(out, "PNG")
    return out.getvalue()


def test_a_refused_request_fetches_no_image(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load

    folder = tiny_vlm(tmp_path_factory)
    tokenizer = load(folder)
    engine = FakeEngine(tokenizer, max_context=4096)
    engine.say("A picture.")
    with MediaHost("127.0.0.1", files={"/pic.png": _png()}) as host, \
            serve_app(engine, tokenizer, model_dir=str(folder), allow_media_hosts=("127.0.0.1",), **SMALL) as server:
        content = [{"type": "text", "text": "What is it?"},
                   {"type": "image_url", "image_url": {"url": host.url("/pic.png")}}]
        body = {"model": "tandem-test", "messages": [{"role": "user", "content": content}]}
        engine.first_token_delay_s = 30
        with send_raw(server, "/v1/chat/completions", CHAT), send_raw(server, "/v1/chat/completions", CHAT):
            wait_for(lambda: len(engine.requests) == 2, 5, "the first two requests were not admitted")
            assert _post(server, body=body, status=429)
            assert host.requests == []  # the server reached for nothing
        wait_for(lambda: metric(server, "tandem_requests_admitted") == 0, 5, "the places did not come back")
        engine.first_token_delay_s = 0
        assert _post(server, body=body).json()["choices"][0]["message"]["content"] == "A picture."
        assert [path for path, _ in host.requests] == ["/pic.png"] and len(engine.requests[-1].images) == 1
        bad = {**body, "messages": [{"role": "user", "content": content[:1] + [
            {"type": "image_url", "image_url": {"url": host.url("/missing.png")}}]}]}
        _post(server, body=bad, status=400)  # refused while its media load: the place comes back too
        wait_for(lambda: metric(server, "tandem_requests_admitted") == 0, 5, "a refused image kept its place")
